"""A Llama GGUF in llama.cpp's layout (q/k rows permuted) loads into the same model in verispec as in
transformers, and both equal the Hugging Face model the file was written from.

transformers de-permutes q/k with its own code (LlamaTensorProcessor), verispec with
loader/weights.py::unpermute_rope; the original model (before the GGUF) catches a writer bug that both
readers would undo alike. float32 on the CPU: logits at every position within 1e-4, and greedy tokens
through verispec's engine equal the original model's."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from llama_gguf import CORPUS, LLAMA3_ROPE, rope_theta, tiny_llama, write_llama_gguf

VOCAB = 320
ATOL = 1e-4
NUM_GREEDY = 24


def _sequences() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(VOCAB - 2) for _ in range(n)] for n in (1, 6, 23, 61)]


def verispec_logits(model, seq: list[int]) -> torch.Tensor:
    """[len(seq), vocab] float32 logits of one prefill over `seq` (verispec's model, CPU)."""
    from verispec.worker.inputs import SeqChunk, allocate_kv_cache, build_batch

    c = model.config
    blocks = -(-len(seq) // 16)
    kv = allocate_kv_cache(c.num_layers, blocks, 16, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    ids, pos, meta = build_batch([SeqChunk(seq, 0, list(range(blocks)))], 16, torch.device("cpu"))
    with torch.inference_mode():
        hidden, _ = model(ids, pos, meta, kv)
        return model.compute_logits(hidden).float()


def hf_logits(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0].float()


def _rounded_to_f16(model):
    """The original model with every 2-D weight rounded to float16 (what an f16 GGUF stores), in float32."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            if p.ndim > 1:
                p.copy_(p.half().float())
    return out


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory):
    """verispec's dequantized-weight cache in a temporary folder, not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERISPEC_CACHE_DIR", str(tmp_path_factory.mktemp("vcache")))
        yield


@pytest.fixture(scope="module", params=[("f32", False), ("f16", True)], ids=["f32", "f16-tied"])
def llama(request, tmp_path_factory):
    """(original HF model, its weights as the GGUF stores them, GGUF path, transformers' model from the GGUF);
    F32 with an output.weight, and F16 with tied embeddings (no output.weight)."""
    from transformers import AutoModelForCausalLM

    outtype, tie = request.param
    original = tiny_llama(VOCAB, seed=1, tie=tie)
    folder = tmp_path_factory.mktemp(f"llama-{outtype}")
    path = folder / f"tiny-llama-{outtype}.gguf"
    write_llama_gguf(original, path, outtype)
    stored = original if outtype == "f32" else _rounded_to_f16(original)
    from_gguf = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=path.name, dtype=torch.float32).eval()
    return original, stored, path, from_gguf


@pytest.fixture(scope="module")
def ours(llama):
    from verispec.loader.model_loader import load_model

    _, _, path, _ = llama
    return load_model(str(path), torch.device("cpu"), torch.float32, progress=False)


def test_config_read_like_transformers(llama, ours):
    original, _, _, from_gguf = llama
    _, cfg, _ = ours
    hc = from_gguf.config
    assert (cfg.arch, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        "llama", hc.vocab_size, hc.hidden_size, hc.intermediate_size, hc.num_hidden_layers)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (hc.num_attention_heads, hc.num_key_value_heads,
                                                                hc.head_dim) == (4, 2, 16)
    assert cfg.rope_theta == rope_theta(original.config) == rope_theta(hc) == 10000.0 and cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.tie_word_embeddings == hc.tie_word_embeddings == original.config.tie_word_embeddings
    assert not cfg.qkv_bias and not cfg.qk_norm


def test_transformers_reads_back_the_written_model(llama):
    """The writer check: transformers' GGUF load equals the model the file was written from (f16: rounded)."""
    _, stored, _, from_gguf = llama
    for seq in _sequences():
        torch.testing.assert_close(hf_logits(from_gguf, seq), hf_logits(stored, seq), atol=ATOL, rtol=0)


def test_logits_match_transformers_and_the_original(llama, ours):
    """Every position's logits: verispec == transformers' GGUF load == the original HF model."""
    _, stored, _, from_gguf = llama
    _, _, model = ours
    for seq in _sequences():
        got = verispec_logits(model, seq)
        assert got.shape == (len(seq), VOCAB)
        torch.testing.assert_close(got, hf_logits(from_gguf, seq), atol=ATOL, rtol=0)
        torch.testing.assert_close(got, hf_logits(stored, seq), atol=ATOL, rtol=0)
        assert got.std() > 0.5  # logits spread well beyond ATOL: the comparison means something


def test_qk_unpermutation_is_what_makes_them_equal(llama, monkeypatch):
    """Without verispec's q/k un-permutation the same file gives clearly different logits, so the test
    above checks it (rope pairs of the wrong rows)."""
    import verispec.loader.weights as W
    from verispec.models.qwen2 import build_model

    _, stored, path, _ = llama
    monkeypatch.setattr(W, "unpermute_rope", lambda w, n_heads: w)
    cfg, sd = W.load_weights(path, use_cache=False)  # not from the cache the other tests filled
    wrong = build_model(cfg, sd, torch.device("cpu"), torch.float32)
    seq = _sequences()[3]
    assert (verispec_logits(wrong, seq) - hf_logits(stored, seq)).abs().max() > 100 * ATOL


def test_greedy_tokens_match_the_original(llama, ours):
    """verispec's engine (greedy, ignore_eos) on the GGUF gives the original model's greedy tokens; checked by
    teacher forcing the original over prompt + our tokens (its argmax is our next token at every step)."""
    from verispec import LLM, SamplingParams

    original, stored, path, from_gguf = llama
    tok, _, _ = ours
    llm = LLM(str(path), device="cpu", dtype="float32", quantization="none", max_model_len=128, async_scheduling=False)
    prompts = [tok.encode(CORPUS[0][:20]), tok.encode("The lazy fox"), _sequences()[2]]
    sp = SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    for prompt, out in zip(prompts, outs, strict=True):
        toks = list(out.outputs[0].token_ids)
        assert len(toks) == NUM_GREEDY
        for ref in (stored, from_gguf):
            logits = hf_logits(ref, prompt + toks)[len(prompt) - 1 : -1]
            assert logits.argmax(-1).tolist() == toks
            top2 = logits.topk(2, -1).values
            # Every step's top two are more than 2 * ATOL apart: logits within ATOL fix the argmax.
            assert float((top2[:, 0] - top2[:, 1]).min()) > 2 * ATOL
    if stored is original:
        with torch.no_grad():
            gen = original.generate(torch.tensor([prompts[1]]), max_new_tokens=NUM_GREEDY, do_sample=False,
                                    min_new_tokens=NUM_GREEDY, pad_token_id=VOCAB - 1)
        assert gen[0, len(prompts[1]):].tolist() == list(outs[1].outputs[0].token_ids)


def test_tokenizer_read_like_transformers(llama, ours):
    """The GGUF's byte-level BPE tokenizer: verispec's reading equals transformers' on text in and out of
    the training corpus."""
    from transformers import AutoTokenizer

    _, _, path, _ = llama
    tok, _, _ = ours
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = [*CORPUS, "unseen words: zebra ünïcödé 😀 tabs\t\tand  spaces", "<|begin_of_text|>hi<|end_of_text|>"]
    for text in texts:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.vocab_size == hf.vocab_size == VOCAB  # (transformers adds an "<|endoftext|>" of its own)
    assert tok.eos_token_id == VOCAB - 1 and hf.convert_ids_to_tokens(VOCAB - 1) == tok.convert_ids_to_tokens(VOCAB - 1)


def test_llama31_rope_scaling_is_refused(tmp_path):
    """A Llama 3.1-style file (rope_type llama3: the converter's rope_freqs.weight factors) loaded with
    plain rotary embeddings gave logits 0.17 away from the original's; it must be refused instead, and so
    must a Hugging Face folder whose config asks for rope scaling."""
    from verispec.loader.gguf import GGUFError
    from verispec.loader.weights import hf_model_config, load_weights

    original = tiny_llama(VOCAB, seed=2, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)
    path = tmp_path / "llama31.gguf"
    write_llama_gguf(original, path)
    with pytest.raises(GGUFError, match="rope_freqs.weight") as e:
        load_weights(path, use_cache=False)
    assert str(path) in str(e.value)
    cfg = original.config.to_dict()
    with pytest.raises(ValueError, match="rope scaling"):
        hf_model_config(cfg)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    assert hf_model_config(cfg).rope_theta == 500000.0
