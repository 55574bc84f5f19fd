"""Tool calling without a model: checking tools / tool_choice, the conversation the chat template renders,
and tool_calls parsed from text, whole and streamed piece by piece (the same calls either way)."""

from __future__ import annotations

import json
import random

import pytest
from tiny import real_tokenizer

from verispec.entrypoints.openai_protocol import APIError, ChatCompletionRequest
from verispec.entrypoints.tool_calls import (
    ToolCallStream,
    parse_tool_calls,
    plan_tools,
    template_messages,
    tool_constraint_schema,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
USER = [{"role": "user", "content": "hi"}]


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **kw})


def block(name: str, args: dict) -> str:
    """A call as Qwen2.5's template writes one."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def streamed(plan, text: str, seed: int) -> tuple[str, list[dict]]:
    """Feed `text` in random pieces, as the engine's cumulative outputs would arrive."""
    rng, stream, content, calls, i = random.Random(seed), ToolCallStream(plan), [], [], 0
    while i < len(text):
        i = min(len(text), i + rng.randint(1, 7))
        delta, new = stream.update(text[:i], final=False)
        content.append(delta)
        calls += new
    delta, new = stream.update(text, final=True)
    return "".join(content) + delta, calls + new


def fn(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]



@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("text, content, calls", [
    (block("get_weather", {"city": "Paris"}), None, [("get_weather", {"city": "Paris"})]),
    ("Let me look.\n" + block("get_weather", {"city": "Oslo"}) + "\n" + block("add", {"a": 2, "b": 40}),
     "Let me look.\n\n", [("get_weather", {"city": "Oslo"}), ("add", {"a": 2, "b": 40})]),
    ('```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```', None, [("add", {"a": 1, "b": 2})]),
    ('[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]',
     None, [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome"})]),
    ("No tools needed: 2 < 3 and <tool is a word.", "No tools needed: 2 < 3 and <tool is a word.", []),
    ('{"name": "unknown_fn", "arguments": {}}', '{"name": "unknown_fn", "arguments": {}}', []),
    ("<tool_call>\n{not json}\n</tool_call> done", "<tool_call>\n{not json}\n</tool_call> done", []),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 6}}', None, [("add", {"a": 5, "b": 6})]),
])
def test_calls_parsed_whole_and_streamed_alike(text, content, calls, seed):
    plan = plan_tools(request(tools=[WEATHER, ADD]))
    whole_content, whole_calls = parse_tool_calls(plan, text)
    assert (whole_content, fn(whole_calls)) == (content, calls)
    s_content, s_calls = streamed(plan, text, seed)
    assert s_content == (content or "") and fn(s_calls) == calls
    assert len({c["id"] for c in s_calls}) == len(calls) and all(c["type"] == "function" for c in s_calls)


def test_content_is_streamed_before_the_call_and_held_back_only_where_a_tag_may_start():
    plan = plan_tools(request(tools=[WEATHER]))
    stream = ToolCallStream(plan)
    assert stream.update("Sure, checking <tool", final=False) == ("Sure, checking ", [])
    delta, new = stream.update("Sure, checking <tool_call>\n" + '{"name": "get_weather", "arguments": {"city": "X"}}',
                               final=False)
    assert (delta, new) == ("", [])  # the block is not closed yet
    delta, new = stream.update("Sure, checking " + block("get_weather", {"city": "X"}), final=False)
    assert delta == "" and fn(new) == [("get_weather", {"city": "X"})]


def test_parallel_tool_calls_false_keeps_the_first_call():
    plan = plan_tools(request(tools=[WEATHER, ADD], parallel_tool_calls=False))
    _, calls = parse_tool_calls(plan, block("add", {"a": 1, "b": 1}) + block("get_weather", {"city": "Y"}))
    assert fn(calls) == [("add", {"a": 1, "b": 1})]


def test_named_and_required_start_the_call_and_parse_what_a_schema_constraint_leaves():
    named = plan_tools(request(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}}))
    assert named.assistant_prefix.startswith("<tool_call>\n") and '"add"' in named.assistant_prefix
    assert tool_constraint_schema(named) == ADD["function"]["parameters"]
    # The constraint leaves the bare arguments; the model left free closes the block itself.
    for text in ('{"a": 3, "b": 4}', '{"a": 3, "b": 4}}\n</tool_call>'):
        content, calls = parse_tool_calls(named, text)
        assert content is None and fn(calls) == [("add", {"a": 3, "b": 4})]
    content, calls = parse_tool_calls(named, "42}")  # not arguments: the model's own text, without the prefix
    assert (content, calls) == ("42}", [])
    required = plan_tools(request(tools=[WEATHER, ADD], tool_choice="required"))
    schema = tool_constraint_schema(required)
    assert [b["properties"]["name"]["const"] for b in schema["anyOf"]] == ["get_weather", "add"]
    _, calls = parse_tool_calls(required, '{"name": "get_weather", "arguments": {"city": "Lima"}}')
    assert fn(calls) == [("get_weather", {"city": "Lima"})]
    assert tool_constraint_schema(plan_tools(request(tools=[WEATHER]))) is None  # auto: free text


@pytest.mark.parametrize("kw, needle", [
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].function.name"),
    (dict(tools=[WEATHER, WEATHER]), "defined twice"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
     "tools[0].function.parameters.type must be 'object'"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"properties": [1]}}}]),
     "tools[0].function.parameters.properties"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"required": "x"}}}]),
     "tools[0].function.parameters.required"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "'nope'"),
    (dict(tool_choice="required"), "tool_choice needs tools"),
    (dict(tools=[]), "tools must be a non-empty list"),
])
def test_bad_tool_definitions_name_the_problem(kw, needle):
    with pytest.raises(APIError) as e:
        plan_tools(request(**kw))
    assert e.value.status == 400 and needle in e.value.message, e.value.message


def test_tool_choice_none_shows_no_tools():
    plan = plan_tools(request(tools=[WEATHER], tool_choice="none"))
    assert plan.tools is None and not plan.parses_calls and plan.assistant_prefix == ""


def test_template_renders_tools_calls_and_results_in_qwens_format():
    """The conversation of a round trip, rendered by the GGUF's own template: the tools in the system turn,
    the earlier call as a <tool_call> block (arguments as an object, from OpenAI's JSON string), the result
    as a <tool_response>."""
    req = request(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21}'},
    ])
    plan = plan_tools(req)
    text = real_tokenizer().apply_chat_template(template_messages(req), add_generation_prompt=True, tools=plan.tools)
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        '<|im_end|>' in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature_c": 21}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_bad_messages_for_tools():
    bad_args = request(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}])
    with pytest.raises(APIError, match=r"messages\[0\].tool_calls\[0\].function.arguments is not valid JSON"):
        template_messages(bad_args)
    with pytest.raises(APIError, match=r"messages\[0\].tool_calls is only allowed on assistant"):
        template_messages(request(messages=[{"role": "user", "content": "x", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]))
    with pytest.raises(APIError, match=r"messages\[0\].content is required"):
        template_messages(request(messages=[{"role": "user"}]))
