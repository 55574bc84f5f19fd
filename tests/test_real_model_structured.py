"""Structured outputs on the real qwen2.5-coder-0.5b-instruct (CPU float32, skipped when it is not cached):
chat answers to JSON schemas and json_object validate, and ngram speculation gives the same tokens."""

from __future__ import annotations

import json

import pytest
from structured_cases import json_problem

from verispec.sampling_params import SamplingParams, StructuredOutputsParams

pytest.importorskip("xgrammar")
pytest.importorskip("jsonschema")

CASES = [
    ("Describe a user called Ada, aged 36, with two hobbies.",
     {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                       "hobbies": {"type": "array", "items": {"type": "string"}}},
      "required": ["name", "age", "hobbies"]}),
    ("Give the HTTP status for 'not found' and its meaning.",
     {"type": "object", "properties": {"code": {"type": "integer", "minimum": 100, "maximum": 599},
                                       "meaning": {"type": "string"}, "retry": {"type": "boolean"}},
      "required": ["code", "meaning"]}),
    ("Pick a color for the sky on a clear day.",
     {"type": "object", "properties": {"color": {"enum": ["red", "blue", "green"]}}, "required": ["color"]}),
]


def _chat(llm, params):
    convs = [[{"role": "user", "content": q + " Answer in JSON."}] for q, _ in CASES] + [
        [{"role": "user", "content": "Return a JSON object describing Python."}]]
    return [o.outputs[0] for o in llm.chat(convs, params, use_tqdm=False)]


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=s))
            for _, s in CASES] + [
        SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(json_object=True))]


def test_real_model_outputs_validate(llm05):
    outs = _chat(llm05, _params())
    for (_, schema), o in zip(CASES, outs, strict=False):
        assert o.finish_reason == "stop", o.text
        assert json_problem(o.text, schema) is None
    assert outs[-1].finish_reason == "stop" and isinstance(json.loads(outs[-1].text), dict)
    assert json.loads(outs[2].text) == {"color": "blue"}


@pytest.mark.slow
def test_real_model_ngram_matches_plain(llm05):
    """Async ngram speculation under the same grammars gives the plain engine's tokens."""
    from verispec import LLM

    params = _params()
    outs = _chat(llm05, params)

    spec = LLM("qwen2.5-coder-0.5b-instruct", device="cpu", dtype="float32", quantization="none", max_model_len=1024,
               async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                          "adaptive": False})
    spec_outs = _chat(spec, params)
    assert [o.token_ids for o in spec_outs] == [o.token_ids for o in outs]
    assert spec.get_metrics()["spec_decode_num_drafts"] > 0
