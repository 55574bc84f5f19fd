"""gemma-3-270m on the CUDA path (float32, CUDA graphs, the Triton kernels with their sliding-window
attention) against transformers' Gemma3ForCausalLM on the same device and the same weights
(bench/peers.hf_model; the GGUF dequantization itself is checked against transformers' GGUF loader by
tests/test_gemma3.py on the CPU). Two short and two long prompts (longer than the 512-token window) x 64
greedy tokens, checked by teacher forcing; last-step logits within 1e-3 relative; pinned ngram
speculation gives the same tokens. Marked gpu and gpu_gate: `pytest --gate-device cpu` runs it on the CPU
(a dry run). The model is pulled on first use (skipped if it cannot be had)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_gemma3 import SHORT_PROMPTS, long_prompts
from tiny import prefill_logits

from verispec import SamplingParams
from verispec.bench.peers import hf_model
from verispec.config import EngineConfig, SpeculativeConfig
from verispec.engine.builder import assemble_parts
from verispec.engine.engine import LLMEngine

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_gate]
NUM_TOKENS = 64


@pytest.fixture(scope="module")
def gemma_gate(gemma_path, gate_device):
    """(tokenizer, model) of the real gemma-3-270m in float32 on the gate device."""
    from verispec.loader.model_loader import load_model

    tok, _, model = load_model(str(gemma_path), gate_device, torch.float32, quantization="none")
    return tok, model


def _engine(gemma_gate, spec: dict | None = None) -> LLMEngine:
    tok, model = gemma_gate
    dev = next(model.parameters()).device
    cfg = EngineConfig(model="gemma-3-270m", device=str(dev), dtype="float32", max_model_len=2048, block_size=16,
                       num_gpu_blocks=4 * 2048 // 16, max_num_seqs=4, gc_freeze=False,
                       speculative_config=SpeculativeConfig.from_dict(spec))
    return LLMEngine(cfg, assemble_parts(cfg, tok, model, dev, torch.float32))


def _greedy(eng: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", None, params, p)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return [list(done[f"r{i}"].outputs[0].token_ids) for i in range(len(prompts))]


@pytest.fixture(scope="module")
def prompts(gemma_gate):
    tok = gemma_gate[0]
    ids = [tok.encode_prompt(p) for p in SHORT_PROMPTS[:2] + long_prompts()[:2]]
    assert [len(i) > 512 + NUM_TOKENS for i in ids] == [False, False, True, True], [len(i) for i in ids]
    return ids


@pytest.fixture(scope="module")
def plain(gemma_gate, prompts):
    """(the plain engine, its greedy tokens)."""
    eng = _engine(gemma_gate)
    return eng, _greedy(eng, prompts)


def _hf_logits(hf, seq: list[int]) -> torch.Tensor:
    dev = hf.model.embed_tokens.weight.device
    with torch.no_grad():
        return hf(torch.tensor([seq], device=dev)).logits[0].float()


def test_greedy_and_logits_match_transformers(gemma_gate, prompts, plain):
    eng, outs = plain
    hf = hf_model(gemma_gate[1])
    for prompt_ids, toks in zip(prompts, outs, strict=True):
        assert len(toks) == NUM_TOKENS
        logits = _hf_logits(hf, prompt_ids + toks)
        hf_next = logits[len(prompt_ids) - 1 : -1].argmax(-1).tolist()
        bad = [i for i, (a, b) in enumerate(zip(hf_next, toks, strict=True)) if a != b]
        assert not bad, f"prompt of {len(prompt_ids)} tokens: first divergence at generated token {bad[:1]}"
        seq = prompt_ids + toks[:-1]
        ref = logits[len(seq) - 1]
        got = prefill_logits(SimpleNamespace(engine=eng), seq, last=True).float()  # the engine's kernels
        assert float((got - ref).norm() / ref.norm()) < 1e-3
        assert int(got.argmax()) == toks[-1]


def test_ngram_speculation_gives_the_same_tokens(gemma_gate, prompts, plain):
    eng = _engine(gemma_gate, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    assert _greedy(eng, prompts) == plain[1]
    assert eng.get_metrics()["spec_decode_num_drafts"] > 0
