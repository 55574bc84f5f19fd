"""OpenAI-compatible request models, their translation to SamplingParams, and OpenAI-style errors."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from verispec.sampling_params import SamplingParams, StructuredOutputsParams

MAX_N = 16
MAX_STOP = 16
MAX_STOP_LEN = 256
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1 - MAX_N  # seed + i (n > 1) must stay in torch's range


class APIError(Exception):
    """An error returned to the client as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error",
        param: str | None = None, code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        """The JSON body OpenAI clients expect."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """An OpenAI-style error body."""
    return APIError(400, message, type, param, code).body()


class StreamOptions(BaseModel):
    include_usage: bool = False


Prob = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
StopList = Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]], Field(max_length=MAX_STOP)]


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: OpenAI's named schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs` extra field (the same names as StructuredOutputsParams)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: int | None = None  # checked by SamplingParams, as in Python (-1 and 0: off)
    min_p: Prob | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)] | StopList | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # Tiny penalties overflow the logits to inf (and the sampler to NaN): keep them sane.
    repetition_penalty: Annotated[float, Field(ge=0.01, le=10.0)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # {token id (as a string, OpenAI's form): bias in [-100, 100]}
    logit_bias: dict[str, float] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_params(self) -> StructuredOutputsParams | None:
        """The request's one grammar constraint (None: free text). Raises APIError (400) naming the
        field when more than one is given or the schema / regex / grammar is bad."""
        given: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise APIError(400, "response_format.json_schema.schema is required for type json_schema",
                               param="response_format")
            given.append(("response_format", {"json": rf.json_schema.json_schema}))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given.append(("structured_outputs", {"json": so.json_, "regex": so.regex, "choice": so.choice,
                                                 "grammar": so.grammar, "json_object": so.json_object,
                                                 "disable_any_whitespace": so.disable_any_whitespace}))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given.append((name, {key: getattr(self, name)}))
        if not given:
            return None
        if len(given) > 1:
            raise APIError(400, f"give at most one structured-output constraint, got {[n for n, _ in given]}",
                           param=given[1][0])
        name, kw = given[0]
        try:
            return StructuredOutputsParams(**kw)
        except ValueError as e:
            raise APIError(400, f"{name}: {e}", param=name) from None

    def engine_logit_bias(self) -> dict[int, float] | None:
        """logit_bias with integer keys. Raises APIError (400) for a key that is not a token id."""
        if self.logit_bias is None:
            return None
        out: dict[int, float] = {}
        for k, v in self.logit_bias.items():
            try:
                tid = int(k)
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids, got {k!r}", param="logit_bias") from None
            out[tid] = v
        return out

    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def engine_logprobs(self) -> int | None:
        raise NotImplementedError

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self, prompt_len: int, max_model_len: int, default_max: int | None) -> SamplingParams:
        """SamplingParams for a prompt of `prompt_len` tokens. Raises APIError (400) on bad values."""
        room = max_model_len - prompt_len
        max_tokens = self.requested_max_tokens()
        if max_tokens is None:
            max_tokens = room if default_max is None else min(default_max, room)
        elif max_tokens > room:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{max_tokens + prompt_len} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                "completion). Please reduce the prompt or max_tokens.",
                param="max_tokens",
            )
        if self.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens ({self.min_tokens}) must be <= max_tokens ({max_tokens})",
                           param="min_tokens")
        kw: dict[str, Any] = dict(
            n=self.n, seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            logprobs=self.engine_logprobs(), skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.engine_logit_bias(), structured_outputs=self.structured_params(),
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            field = str(e).split(" ", 1)[0].removeprefix("SamplingParams.")
            raise APIError(400, str(e), param=field) from None


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: (Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
             | Annotated[list[str], Field(min_length=1, max_length=1)])
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False

    def engine_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionDefinition(BaseModel):
    """tools[i].function: a function the model may call (parameters: a JSON Schema of its arguments)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    """tools[i]: OpenAI's function tool."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """tool_choice naming one function: {"type": "function", "function": {"name": ...}}."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends a JSON string; an object is taken too


class ToolCall(BaseModel):
    """An earlier assistant turn's call, sent back in messages."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None  # None only on an assistant message with tool_calls
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None  # role "tool": the call this is the result of

    def to_template(self) -> dict[str, Any]:
        """The dict handed to the chat template (text parts joined, 'developer' read as 'system')."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def engine_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """A readable message and the offending parameter from pydantic/FastAPI validation errors."""
    by_loc: dict[str, list[str]] = {}
    param = None
    for err in errors:
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            pos = [x for x in err.get("loc", ()) if isinstance(x, int)]
            at = f" at character {pos[0]}" if pos else ""
            return f"Request body is not valid JSON{at}: {ctx.get('error', 'decode error')}", None
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        # Drop pydantic's union-branch names (e.g. "str", "list[int]", "function-after[...]") from the location.
        loc = [x for x in loc if not any(c in x for c in "[]-") and x not in ("str", "int", "float", "bool")]
        where = ".".join(loc)
        param = param or (loc[0] if loc and not loc[0].isdigit() else None)
        msgs = by_loc.setdefault(where, [])
        msg = str(err.get("msg", "invalid value"))
        if msg not in msgs:
            msgs.append(msg)
    parts = [f"{w}: {' or '.join(m)}" if w else " or ".join(m) for w, m in list(by_loc.items())[:5]]
    if len(by_loc) > 5:
        parts.append(f"... and {len(by_loc) - 5} more")
    return "; ".join(parts) or "invalid request", param
