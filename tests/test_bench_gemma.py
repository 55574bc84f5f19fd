"""The bench on Gemma 3: transformers' Gemma3ForCausalLM built by bench/peers.py from verispec's weights
gives verispec's logits (a tiny random Gemma with a window of 5, so local layers cut keys, random norm
weights, a query scalar unlike head_dim and softcapping on), and `bench latency|throughput|spec --peer hf`
run end to end on a tiny random gemma-3-270m (CPU float32) with transformers' greedy tokens equal to ours.
Fast: no model file (the registry shapes of gemma-3-270m come from bench/models.py's table)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from verispec.bench.models import REGISTRY_SHAPES, random_model, shapes_for
from verispec.bench.peers import hf_model
from verispec.config import ModelConfig
from verispec.entrypoints.cli import main as cli
from verispec.worker.inputs import SeqChunk, allocate_kv_cache, build_batch

WINDOW, LAYERS, PATTERN, VOCAB = 5, 5, 3, 300
SEQ = [(7 * i + 3) % VOCAB for i in range(37)]
TINY = json.dumps({"hidden_size": 64, "intermediate_size": 96, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                   "head_dim": 16, "vocab_size": 2048, "sliding_window": 8, "sliding_window_pattern": 2})


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: one intra-op thread avoids spin contention on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_gemma():
    cfg = ModelConfig.for_arch(
        "gemma3", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=LAYERS, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=1_000_000.0, max_position_embeddings=256, sliding_window=WINDOW,
        sliding_window_pattern=PATTERN, query_pre_attn_scalar=24, final_logit_softcapping=3.0)
    model = random_model(cfg, torch.device("cpu"), torch.float32, seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # verispec holds 1 + w: random w, so a lost or doubled 1 shows
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return model


def ours(model) -> torch.Tensor:
    """verispec's logits of SEQ: one prefill through a paged cache."""
    c = model.config
    kv = allocate_kv_cache(c.num_layers, 4, 16, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    ids, pos, meta = build_batch([SeqChunk(SEQ, 0, [2, 0, 3])], 16, torch.device("cpu"))
    with torch.inference_mode():
        hidden, _ = model(ids, pos, meta, kv)
        return model.compute_logits(hidden)


def test_hf_peer_gemma3_gives_our_logits(tiny_gemma):
    hf = hf_model(tiny_gemma)
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    assert hf.config.layer_types == ["sliding_attention", "sliding_attention", "full_attention",
                                     "sliding_attention", "sliding_attention"]
    with torch.no_grad():
        ref = hf(torch.tensor([SEQ])).logits[0].float()
    torch.testing.assert_close(ours(tiny_gemma), ref, atol=1e-4, rtol=1e-4)
    # The peer shares verispec's tensors (no copy of the big ones) and leaves verispec's norms as they were.
    assert hf.model.embed_tokens.weight.data_ptr() == tiny_gemma.model.embed_tokens.weight.data_ptr()
    norm = tiny_gemma.model.layers[0].input_layernorm.weight
    torch.testing.assert_close(hf.model.layers[0].input_layernorm.weight + 1, norm)


def test_hf_peer_refuses_other_architectures():
    cfg = ModelConfig.for_arch("llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                               num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=64)
    with pytest.raises(ValueError, match="not 'llama'"):
        hf_model(random_model(cfg, torch.device("cpu"), torch.float32))


def test_gemma_shapes_table_without_the_file(monkeypatch):
    import verispec.bench.models as bench_models

    monkeypatch.setattr(bench_models, "local_gguf", lambda name: None)
    cfg = shapes_for("gemma-3-270m", {"num_layers": 3})
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.sliding_window, cfg.name) == (
        "gemma3", 3, 640, 512, "gemma-3-270m")


def test_gemma_shapes_table_matches_the_gguf(gemma_path):
    from verispec.loader.gguf import read_model_config

    shapes = dict(REGISTRY_SHAPES["gemma-3-270m"])
    table = ModelConfig.for_arch(shapes.pop("arch"), **shapes)
    real = read_model_config(gemma_path)
    assert dataclasses.replace(table, name=real.name) == real


def _bench(tmp_path, *argv: str) -> dict:
    out = tmp_path / "r.json"
    assert cli(["bench", *argv, "--model", "gemma-3-270m", "--random-weights", "--device", "cpu", "--dtype",
                "float32", "--model-overrides", TINY, "--peer", "hf", "--no-compile", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_bench_latency_and_throughput_gemma_with_hf_peer(tmp_path):
    lat = _bench(tmp_path, "latency", "--batch-sizes", "1", "--input-len", "12", "--output-len", "6",
                 "--num-iters", "1")
    assert lat["model"] == "gemma-3-270m" and [p["peer"] for p in lat["peers"]] == ["hf eager"]
    assert lat["rows"][0]["decode_tok_s"] > 0 and lat["peers"][0]["decode_tok_s"] > 0
    thr = _bench(tmp_path, "throughput", "--num-seqs", "3", "--sweep-input-len", "12", "--sweep-output-len", "6",
                 "--repeats", "1")
    assert thr["rows"][0]["num_seqs"] == 3 and thr["rows"][0]["output_tokens"] == 18
    assert thr["peers"][0]["ratio"] > 0


def test_bench_spec_gemma_hf_tokens_equal_ours(tmp_path):
    """Prompts of 20 token ids (longer than the window of 8): transformers' greedy tokens equal verispec's."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": [(5 * i + j) % 2000 + 3 for j in range(20)]}) + "\n"
                               for i in range(2)))
    res = _bench(tmp_path, "spec", "--methods", "none,ngram", "--batch-sizes", "1", "--num-prompts", "2",
                 "--output-len", "12", "--repeats", "1", "--prompts", str(prompts))
    assert [r["mismatches"] for r in res["rows"]] == [0, 0]
    peers = {p["peer"]: p for p in res["peers"]}
    assert set(peers) == {"hf eager", "hf prompt lookup"}
    for p in peers.values():
        assert "error" not in p and p["mismatches"] == 0, p
