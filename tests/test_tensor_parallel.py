"""Tensor parallelism on the CPU (gloo, 2 rank processes): the real qwen2.5-coder-0.5b-instruct sharded
over 2 ranks gives the greedy tokens of the unsharded model (float32), in the synchronous and the
overlapped loop and with ngram and draft_model speculation; bad sizes are refused before anything
loads; a killed rank ends the engine with a clear error at once.

One TP=2 group (2 processes, the model loaded and sharded once) serves every engine here: the first
is built through the public path (LLMEngine(config) -> build_engine_parts), the others are assembled
over the same shards (assemble_parts(..., tp=group)), which re-sets up the other rank's runner."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch
from tiny import run_all

from verispec import SamplingParams
from verispec.config import EngineConfig, SpeculativeConfig
from verispec.core.parallel import RankFailure
from verispec.engine.builder import assemble_parts
from verispec.engine.engine import LLMEngine

QWEN05 = "qwen2.5-coder-0.5b-instruct"
PROMPTS = [
    "def binary_search(arr, target):\n",
    "<|im_start|>user\nWrite a Python function that checks if a string is a palindrome.<|im_end|>\n"
    "<|im_start|>assistant\n",
    "import numpy as np\n\ndef normalize(v):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "The capital of France is",
    "# Merge two sorted lists\ndef merge(a, b):\n",
    "SELECT name, COUNT(*) FROM users",
    "fn main() {\n    let v = vec![1, 2, 3];\n",
]
# 16 tokens: a wrong shard or reduction shows in the first one; the TP=2 steps (gloo all-reduces per layer)
# and the TP=1 reference are the module's cost.
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# One scheduling config for every engine, so TP=1 and TP=2 run the same steps.
BASE = dict(model=QWEN05, device="cpu", dtype="float32", max_model_len=1024, max_num_batched_tokens=256,
            num_gpu_blocks=256, gc_freeze=False, async_scheduling=False)
SPECS = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
         "draft_model": {"method": "draft_model", "model": QWEN05, "num_speculative_tokens": 3, "adaptive": False}}


@pytest.fixture(scope="module")
def real(llm05):
    return llm05.engine.parts.model, llm05.tokenizer


@pytest.fixture(scope="module")
def prompts(real):
    return [real[1].encode_prompt(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def tp2(qwen05_path):
    """The TP=2 engine built through the public path; its group and shards serve the variants."""
    eng = LLMEngine(EngineConfig(**BASE, tensor_parallel_size=2, distributed_timeout=30.0))
    yield eng
    eng.shutdown()


def engine(real, tp_engine: LLMEngine | None, spec: str | None = None, **kw) -> LLMEngine:
    """An engine with BASE + kw: TP=1 around the session's model, or over tp_engine's group and shards.
    draft_model drafts with the session's unsharded model (on rank 0 only under TP)."""
    model, tok = real
    cfg = EngineConfig(**{**BASE, **kw}, speculative_config=SpeculativeConfig.from_dict(SPECS.get(spec)),
                       tensor_parallel_size=1 if tp_engine is None else 2, distributed_timeout=30.0)
    draft = (tok, model.config, model) if spec == "draft_model" else None
    if tp_engine is None:
        parts = assemble_parts(cfg, tok, model, torch.device("cpu"), torch.float32, draft_model=draft)
    else:
        p = tp_engine.parts
        parts = assemble_parts(cfg, p.tokenizer, p.model, torch.device("cpu"), torch.float32, draft_model=draft,
                               tp=p.tp)
    return LLMEngine(cfg, parts)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tp1_plain(real, prompts):
    return run_all(engine(real, None), prompts, dataclasses.replace(GREEDY, logprobs=1))


