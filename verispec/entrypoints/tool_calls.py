"""Tool calling in chat completions: checking `tools` / `tool_choice`, the conversation the chat template sees,
and OpenAI `tool_calls` parsed from the model's text (whole or streamed).

The model's own format is used both ways. Qwen2.5's chat template lists the tools in its system turn and writes
each call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; earlier calls (assistant
messages with `tool_calls`) and their results (`role: "tool"` messages) are rendered by the same template.
`tool_choice`:
- "none": the tools are not shown to the model and nothing is parsed;
- "auto" (the default with tools): the model decides; `<tool_call>` blocks in its text become `tool_calls`;
- "required" / a named function: the assistant turn is started for the model (`assistant_prefix`) with
  `<tool_call>\\n` (and, for a named function, `{"name": "NAME", "arguments": `), so it writes a call. The
  rest is constrained by the function's JSON schema: `tool_structured_outputs` builds the constraint that
  builds that constraint once structured outputs land (see its docstring).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from verispec.entrypoints.openai_protocol import APIError, ChatCompletionRequest

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


# ---- the request -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools: the tool dicts for the template (None: no tools shown), the text
    that starts the assistant turn, and whether the output is parsed for calls."""

    tools: list[dict[str, Any]] | None = None
    choice: str | None = None  # "none" | "auto" | "required" | a function name
    parallel: bool = True
    assistant_prefix: str = ""

    @property
    def parses_calls(self) -> bool:
        return self.tools is not None

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools or ()]


def _check_parameters(schema: Any, where: str) -> None:
    """A function's `parameters`: a JSON Schema object describing the arguments object."""
    if not isinstance(schema, dict):
        raise APIError(400, f"{where} must be a JSON Schema object, got {type(schema).__name__}", param="tools")
    kind = schema.get("type", "object")
    if kind != "object":
        raise APIError(400, f"{where}.type must be 'object' (the arguments are a JSON object), got {kind!r}",
                       param="tools")
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, (dict, bool)) for v in props.values()):
        raise APIError(400, f"{where}.properties must map each argument name to a schema", param="tools")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise APIError(400, f"{where}.required must be a list of argument names", param="tools")


def plan_tools(req: ChatCompletionRequest) -> ToolPlan:
    """Check `tools`, `tool_choice` and `parallel_tool_calls`; a bad definition is a 400 naming it."""
    choice = req.tool_choice
    if not req.tools:
        if req.tools is not None:
            raise APIError(400, "tools must be a non-empty list (leave it out for no tools)", param="tools")
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return ToolPlan()
    tools, seen = [], set()
    for i, tool in enumerate(req.tools):
        fn = tool.function
        if not _NAME.match(fn.name):
            raise APIError(400, f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {fn.name!r}",
                           param="tools")
        if fn.name in seen:
            raise APIError(400, f"tools[{i}].function.name {fn.name!r} is defined twice", param="tools")
        seen.add(fn.name)
        if fn.parameters is not None:
            _check_parameters(fn.parameters, f"tools[{i}].function.parameters")
        tools.append(tool.model_dump(exclude_none=True))
    parallel = req.parallel_tool_calls is not False
    if choice is None or choice == "auto":
        return ToolPlan(tools, "auto", parallel)
    if choice == "none":
        return ToolPlan(None, "none", parallel)
    if choice == "required":
        return ToolPlan(tools, "required", parallel, TOOL_CALL_OPEN + "\n")
    name = choice.function.name
    if name not in seen:
        raise APIError(400, f"tool_choice names function {name!r}, which is not in tools ({sorted(seen)})",
                       param="tool_choice")
    return ToolPlan(tools, name, parallel, TOOL_CALL_OPEN + "\n" + '{"name": ' + json.dumps(name) + ', "arguments": ')


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as the chat template reads it (transformers' convention): text parts joined,
    'developer' as 'system', and each tool call's `arguments` as an object, not OpenAI's JSON string."""
    out = []
    for i, m in enumerate(req.messages):
        d = m.to_template()
        if m.tool_calls:
            if m.role != "assistant":
                raise APIError(400, f"messages[{i}].tool_calls is only allowed on assistant messages",
                               param="messages")
            calls = []
            for j, call in enumerate(m.tool_calls):
                args = call.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError as e:
                        raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: "
                                       f"{e}", param="messages") from None
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": args}})
            d["tool_calls"] = calls
        elif d.get("content") is None:
            raise APIError(400, f"messages[{i}].content is required (only an assistant message with tool_calls "
                           "may leave it out)", param="messages")
        if m.role == "tool" and m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def tool_constraint_schema(plan: ToolPlan) -> dict[str, Any] | None:
    """The JSON schema what the model writes after `plan.assistant_prefix` must follow (None: free text).

    Named function: the arguments object (its `parameters`). "required": one call object
    {"name": one of the functions, "arguments": that function's parameters}."""
    if plan.choice in (None, "none", "auto"):
        return None
    by_name = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in plan.tools}
    if plan.choice != "required":
        return by_name[plan.choice]
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for n, p in by_name.items()]}


