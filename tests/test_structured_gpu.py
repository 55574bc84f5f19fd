"""Structured outputs on the CUDA path (the real 0.5B in float32 with CUDA graphs and the Triton kernels,
conftest.qwen05_gate): the grammar-masked chat answers to tests/test_real_model_structured.py's schemas
validate (jsonschema, independently of xgrammar), and with pinned speculation (ngram, self; synchronous
and overlapped) they are token-identical to plain synchronous decoding on the same device. Marked gpu
and gpu_gate: `pytest --gate-device cpu` runs it on the CPU (a dry run of the GPU cell)."""

from __future__ import annotations

import json

import pytest
from structured_cases import json_problem
from test_real_model_structured import CASES
from tiny import run_all, tiny_engine

from verispec.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_gate]

SPECS = [
    ("ngram-sync", False, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}),
    ("ngram-async", True, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}),
    ("self-async", True, {"method": "self", "num_speculative_tokens": 3, "adaptive": False}),
]


@pytest.fixture(scope="module")
def case_prompts(qwen05_gate):
    tok = qwen05_gate[0]
    convs = [q + " Answer in JSON." for q, _ in CASES] + ["Return a JSON object describing Python."]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True))
            for c in convs]


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=s))
            for _, s in CASES] + [
        SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(json_object=True))]


def _run(qwen05_gate, prompts, async_scheduling: bool, spec: dict | None = None):
    eng = tiny_engine(qwen05_gate[2], spec=spec, async_scheduling=async_scheduling, max_model_len=1024,
                      num_gpu_blocks=64, block_size=16)
    outs = [o.outputs[0] for o in run_all(eng, prompts, _params())]
    return outs, eng.get_metrics(), eng.tokenizer


@pytest.fixture(scope="module")
def plain(qwen05_gate, case_prompts):
    """Plain synchronous decoding's constrained outputs on the gate device, and their text."""
    outs, _, tok = _run(qwen05_gate, case_prompts, False)
    return outs, [tok.decode(o.token_ids) for o in outs]


def test_constrained_outputs_validate(plain):
    outs, texts = plain
    for (_, schema), o, text in zip(CASES, outs, texts, strict=False):
        assert o.finish_reason == "stop", text
        assert json_problem(text, schema) is None
    assert outs[-1].finish_reason == "stop" and isinstance(json.loads(texts[-1]), dict)


@pytest.mark.parametrize(("name", "async_scheduling", "spec"), SPECS, ids=[s[0] for s in SPECS])
def test_speculation_under_the_grammar_is_lossless(qwen05_gate, case_prompts, plain, name, async_scheduling, spec):
    outs, m, _ = _run(qwen05_gate, case_prompts, async_scheduling, spec)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain[0]], name
    assert m["spec_decode_num_drafts"] > 0 and m["structured_output_refused_tokens"] == 0