def test_tp_sizes_that_do_not_divide_the_heads_are_refused_before_loading(monkeypatch, qwen05_path):
    from verispec.distributed import group
    from verispec.loader import model_loader

    def boom(*a, **k):
        raise AssertionError("loaded or started ranks before refusing the size")

    monkeypatch.setattr(model_loader, "load_model", boom)
    monkeypatch.setattr(group.TensorParallelGroup, "__init__", boom)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide the model's 14 attention heads"):
        LLMEngine(EngineConfig(**{**BASE, "tensor_parallel_size": 4}))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=7 does not divide the model's 2 KV heads.*"
                                         r"tensor_parallel_size 1 or 2"):
        LLMEngine(EngineConfig(**{**BASE, "tensor_parallel_size": 7}))
    with pytest.raises(ValueError, match="runs speculative methods ngram and draft_model, not 'self'"):
        LLMEngine(EngineConfig(**{**BASE, "tensor_parallel_size": 2},
                               speculative_config={"method": "self", "num_speculative_tokens": 2}))
    assert time.monotonic() - t0 < 5.0


def test_tp2_greedy_tokens_match_tp1(tp2, prompts, tp1_plain):
    outs = run_all(tp2, prompts, dataclasses.replace(GREEDY, logprobs=1))
    assert tokens(outs) == tokens(tp1_plain)
    # The row-parallel all-reduces sum in another order: the logprobs agree closely, not bit for bit.
    diffs = [abs(a[t] - b[t])
             for o, r in zip(outs, tp1_plain, strict=True)
             for a, b, t in zip(o.outputs[0].logprobs, r.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]
    assert len(diffs) == len(PROMPTS) * GREEDY.max_tokens and max(diffs) < 1e-3, max(diffs)


@pytest.mark.parametrize("spec", ["ngram", "draft_model"])
def test_tp2_speculation_in_the_overlapped_loop_matches_tp1(real, tp2, prompts, tp1_plain, spec):
    eng = engine(real, tp2, spec, async_scheduling=True)
    assert eng.config.async_scheduling
    assert tokens(run_all(eng, prompts, GREEDY)) == tokens(tp1_plain)
    m = eng.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0
    if spec == "draft_model":  # the drafter is the target's own weights, unsharded, on rank 0
        assert m["spec_decode_num_accepted_tokens"] >= 0.9 * m["spec_decode_num_draft_tokens"], m


@pytest.mark.slow
@pytest.mark.parametrize("spec, overlapped", [(None, True), ("ngram", False), ("draft_model", True)])
def test_tp2_matches_tp1_counters_too(real, tp2, prompts, tp1_plain, spec, overlapped):
    """The same engine options at TP=1 and TP=2: the same tokens and the same acceptance counters."""
    tp1 = engine(real, None, spec, async_scheduling=overlapped)
    want = tokens(run_all(tp1, prompts, GREEDY))
    eng = engine(real, tp2, spec, async_scheduling=overlapped)
    assert tokens(run_all(eng, prompts, GREEDY)) == want == tokens(tp1_plain)
    m, m1 = eng.get_metrics(), tp1.get_metrics()
    for key in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                "spec_decode_num_accepted_tokens_per_pos", "generation_tokens"):
        assert m[key] == m1[key], key


def test_zz_killed_rank_ends_the_engine_with_a_clear_error_at_once(real, tp2, prompts):
    """Last in the module: it kills the group's rank 1."""
    eng = engine(real, tp2)
    proc = tp2.parts.tp.procs[0]
    run_all(eng, prompts[:1], dataclasses.replace(GREEDY, max_tokens=2))
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    eng.add_request("after", None, GREEDY, prompts[0])
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"tensor-parallel rank 1 \(pid \d+\) was killed by signal 9"):
        while eng.has_unfinished_requests():
            eng.step()
    assert time.monotonic() - t0 < 5.0
    with pytest.raises(RankFailure, match="rank 1"):  # and stays failed
        eng.step()
    t0 = time.monotonic()
    tp2.shutdown()
    assert time.monotonic() - t0 < 10.0