def tool_structured_outputs(plan: ToolPlan) -> Any | None:
    """The constraint for `SamplingParams.structured_outputs` when tool_choice is "required" or a named
    function: the function's JSON schema (tool_constraint_schema); None otherwise. A bad schema raises
    ValueError, which serving turns into a 400. The parser reads either form: the closed `<tool_call>`
    block the model writes freely, or the bare JSON the constraint leaves."""
    from verispec.sampling_params import StructuredOutputsParams

    schema = tool_constraint_schema(plan)
    return None if schema is None else StructuredOutputsParams(json=schema)


# ---- the response ------------------------------------------------------------------------------------------
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parse_call(block: str, known: Sequence[str]) -> dict[str, Any] | None:
    """{"name", "arguments" (a JSON string)} of one call's text, or None when it is not a call to a known
    function. Text after the JSON object is ignored; a missing final brace (the named-function prefix plus
    bare arguments) is added."""
    block = block.strip()
    value = None
    for text in (block, block + "}"):
        try:
            value, _ = json.JSONDecoder().raw_decode(text)
            break
        except json.JSONDecodeError:
            continue
    if not isinstance(value, dict) or value.get("name") not in known:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": value["name"], "arguments": json.dumps(args, ensure_ascii=False)}


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def _could_be_bare(text: str) -> bool:
    """Whether text with no `<tool_call>` in it may still turn out to be one bare (or fenced) JSON call."""
    s = text.lstrip()
    return not s or s[0] in "{[" or s.startswith("```") or "```".startswith(s)


def _parse_bare(text: str, known: Sequence[str]) -> list[dict[str, Any]]:
    """The calls of a text that is nothing but JSON: one call object, a list of them, optionally in a ```json
    fence (small models write that instead of `<tool_call>` blocks). [] when it is anything else."""
    s = text.strip()
    m = _FENCE.match(s)
    if m:
        s = m.group(1)
    try:
        value = json.loads(s)
    except json.JSONDecodeError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = [_parse_call(json.dumps(v), known) if isinstance(v, dict) else None for v in items]
    return [c for c in calls if c is not None] if items and all(calls) else []


def _partial_open(text: str) -> int:
    """Length of the longest suffix of `text` that could still become TOOL_CALL_OPEN."""
    for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-k:]):
            return k
    return 0


@dataclass
class ToolCallStream:
    """Turns one choice's growing text into content deltas and complete tool calls.

    `update(text, final)` takes the cumulative generated text (without the plan's assistant prefix) and returns
    (content delta, new calls). Content is never sent while it could still be the start of a `<tool_call>`;
    a call is returned once its block closes, or at the end if the text stops inside a block whose JSON is
    whole. A block that does not parse as a call to a known function is content, as written."""

    plan: ToolPlan
    calls: list[dict[str, Any]] = field(default_factory=list)
    _pos: int = 0  # what of prefix + text has been handled
    _inside: int | None = None  # where the open block's JSON starts
    _bare: bool = True  # nothing sent yet, and the text may still be one bare JSON call

    def _add(self, call: dict[str, Any], new: list[dict[str, Any]]) -> None:
        if self.calls and not self.plan.parallel:
            return  # parallel_tool_calls=false: the first call only
        call = {"id": new_call_id(), "type": "function", "function": call}
        self.calls.append(call)
        new.append(call)

    def update(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        full = self.plan.assistant_prefix + text
        content: list[str] = []
        new: list[dict[str, Any]] = []
        if self._bare:
            if TOOL_CALL_OPEN not in full and _could_be_bare(full):
                if not final:
                    return "", []  # held back until it is known whether this is a call
                bare = _parse_bare(full, self.plan.names)
                if bare:
                    for call in bare:
                        self._add(call, new)
                    self._pos = len(full)
                    return "", new
            self._bare = False
        while True:
            if self._inside is None:
                i = full.find(TOOL_CALL_OPEN, self._pos)
                if i < 0:
                    end = len(full) if final else len(full) - _partial_open(full[self._pos:])
                    content.append(full[self._pos:end])
                    self._pos = max(self._pos, end)
                    break
                content.append(full[self._pos:i])
                self._inside = self._pos = i + len(TOOL_CALL_OPEN)
                continue
            j = full.find(TOOL_CALL_CLOSE, self._inside)
            if j < 0 and not final:
                break
            block = full[self._inside:j if j >= 0 else len(full)]
            call = _parse_call(block, self.plan.names)
            end = j + len(TOOL_CALL_CLOSE) if j >= 0 else len(full)
            if call is None:  # not a call after all: the model's text, as written (never the prefix)
                content.append(full[max(self._inside - len(TOOL_CALL_OPEN), len(self.plan.assistant_prefix)):end])
            else:
                self._add(call, new)
            self._pos, self._inside = end, None
            if j < 0:
                break
        return "".join(content), new


def parse_tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished choice's text; content is None when only calls remain."""
    content, calls = ToolCallStream(plan).update(text, final=True)
    return (content if content.strip() or not calls else None), calls
