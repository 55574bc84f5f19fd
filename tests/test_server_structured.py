"""Structured outputs and logit_bias over HTTP, with the official openai client against the real server
(tiny random-weight engine): response_format json_schema / json_object, vLLM's structured_outputs and
guided_* fields, logit_bias; bad schemas, regexes and grammars are 400s naming the problem.

Before these fields were wired, the server accepted them and ignored them (free text came back): the
validity checks below fail for free text (test_structured_outputs.test_unconstrained_output_breaks...)."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from server_util import ServerThread
from structured_cases import SCHEMAS, json_problem
from tiny import real_tokenizer, text_model, tiny_engine

from verispec.sampling_params import SamplingParams, StructuredOutputsParams

pytest.importorskip("xgrammar")
pytest.importorskip("jsonschema")

SCHEMA = SCHEMAS[0]
CHAT = [{"role": "user", "content": "Give me a person as JSON."}]


@pytest.fixture(scope="module")
def srv():
    s = ServerThread(tiny_engine(text_model()), "tiny").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def offline_chat(messages, **kw) -> str:
    """The offline engine's text for the same chat prompt and params."""
    tok = real_tokenizer()
    eng = tiny_engine(text_model())
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    eng.add_request("ref", None, SamplingParams(**kw), ids)
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            final = out
    return final.outputs[0].text


def test_chat_json_schema_validates_and_matches_offline(client):
    r = client.chat.completions.create(
        model="tiny", messages=CHAT, temperature=0, max_tokens=100,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
    )
    text = r.choices[0].message.content
    assert json_problem(text, SCHEMA) is None
    assert r.choices[0].finish_reason == "stop"
    assert text == offline_chat(CHAT, temperature=0.0, max_tokens=100, structured_outputs=StructuredOutputsParams(json=SCHEMA))


def test_chat_json_schema_streams_the_same_text(client):
    kw = dict(model="tiny", messages=CHAT, temperature=0, max_tokens=100,
              response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[9]}})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(parts) == whole
    assert json_problem(whole, SCHEMAS[9]) is None


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"guided_json": SCHEMAS[4]}, lambda t: json_problem(t, SCHEMAS[4]) is None),
    ({"structured_outputs": {"regex": r"(yes|no)!"}}, lambda t: t in ("yes!", "no!")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"guided_grammar": 'root ::= "x" [0-9] [0-9]'}, lambda t: re.fullmatch(r"x[0-9]{2}", t)),
])
def test_completions_vllm_fields(client, extra, check):
    r = client.completions.create(model="tiny", prompt="Answer:", temperature=0.7, seed=3, max_tokens=60,
                                  extra_body=extra)
    assert check(r.choices[0].text), r.choices[0].text
    assert r.choices[0].finish_reason == "stop"


def test_logit_bias_over_http(client):
    tok = real_tokenizer()
    forced = tok.encode(" yes")[0]
    r = client.completions.create(model="tiny", prompt="Answer:", temperature=0, max_tokens=5,
                                  logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == " yes" * 5
    c = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0, max_tokens=3,
                                       logit_bias={str(forced): 100})
    assert c.choices[0].message.content == " yes" * 3


@pytest.mark.parametrize("path, body, needle, param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}}, "StructuredOutputsParams.json", "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}}}, "minimum greater than maximum",
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "json_schema.schema is required",
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format", "response_format"),
    ("/v1/completions", {"guided_regex": "(ab"}, "parenthesis", "guided_regex"),
    ("/v1/completions", {"guided_grammar": "root ::= missing"}, 'Rule "missing" is not defined', "guided_grammar"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= ("}}, "StructuredOutputsParams.grammar",
     "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"jsn": {}}}, "jsn", "structured_outputs"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["b"]}, "at most one", "guided_choice"),
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias", "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 500}}, "logit_bias", "logit_bias"),
    ("/v1/completions", {"logit_bias": {"99999999": 1}}, "logit_bias", None),
])
def test_bad_constraints_are_400(http, path, body, needle, param):
    base = {"model": "tiny", "max_tokens": 4}
    base.update({"messages": CHAT} if "chat" in path else {"prompt": "hi"})
    r = http.post(path, json={**base, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


def test_json_object_with_real_client_shape(http):
    """response_format json_object is accepted (the grammar: a JSON object); a random model may not close
    it within max_tokens, so only the opening is checked here (test_real_model_structured checks whole
    documents)."""
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "max_tokens": 8, "temperature": 0,
                                                "response_format": {"type": "json_object"}})
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"].lstrip().startswith("{")
    json.dumps(r.json())
