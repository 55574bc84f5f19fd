"""One background thread drives the (not thread-safe) LLMEngine for every HTTP request.

Handlers never touch the engine: they queue commands (add / abort) for the engine thread, which applies them
between steps, runs `engine.step()` while there is work, waits on a condition variable when idle, and hands
each RequestOutput to the owning request's asyncio queue: one `loop.call_soon_threadsafe` per event loop per
step (each call wakes the loop through its self-pipe, so one per stream would cost a system call per request
per step).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from verispec.core.parallel import RankFailure
from verispec.outputs import RequestOutput
from verispec.sampling_params import SamplingParams

log = logging.getLogger("verispec.server")


class EngineDeadError(RuntimeError):
    """The engine failed while running this request (an engine bug, not a client error)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None


@dataclass
class RequestStats:
    """Timings the server turns into Prometheus histograms."""

    ttft: float | None
    e2e: float
    num_output_tokens: int
    finish_reason: str | None


class AsyncEngine:
    """Thread-owned engine with an asyncio interface: `generate()` yields cumulative RequestOutputs."""

    def __init__(self, engine, on_finish: Callable[[RequestStats], None] | None = None) -> None:
        self.engine = engine
        self.on_finish = on_finish
        self._cond = threading.Condition()
        self._cmds: list[tuple] = []
        self._streams: dict[str, _Stream] = {}  # touched by the engine thread only
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.snapshot: dict = engine.get_metrics()  # replaced (never mutated) by the engine thread
        self.num_pending_adds = 0
        self.num_engine_errors = 0
        self.num_aborted = 0
        self.dead: str | None = None  # why the engine stopped for good (a RankFailure), else None

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None or not self._thread.is_alive():
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort outstanding requests and join the engine thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("engine thread did not stop within %.0fs", timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def num_waiting(self) -> int:
        """Requests not yet running: the engine's waiting queue plus adds not yet applied."""
        return self.snapshot.get("num_requests_waiting", 0) + self.num_pending_adds

    # ---- requests ---------------------------------------------------------------------------
    async def add(
        self, request_id: str, prompt: str | None, params: SamplingParams, prompt_token_ids: list[int] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request; raises ValueError for a bad one. Returns an iterator of its cumulative outputs
        that ends when it finishes; leaving the iterator early (or never starting it) must be followed by
        `abort(request_id)` -- closing the iterator does that itself."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("add", request_id, prompt, params, prompt_token_ids, stream, fut))
        try:
            await asyncio.wrap_future(fut)  # ValueError from engine.add_request surfaces here
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return self._iterate(request_id, stream)

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread."""
        self._submit(("abort", request_id))

    def _submit(self, cmd: tuple) -> None:
        with self._cond:
            if self._stopping and cmd[0] == "add":
                why = f"engine stopped: {self.dead}" if self.dead else "the server is shutting down"
                _settle(cmd[-1], EngineDeadError(why))
                return
            if cmd[0] == "add":
                self.num_pending_adds += 1
            self._cmds.append(cmd)
            self._cond.notify()

    # ---- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        _bind_device(eng)
        while True:
            with self._cond:
                while not self._cmds and not self._stopping and not eng.has_unfinished_requests():
                    self._cond.wait()
                cmds, self._cmds = self._cmds, []
                stopping = self._stopping
            for cmd in cmds:
                self._apply(cmd)
            if stopping:
                self._fail_all(EngineDeadError("the server is shutting down"), drain=True)
                return
            if not eng.has_unfinished_requests():
                self._publish_snapshot()
                continue
            try:
                outputs = eng.step()
            except RankFailure as e:  # a tensor-parallel rank is gone: this engine cannot step again
                log.error("engine stopped: %s", e)
                self.num_engine_errors += 1
                self.dead = str(e)
                with self._cond:
                    self._stopping = True  # later adds fail at once (EngineDeadError), /health says 503
                self._fail_all(EngineDeadError(f"engine stopped: {e}"), drain=True)
                return
            except Exception as e:  # an engine bug: fail the requests in flight, keep serving
                log.exception("engine step failed")
                self.num_engine_errors += 1
                self._fail_all(EngineDeadError(f"engine error: {type(e).__name__}: {e}"))
                continue
            now = time.monotonic()
            batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
            for out in outputs:
                self._deliver(out, now, batches)
            for loop, items in batches.items():
                self._put_all(loop, items)
            self._publish_snapshot()

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "abort":
            if cmd[1] in self._streams:
                del self._streams[cmd[1]]
                self.engine.abort_request(cmd[1])
                self.num_aborted += 1
            return
        _, rid, prompt, params, ids, stream, fut = cmd
        with self._cond:
            self.num_pending_adds -= 1
        if not fut.set_running_or_notify_cancel():
            return  # the client left before its request was added
        try:
            self.engine.add_request(rid, prompt, params, ids)
        except Exception as e:
            fut.set_exception(e if isinstance(e, ValueError) else ValueError(str(e)))
            return
        self._streams[rid] = stream
        fut.set_result(None)

    def _deliver(self, out: RequestOutput, now: float, batches: dict) -> None:
        """Book-keep one output and queue it in batches[its stream's loop] (sent after the step)."""
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if stream.first_token is None and any(c.token_ids for c in out.outputs):
            stream.first_token = now
        if out.finished:
            del self._streams[out.request_id]
            if self.on_finish is not None:
                ntok = sum(len(c.token_ids) for c in out.outputs)
                ttft = stream.first_token - stream.arrival if stream.first_token is not None else None
                reason = out.outputs[0].finish_reason if out.outputs else None
                self.on_finish(RequestStats(ttft, now - stream.arrival, ntok, reason))
        batches.setdefault(stream.loop, []).append((stream.queue, out))

    def _fail_all(self, err: BaseException, drain: bool = False) -> None:
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
            self._put(stream, type(err)(*err.args))  # one exception object per waiting task
        self._streams.clear()
        if not drain:
            return
        with self._cond:
            for cmd in self._cmds:
                if cmd[0] == "add":
                    _settle(cmd[-1], err)
            self._cmds.clear()
            self.num_pending_adds = 0

    def _publish_snapshot(self) -> None:
        snap = self.engine.get_metrics()
        snap["num_requests_in_server"] = len(self._streams)
        self.snapshot = snap

    @staticmethod
    def _put(stream: _Stream, item: object) -> None:
        AsyncEngine._put_all(stream.loop, [(stream.queue, item)])

    @staticmethod
    def _put_all(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, object]]) -> None:
        """Put each item in its queue, in order, with one wake-up of their event loop."""
        try:
            loop.call_soon_threadsafe(_put_in_order, items)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _bind_device(engine) -> None:
    """Make the engine's GPU this thread's current CUDA device: the current device is per thread, and the
    engine's events, graph captures and Triton launches use it (data-parallel replica i runs on cuda:i)."""
    device = getattr(getattr(engine, "config", None), "device", "cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        import torch

        torch.cuda.set_device(device)


def _put_in_order(items: list[tuple[asyncio.Queue, object]]) -> None:
    """On the event loop: hand a step's outputs to their requests' queues."""
    for queue, item in items:
        queue.put_nowait(item)


def _settle(fut: concurrent.futures.Future, err: BaseException) -> None:
    """Fail an add's future unless its caller already gave up on it."""
    if fut.set_running_or_notify_cancel():
        fut.set_exception(err)
