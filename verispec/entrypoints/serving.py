"""Completions and chat completions: prompt preparation, OpenAI-shaped responses and SSE streams."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from verispec.entrypoints.async_engine import AsyncEngine, EngineDeadError
from verispec.entrypoints.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    validation_message,
)
from verispec.entrypoints.tool_calls import (
    ToolCallStream,
    ToolPlan,
    parse_tool_calls,
    plan_tools,
    template_messages,
    tool_structured_outputs,
)
from verispec.outputs import CompletionOutput, RequestOutput

# Requests with more text than this are prepared (chat template, tokenization) on the prep thread; shorter
# ones take well under a millisecond, less than the hop to a thread and back.
_INLINE_PREP_CHARS = 2048
# One prep thread: tokenization is CPU work, and more threads would take CPU from the engine's steps.
_NUM_PREP_THREADS = 1
# The prep thread's nice value (Linux: per thread). Steps of running requests come first; a large new request's
# tokenization takes the CPU they leave (on a 2-core machine it otherwise halves the engine's speed).
_PREP_NICE = 10


def _lower_priority() -> None:
    """Thread initializer of the prep pool: run this thread (and what it starts) at _PREP_NICE."""
    if sys.platform == "linux":  # setpriority on a thread id is Linux's; elsewhere it would name a process
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _PREP_NICE)


# Bodies larger than this are parsed and validated on the prep thread.
_INLINE_PARSE_BYTES = 64 * 1024
RequestT = TypeVar("RequestT", bound=BaseModel)


def _validate(model: type[RequestT], body: bytes) -> RequestT:
    """pydantic's JSON parser and validator in one pass (jiter: several times faster than json.loads)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        msg, param = validation_message(list(e.errors()))
        raise APIError(400, msg, param=param) from None


