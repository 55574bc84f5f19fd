"""Tool calling (and response_format on the real model) over HTTP with the official openai client: checks and prompt rendering on the tiny model's
server, and the real qwen2.5-coder-0.5b-instruct calling tools (tool_choice auto, streamed deltas, a tool
result fed back). The real model's tests skip when it is not on this machine."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_util import ServerThread
from tiny import real_tokenizer, text_model, tiny_engine

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "What's the weather like in Tokyo right now?"}]


def rendered_len(messages: list[dict], tools: list[dict] | None) -> int:
    """Prompt tokens of a conversation rendered by the model's template, computed here, without the server."""
    tok = real_tokenizer()
    return len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools)))


# ---- the tiny model: checks and rendering ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_srv():
    s = ServerThread(tiny_engine(text_model()), "tiny").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tiny_client(tiny_srv):
    return openai.OpenAI(base_url=tiny_srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_tools_are_rendered_into_the_prompt_and_none_leaves_them_out(tiny_client):
    def prompt_tokens(**kw) -> int:
        return tiny_client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1, **kw).usage.prompt_tokens

    assert prompt_tokens() == rendered_len(ASK, None)
    assert prompt_tokens(tools=[WEATHER, ADD]) == rendered_len(ASK, [WEATHER, ADD]) > rendered_len(ASK, None)
    assert prompt_tokens(tools=[WEATHER, ADD], tool_choice="none") == rendered_len(ASK, None)


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "add"}}])
def test_every_tool_choice_answers_a_well_formed_message(tiny_client, choice):
    """Random weights (constrained for required / named, free for auto): whatever they write comes back
    as a valid OpenAI message."""
    r = tiny_client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, ADD], tool_choice=choice,
                                            max_tokens=8, temperature=0)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert (c.finish_reason == "tool_calls") == bool(c.message.tool_calls)
    for call in c.message.tool_calls or ():
        assert call.function.name in ("get_weather", "add") and isinstance(json.loads(call.function.arguments), dict)


@pytest.mark.parametrize("extra, needle", [
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "defined twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "parameters.type must be 'object'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "'missing'"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
])
def test_bad_tool_definitions_are_400s_naming_the_problem(tiny_srv, extra, needle):
    r = httpx.post(tiny_srv.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.json()


# ---- the real 0.5B ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real(qwen05_local):
    from verispec import LLM

    # 200 MB of KV; no gc.freeze: the server's objects and the engine reference each other, and with the
    # engine frozen that cycle (the model, 2.6 GB) outlived the module.
    llm = LLM("qwen2.5-coder-0.5b-instruct", device="cpu", max_model_len=2048, num_gpu_blocks=512, gc_freeze=False)
    s = ServerThread(llm.engine, "qwen").start()
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=300)
    s.stop()


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def test_real_model_calls_a_tool_with_tool_choice_auto(real):
    r = real.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER, ADD], temperature=0, max_tokens=100)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    [(name, args)] = _calls(c.message)
    assert name == "get_weather" and set(args) == {"city"} and "Tokyo" in args["city"]
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")


def test_real_model_streams_the_same_tool_calls(real):
    kw = dict(model="qwen", messages=[{"role": "user", "content": "Use the add tool to add 17 and 25."}],
              tools=[WEATHER, ADD], temperature=0, max_tokens=100)
    whole = real.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in real.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or ():  # accumulate as OpenAI clients do
                acc = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                acc["id"] = d.id or acc["id"]
                acc["name"] += (d.function.name or "") if d.function else ""
                acc["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = ch.finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls" and content == ""
    streamed = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    assert streamed == _calls(whole.message) == [("add", {"a": 17, "b": 25})]
    assert all(calls[i]["id"] for i in calls)


def test_real_model_tool_result_round_trip(real):
    """The call and its result go back through the template (assistant tool_calls with OpenAI's JSON-string
    arguments, a role "tool" message); the answer is a well-formed message."""
    ask = [{"role": "user", "content": "Use the add tool to add 17 and 25."}]
    first = real.chat.completions.create(model="qwen", messages=ask, tools=[ADD], temperature=0, max_tokens=100)
    call = first.choices[0].message.tool_calls[0]
    convo = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    r = real.chat.completions.create(model="qwen", messages=convo, tools=[ADD], temperature=0, max_tokens=40)
    as_template = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 17, "b": 25}}}]},
        {"role": "tool", "content": "42"}]
    assert r.usage.prompt_tokens == rendered_len(as_template, [ADD])
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert (c.finish_reason == "tool_calls") == bool(c.message.tool_calls)
    assert c.message.tool_calls or c.message.content
    assert all(name == "add" for name, _ in _calls(c.message))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_real_model_required_and_named_calls_follow_the_schema(real, choice):
    """tool_choice "required" or a named function constrains the call by the function's JSON schema
    (structured outputs): even for a prompt that asks for no tool, the answer is a call whose arguments
    validate against the function's parameters."""
    jsonschema = pytest.importorskip("jsonschema")
    r = real.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "Hello! How are you?"}],
                                     tools=[WEATHER, ADD], tool_choice=choice, temperature=0, max_tokens=60)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    [(name, args)] = _calls(c.message)
    if isinstance(choice, dict):
        assert name == "add"
    schema = {"get_weather": WEATHER, "add": ADD}[name]["function"]["parameters"]
    jsonschema.validate(args, schema)


def test_real_model_response_format_json_schema(real):
    """response_format json_schema on the real model over HTTP (structured outputs): the content parses and
    validates, for a request that would otherwise be answered in prose."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40},
        "languages": {"type": "array", "items": {"type": "string", "enum": ["python", "rust", "go", "c"]},
                      "minItems": 1, "maxItems": 3},
        "years": {"type": "integer", "minimum": 0, "maximum": 60}},
        "required": ["name", "languages", "years"], "additionalProperties": False}
    r = real.chat.completions.create(
        model="qwen", messages=[{"role": "user", "content": "Describe a made-up programmer."}], temperature=0,
        max_tokens=120, response_format={"type": "json_schema", "json_schema": {"name": "dev", "schema": schema}})
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    jsonschema.validate(json.loads(c.message.content), schema)
