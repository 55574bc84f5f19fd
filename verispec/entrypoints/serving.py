"""Completions and chat completions: prompt preparation, OpenAI-shaped responses and SSE streams."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from verispec.entrypoints.async_engine import AsyncEngine, EngineDeadError
from verispec.entrypoints.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest
from verispec.outputs import CompletionOutput, RequestOutput

_THREAD_ENCODE_CHARS = 20_000  # longer prompts are tokenized off the event loop


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


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, aengine: AsyncEngine, model_name: str, max_queue: int) -> None:
        self.aengine = aengine
        self.engine = aengine.engine
        self.tokenizer = aengine.engine.tokenizer
        self.model_name = model_name
        self.max_queue = max_queue

    # ---- preparation --------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        """404 for a model this server does not serve (None means the served one)."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    async def _encode(self, text: str) -> list[int]:
        if len(text) > _THREAD_ENCODE_CHARS:
            return await asyncio.to_thread(self.tokenizer.encode_prompt, text)
        return self.tokenizer.encode_prompt(text)

    async def prepare(self, req: CompletionRequest | ChatCompletionRequest) -> Prepared:
        """Validate model and prompt, render the chat template, tokenize. Raises APIError."""
        self.check_model(req.model)
        chat = isinstance(req, ChatCompletionRequest)
        if chat:
            messages = [m.to_template() for m in req.messages]
            try:
                prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
            except (ValueError, TypeError) as e:  # a conversation the template cannot render
                raise APIError(400, str(e), param="messages") from None
            ids = await self._encode(prompt)
        else:
            if req.echo:
                raise APIError(400, "echo is not supported", param="echo")
            p = req.prompt
            if isinstance(p, list) and p and isinstance(p[0], str):
                if len(p) != 1:
                    raise APIError(400, "prompt: only one prompt per request is supported", param="prompt")
                p = p[0]
            prompt, ids = (p, await self._encode(p)) if isinstance(p, str) else (None, list(p))
        if not ids:
            raise APIError(400, "prompt is empty: at least one token is needed", param="messages" if chat else "prompt")
        limit = self.engine.max_model_len
        if len(ids) >= limit:
            raise APIError(
                400, f"This model's maximum context length is {limit} tokens, but the prompt is {len(ids)} tokens "
                f"(at most {limit - 1} leave room to generate).", param="messages" if chat else "prompt",
            )
        if self.aengine.num_waiting() >= self.max_queue:
            raise APIError(503, f"The server is overloaded ({self.aengine.num_waiting()} requests waiting); "
                           "retry later.", type="server_error", code="server_overloaded")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        return Prepared(rid, prompt, ids, chat)

    async def start(self, req: CompletionRequest | ChatCompletionRequest, prep: Prepared) -> AsyncIterator[RequestOutput]:
        """Queue the request in the engine; ValueError from the engine becomes a 400."""
        params = req.to_sampling_params(len(prep.prompt_token_ids), self.engine.max_model_len,
                                        None if prep.chat else 16)
        try:
            return await self.aengine.add(prep.request_id, prep.prompt, params, prep.prompt_token_ids)
        except ValueError as e:
            raise APIError(400, str(e), param="messages" if prep.chat else "prompt") from None

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

    def _choice(self, req, c: CompletionOutput, chat: bool) -> dict:
        if chat:
            return {"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self.chat_logprobs(c, 0, req.top_logprobs or 0),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
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
            shutting_down = "shutting down" in str(e)
            raise APIError(503 if shutting_down else 500, str(e), type="server_error") from None
        assert final is not None
        return {
            "id": prep.request_id, "object": "chat.completion" if prep.chat else "text_completion",
            "created": int(time.time()), "model": self.model_name,
            "choices": [self._choice(req, c, prep.chat) for c in final.outputs],
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
                    if not delta and c.finish_reason is None:
                        continue  # nothing new that is safe to send
                    sent_text[c.index], sent_tok[c.index] = max(end, t0), len(c.token_ids)
                    if c.finish_reason is not None:
                        done.add(c.index)
                    if chat:
                        choice = {"index": c.index, "delta": {"content": delta} if delta else {},
                                  "logprobs": self.chat_logprobs(c, k0, req.top_logprobs or 0)}
                    else:
                        choice = {"index": c.index, "text": delta,
                                  "logprobs": self.completion_logprobs(c, k0, t0, bool(req.logprobs))}
                    choice["finish_reason"] = c.finish_reason
                    if c.finish_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                    yield sse({**base, "choices": [choice]})
            if final is not None and req.include_usage():
                yield sse({**base, "choices": [], "usage": self.usage(final)})
        except Exception as e:  # the engine failed mid-stream: tell the client, then end the stream
            yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        finally:
            await outputs.aclose()
        yield "data: [DONE]\n\n"