def _request_chars(req: CompletionRequest | ChatCompletionRequest, chat: bool) -> int:
    """The text a request brings: what its chat template rendering or tokenization costs grows with it."""
    if chat:
        return sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text) for p in m.content or ())
                   for m in req.messages)
    p = req.prompt
    return len(p) if isinstance(p, str) else sum(len(x) for x in p) if p and isinstance(p[0], str) else 0


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string: text a stop string may
    still remove, so it is not streamed yet (the engine's cumulative text includes it)."""
    for k in range(min(max((len(s) for s in stops), default=1) - 1, len(text)), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0


def finite(v: float | None) -> float | None:
    """A logprob JSON can carry: -inf (a token the sampler ruled out) and NaN become -9999.0."""
    if v is None:
        return None
    return v if v == v and v > -9999.0 else -9999.0


def sse(obj: object) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass
class Prepared:
    """A request ready for the engine."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    chat: bool
    tools: ToolPlan = ToolPlan()  # chat: what tool_choice asks (no tools by default)


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, aengine: AsyncEngine, model_name: str, max_queue: int) -> None:
        self.aengine = aengine
        self.engine = aengine.engine
        self.tokenizer = aengine.engine.tokenizer
        self.model_name = model_name
        self.max_queue = max_queue
        self._prep_pool = concurrent.futures.ThreadPoolExecutor(_NUM_PREP_THREADS, thread_name_prefix="verispec-prep",
                                                                initializer=_lower_priority)

    # ---- preparation --------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        """404 for a model this server does not serve (None means the served one)."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    async def parse(self, model: type[RequestT], body: bytes) -> RequestT:
        """The request `model` of a JSON body; a bad body is a 400 naming the problem. A large body is parsed
        on the prep thread, so the event loop goes on serving while it is."""
        if len(body) <= _INLINE_PARSE_BYTES:
            return _validate(model, body)
        return await asyncio.get_running_loop().run_in_executor(self._prep_pool, _validate, model, body)

    def _too_long(self, num_tokens: int, chat: bool, at_least: bool = False) -> APIError:
        limit = self.engine.max_model_len
        return APIError(
            400, f"This model's maximum context length is {limit} tokens, but the prompt is "
            f"{'at least ' if at_least else ''}{num_tokens} tokens (at most {limit - 1} leave room to generate).",
            param="messages" if chat else "prompt",
        )

    def _render_and_encode(self, req: CompletionRequest | ChatCompletionRequest, chat: bool,
                           tools: ToolPlan) -> tuple[str | None, list[int]]:
        """The prompt text (None for token ids) and its ids: the chat template rendered (with the tools, and
        the assistant prefix tool_choice asks for), the text tokenized. A prompt that cannot fit the context
        is refused before it is tokenized. Raises APIError."""
        if chat:
            messages = template_messages(req)
            try:
                prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                            tools=tools.tools)
            except (ValueError, TypeError) as e:  # a conversation the template cannot render
                raise APIError(400, str(e), param="messages") from None
            prompt += tools.assistant_prefix
        else:
            p = req.prompt
            if isinstance(p, list) and p and isinstance(p[0], str):
                p = p[0]
            if not isinstance(p, str):
                return None, list(p)
            prompt = p
        at_least = self.tokenizer.min_num_tokens(prompt)
        if at_least >= self.engine.max_model_len:
            raise self._too_long(at_least, chat, at_least=True)
        return prompt, self.tokenizer.encode_prompt(prompt)

    async def prepare(self, req: CompletionRequest | ChatCompletionRequest) -> Prepared:
        """Validate model and prompt, render the chat template, tokenize. Raises APIError.

        A large request is rendered and tokenized on the prep thread (the tokenizer releases the GIL for long
        texts), so it never blocks the event loop: /health and the other streams go on meanwhile."""
        self.check_model(req.model)
        chat = isinstance(req, ChatCompletionRequest)
        if not chat:
            if req.echo:
                raise APIError(400, "echo is not supported", param="echo")
            if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str) and len(req.prompt) != 1:
                raise APIError(400, "prompt: only one prompt per request is supported", param="prompt")
        tools = plan_tools(req) if chat else ToolPlan()
        if _request_chars(req, chat) <= _INLINE_PREP_CHARS:
            prompt, ids = self._render_and_encode(req, chat, tools)
        else:
            loop = asyncio.get_running_loop()
            prompt, ids = await loop.run_in_executor(self._prep_pool, self._render_and_encode, req, chat, tools)
        if not ids:
            raise APIError(400, "prompt is empty: at least one token is needed", param="messages" if chat else "prompt")
        if len(ids) >= self.engine.max_model_len:
            raise self._too_long(len(ids), chat)
        if self.aengine.num_waiting() >= self.max_queue:
            raise APIError(503, f"The server is overloaded ({self.aengine.num_waiting()} requests waiting); "
                           "retry later.", type="server_error", code="server_overloaded")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        return Prepared(rid, prompt, ids, chat, tools)

    def close(self) -> None:
        """Stop the prep thread (requests still being prepared finish first)."""
        self._prep_pool.shutdown(wait=True, cancel_futures=True)

    async def start(self, req: CompletionRequest | ChatCompletionRequest, prep: Prepared) -> AsyncIterator[RequestOutput]:
        """Queue the request in the engine; ValueError from the engine becomes a 400."""
        params = req.to_sampling_params(len(prep.prompt_token_ids), self.engine.max_model_len,
                                        None if prep.chat else 16)
        try:
            constraint = tool_structured_outputs(prep.tools)  # "required" / a named function: its JSON schema
            if constraint is not None:
                params = dataclasses.replace(params, structured_outputs=constraint)
            return await self.aengine.add(prep.request_id, prep.prompt, params, prep.prompt_token_ids)
        except ValueError as e:
            raise APIError(400, str(e), param="messages" if prep.chat else "prompt") from None
        except EngineDeadError as e:  # shutting down, or the engine stopped for good (a lost TP rank)
            raise APIError(503, str(e), type="server_error") from None

    # ---- pieces of responses ------------------------------------------------------------------
    def _tok(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def completion_logprobs(self, c: CompletionOutput, start: int, offset0: int, want_top: bool) -> dict | None:
        """OpenAI completions logprobs for tokens [start:] of one choice."""
        if c.logprobs is None:
            return None
        tokens, lps, tops, offsets = [], [], [], []
        offset = offset0
        for tid, d in zip(c.token_ids[start:], c.logprobs[start:], strict=False):
            s = self._tok(tid)
            tokens.append(s)
            lps.append(finite(d.get(tid)))
            tops.append({self._tok(t): finite(v) for t, v in d.items()} if want_top else None)
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, c: CompletionOutput, start: int, k: int) -> dict | None:
        """OpenAI chat logprobs for tokens [start:] of one choice."""
        if c.logprobs is None:
            return None
        content = []
        for tid, d in zip(c.token_ids[start:], c.logprobs[start:], strict=False):
            s = self._tok(tid)
            top = sorted(d.items(), key=lambda kv: -kv[1])[:k]
            content.append({
                "token": s, "logprob": finite(d.get(tid)), "bytes": list(s.encode("utf-8")),
                "top_logprobs": [{"token": (t := self._tok(i)), "logprob": finite(v), "bytes": list(t.encode("utf-8"))}
                                 for i, v in top],
            })
        return {"content": content}

    @staticmethod
    def usage(out: RequestOutput) -> dict:
        n_out = sum(len(c.token_ids) for c in out.outputs)
        n_in = len(out.prompt_token_ids)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

    def _choice(self, req, c: CompletionOutput, prep: Prepared) -> dict:
        if prep.chat:
            message: dict = {"role": "assistant", "content": c.text}
            finish = c.finish_reason
            if prep.tools.parses_calls:
                message["content"], calls = parse_tool_calls(prep.tools, c.text)
                if calls:
                    message["tool_calls"] = calls
                    finish = "tool_calls" if finish == "stop" else finish
            return {"index": c.index, "message": message,
                    "logprobs": self.chat_logprobs(c, 0, req.top_logprobs or 0),
                    "finish_reason": finish, "stop_reason": c.stop_reason}
        return {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                "logprobs": self.completion_logprobs(c, 0, 0, bool(req.logprobs))}

    # ---- whole responses ----------------------------------------------------------------------
    async def full_response(self, req, prep: Prepared, outputs: AsyncIterator[RequestOutput]) -> dict:
        """Run to completion and build the non-streamed response."""
        final = None
        try:
            async for out in outputs:
                final = out
        except EngineDeadError as e:
            unavailable = "shutting down" in str(e) or "engine stopped" in str(e)
            raise APIError(503 if unavailable else 500, str(e), type="server_error") from None
        assert final is not None
        return {
            "id": prep.request_id, "object": "chat.completion" if prep.chat else "text_completion",
            "created": int(time.time()), "model": self.model_name,
            "choices": [self._choice(req, c, prep) for c in final.outputs],
            "usage": self.usage(final),
        }

    async def stream_response(self, req, prep: Prepared, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        """SSE chunks: text deltas per choice, finish reasons, optional usage, then [DONE]."""
        chat = prep.chat
        base = {"id": prep.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}
        sent_text: dict[int, int] = {}
        sent_tok: dict[int, int] = {}
        done: set[int] = set()
        tool_streams: dict[int, ToolCallStream] = {}
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        final = None
        try:
            if chat:
                for i in range(req.n):
                    yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})
            async for out in outputs:
                final = out
                for c in out.outputs:
                    if c.index in done:
                        continue
                    t0, k0 = sent_text.get(c.index, 0), sent_tok.get(c.index, 0)
                    end = len(c.text)
                    if c.finish_reason is None and stops:
                        end -= held_back(c.text, stops)
                    delta = c.text[t0:end] if end > t0 else ""
                    finish, new_calls = c.finish_reason, []
                    if prep.tools.parses_calls:  # content and tool calls parsed out of the text so far
                        stream = tool_streams.setdefault(c.index, ToolCallStream(prep.tools))
                        delta, new_calls = stream.update(c.text[:max(end, t0)], final=finish is not None)
                        if stream.calls and finish == "stop":
                            finish = "tool_calls"
                    if not delta and not new_calls and finish is None:
                        continue  # nothing new that is safe to send
                    sent_text[c.index], sent_tok[c.index] = max(end, t0), len(c.token_ids)
                    if finish is not None:
                        done.add(c.index)
                    if chat:
                        choice = {"index": c.index, "delta": {"content": delta} if delta else {},
                                  "logprobs": self.chat_logprobs(c, k0, req.top_logprobs or 0)}
                        if new_calls:
                            first = len(tool_streams[c.index].calls) - len(new_calls)
                            choice["delta"]["tool_calls"] = [{"index": first + k, **call}
                                                             for k, call in enumerate(new_calls)]
                    else:
                        choice = {"index": c.index, "text": delta,
                                  "logprobs": self.completion_logprobs(c, k0, t0, bool(req.logprobs))}
                    choice["finish_reason"] = finish
                    if finish is not None:
                        choice["stop_reason"] = c.stop_reason
                    yield sse({**base, "choices": [choice]})
            if final is not None and req.include_usage():
                yield sse({**base, "choices": [], "usage": self.usage(final)})
        except Exception as e:  # the engine failed mid-stream: tell the client, then end the stream
            yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        finally:
            await outputs.aclose()
        yield "data: [DONE]\n\n"
