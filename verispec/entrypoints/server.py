"""`verispec serve`: an OpenAI-compatible HTTP server around one LLMEngine.

`build_app(engine, served_model_name)` returns a FastAPI app whose lifespan starts and stops the engine
thread (see async_engine.py); `main(args)` loads the model and runs it with uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from verispec.core.version import __version__
from verispec.entrypoints.args import SERVE_MAX_REQUEST_BYTES
from verispec.entrypoints.async_engine import AsyncEngine
from verispec.entrypoints.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    validation_message,
)
from verispec.entrypoints.replicas import ReplicaSet
from verispec.entrypoints.server_metrics import ServerMetrics
from verispec.entrypoints.serving import OpenAIServing

log = logging.getLogger("verispec.server")

MAX_BODY_BYTES = SERVE_MAX_REQUEST_BYTES  # `verispec serve --max-request-bytes`


async def _send_error(send: Send, err: APIError) -> None:
    body = JSONResponse(err.body(), status_code=err.status)
    await send({"type": "http.response.start", "status": err.status, "headers": body.raw_headers})
    await send({"type": "http.response.body", "body": body.body})


class _Gate:
    """ASGI middleware run before routing: Bearer auth on /v1/*, body size limit, UTF-8 bodies."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body: int, on_error: Callable[[int], None]) -> None:
        self.app, self.api_key, self.max_body, self.on_error = app, api_key, max_body, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        err = self._check_auth(scope)
        body = b""
        if err is None and scope["method"] in ("POST", "PUT", "PATCH"):
            body, err = await self._read_body(scope, receive)
        if err is not None:
            self.on_error(err.status)
            return await _send_error(send, err)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for http.disconnect

        await self.app(scope, replay, send)

    def _check_auth(self, scope: Scope) -> APIError | None:
        if self.api_key is None or not scope["path"].startswith("/v1"):
            return None
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            return None
        return APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                        code="invalid_api_key")

    async def _read_body(self, scope: Scope, receive: Receive) -> tuple[bytes, APIError | None]:
        too_big = APIError(413, f"Request body is larger than {self.max_body} bytes.", code="request_too_large")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            return b"", too_big
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return b"", APIError(400, "client disconnected")
            part = msg.get("body", b"")
            size += len(part)
            if size > self.max_body:
                return b"", too_big
            chunks.append(part)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        if not body.isascii():  # isascii: a fast scan, where decoding a large body would hold the GIL longer
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as e:
                return b"", APIError(400, f"Request body is not valid UTF-8 (byte {e.start}).")
        return body, None


class _SSEResponse(StreamingResponse):
    """A stream that always runs `on_close` (aborting its request), however the connection ends."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()
            self.on_close()


async def _until_disconnect(request: Request, work: Awaitable[dict]) -> dict | None:
    """Await `work`, cancelling it (which aborts its request) if the client goes away first."""

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


def build_app(engine, served_model_name: str, api_key: str | None = None, max_queue: int = 1024,
              max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """An OpenAI-compatible app around `engine`: an LLMEngine, or a list of them (data-parallel
    replicas, entrypoints/replicas.py). Its lifespan runs the engine threads."""
    engines = list(engine) if isinstance(engine, list | tuple) else [engine]
    engine = engines[0]
    aengine = AsyncEngine(engine) if len(engines) == 1 else ReplicaSet([AsyncEngine(e) for e in engines])
    metrics = ServerMetrics(aengine, served_model_name)
    aengine.on_finish = metrics.observe_finished
    serving = OpenAIServing(aengine, served_model_name, max_queue)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        aengine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(aengine.stop)
            await asyncio.to_thread(serving.close)

    app = FastAPI(title="verispec", version=__version__, lifespan=lifespan)
    app.state.aengine, app.state.serving, app.state.metrics = aengine, serving, metrics
    app.state.max_body_bytes = max_body_bytes
    app.add_middleware(_Gate, api_key=api_key, max_body=max_body_bytes, on_error=metrics.observe_error)

    def error_response(err: APIError) -> JSONResponse:
        metrics.observe_error(err.status)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = validation_message(list(exc.errors()))
        return error_response(APIError(400, msg, param=param))

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(APIError(400, str(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(APIError(exc.status_code, str(exc.detail), type=kind))

    async def run(req: CompletionRequest | ChatCompletionRequest, request: Request) -> Response:
        prep = await serving.prepare(req)
        outputs = await serving.start(req, prep)
        if req.stream:
            return _SSEResponse(serving.stream_response(req, prep, outputs),
                                on_close=lambda: aengine.abort(prep.request_id))
        try:
            body = await _until_disconnect(request, serving.full_response(req, prep, outputs))
        finally:
            await outputs.aclose()
        if body is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(body)

    # The routes parse their bodies themselves (serving.parse): a large one off the event loop.
    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        """OpenAI completions (streamed as SSE with "stream": true)."""
        return await run(await serving.parse(CompletionRequest, await request.body()), request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completions (streamed as SSE with "stream": true)."""
        return await run(await serving.parse(ChatCompletionRequest, await request.body()), request)

    def openapi() -> dict:
        """FastAPI's schema plus the request bodies the routes parse themselves."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in (("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest)):
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                schema["paths"][path]["post"]["requestBody"] = {"required": True,
                                                                "content": {"application/json": {"schema": ref}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    def model_card() -> dict:
        return {"id": served_model_name, "object": "model", "created": created, "owned_by": "verispec",
                "root": served_model_name, "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict:
        """The served model."""
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model}")
    async def model(model: str) -> dict:
        """One model by name."""
        serving.check_model(model)
        return model_card()

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the engine thread is alive."""
        ok = aengine.is_alive
        dead = [r.dead for r in getattr(aengine, "replicas", [aengine]) if r.dead]
        status = "ok" if ok else dead[0] if dead else "engine thread not running"
        return JSONResponse({"status": status}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition."""
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def startup_summary(engine, served_model_name: str, replicas: int = 1) -> str:
    """The one start-up line: what runs (model, device, dtype, context, KV cache, speculation)."""
    cfg = engine.config
    spec = cfg.speculative_config
    spec_text = "none" if spec is None else json.dumps(
        {k: v for k, v in dataclasses.asdict(spec).items() if v is not None}, separators=(",", ":"))
    kv = engine.blocks
    parallel = (f", tensor_parallel_size {cfg.tensor_parallel_size}" if cfg.tensor_parallel_size > 1 else "") + (
        f", {replicas} data-parallel replicas" if replicas > 1 else "")
    return (f"model {served_model_name} ({cfg.model}), device {cfg.device}, dtype {cfg.dtype}, "
            f"max_model_len {engine.max_model_len}, KV blocks {kv.num_blocks} x {kv.block_size} tokens, "
            f"speculative_config {spec_text}{parallel}")


def replica_configs(config) -> list:
    """One engine config per data-parallel replica: replica i on cuda:(base + i) on CUDA, all on the CPU
    otherwise, each with data_parallel_size 1 (an engine is one replica). ValueError for more replicas
    than GPUs."""
    n = config.data_parallel_size
    if n == 1:
        return [config]
    device = config.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not device.startswith("cuda"):
        return [dataclasses.replace(config, data_parallel_size=1, device=device) for _ in range(n)]
    import torch

    base = int(device.split(":")[1]) if ":" in device else 0
    if base + n > torch.cuda.device_count():
        raise ValueError(f"data_parallel_size={n} needs {n} GPUs from cuda:{base}, this machine has "
                         f"{torch.cuda.device_count()}")
    return [dataclasses.replace(config, data_parallel_size=1, device=f"cuda:{base + i}") for i in range(n)]


def build_replica(llm_class, config):
    """One replica's engine, built with its GPU as this thread's current CUDA device (events, graph
    captures and Triton launches at start-up use the current device)."""
    if config.device.startswith("cuda:"):
        import torch

        with torch.cuda.device(config.device):
            return llm_class(**config.as_kwargs()).engine
    return llm_class(**config.as_kwargs()).engine


def main(args) -> int:
    """`verispec serve`: load the model, then serve until SIGINT/SIGTERM."""
    from verispec.entrypoints.args import engine_config_from_args

    config = engine_config_from_args(args, "serve")  # checked before the load
    import uvicorn

    from verispec.entrypoints.llm import LLM

    if not log.handlers:  # uvicorn configures only its own loggers
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))  # uvicorn's look
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    engines = [build_replica(LLM, c) for c in replica_configs(config)]
    name = args.served_model_name or config.model
    app = build_app(engines, name, api_key=args.api_key, max_queue=args.max_queue,
                    max_body_bytes=args.max_request_bytes)
    log.info("verispec %s: %s; serving on http://%s:%d", __version__, startup_summary(engines[0], name, len(engines)),
             args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=30)
    return 0
