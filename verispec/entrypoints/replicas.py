"""Data parallelism for the server: N engine replicas behind one app, each driven by its own
AsyncEngine thread; a new request goes to the replica with the fewest requests in flight (added and
not finished; ties: the one given the fewest so far, then the lowest index), and /metrics reads one
snapshot that sums the replicas'.

`ReplicaSet` has the AsyncEngine interface the server's handlers and metrics use (add, abort, start,
stop, is_alive, num_waiting, snapshot, ...), so the HTTP layer does not know how many engines it has.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

from verispec.entrypoints.async_engine import AsyncEngine, RequestStats
from verispec.outputs import RequestOutput
from verispec.sampling_params import SamplingParams

# Snapshot keys that are not sums: recomputed from the summed counters.
_DERIVED = ("spec_decode_mean_acceptance_length", "spec_decode_mean_k")


def merge_snapshots(snaps: Sequence[dict]) -> dict:
    """One metrics snapshot for several engines: numbers summed, lists summed position by position
    (the per-position acceptance counts), the means recomputed from the summed counters."""
    out: dict = {}
    for snap in snaps:
        for key, value in snap.items():
            if isinstance(value, list):
                acc = out.setdefault(key, [])
                acc.extend([0] * (len(value) - len(acc)))
                for i, v in enumerate(value):
                    acc[i] += v
            elif isinstance(value, int | float) and not isinstance(value, bool):
                out[key] = out.get(key, 0) + value
            else:
                out.setdefault(key, value)
    drafts, steps = out.get("spec_decode_num_drafts", 0), out.get("spec_decode_num_request_steps", 0)
    if "spec_decode_mean_acceptance_length" in out:
        out["spec_decode_mean_acceptance_length"] = (
            1 + out["spec_decode_num_accepted_tokens"] / drafts) if drafts else 0.0
    if "spec_decode_mean_k" in out:
        out["spec_decode_mean_k"] = out["spec_decode_num_draft_tokens"] / steps if steps else 0.0
    return out


class ReplicaSet:
    """N AsyncEngines as one: requests balanced by load (fewest in flight), metrics summed.

    Routing state (in-flight counts, which replica owns a request) is touched on the event loop only
    (add and the streams' ends); abort() may come from any thread and only reads it."""

    def __init__(self, replicas: Sequence[AsyncEngine]) -> None:
        if not replicas:
            raise ValueError("a ReplicaSet needs at least one replica")
        self.replicas = list(replicas)
        self.engine = self.replicas[0].engine  # tokenizer, max_model_len, config: the same in every replica
        self.in_flight = [0] * len(self.replicas)
        self.num_routed = [0] * len(self.replicas)
        self._owner: dict[str, int] = {}

    # ---- AsyncEngine's interface ------------------------------------------------------------
    @property
    def on_finish(self) -> Callable[[RequestStats], None] | None:
        return self.replicas[0].on_finish

    @on_finish.setter
    def on_finish(self, fn: Callable[[RequestStats], None] | None) -> None:
        for r in self.replicas:
            r.on_finish = fn

    def start(self) -> None:
        for r in self.replicas:
            r.start()

    def stop(self, timeout: float = 30.0) -> None:
        for r in self.replicas:
            r.stop(timeout)

    @property
    def is_alive(self) -> bool:
        return all(r.is_alive for r in self.replicas)

    def num_waiting(self) -> int:
        return sum(r.num_waiting() for r in self.replicas)

    @property
    def snapshot(self) -> dict:
        return merge_snapshots([r.snapshot for r in self.replicas])

    @property
    def num_pending_adds(self) -> int:
        return sum(r.num_pending_adds for r in self.replicas)

    @property
    def num_engine_errors(self) -> int:
        return sum(r.num_engine_errors for r in self.replicas)

    @property
    def num_aborted(self) -> int:
        return sum(r.num_aborted for r in self.replicas)

    def pick(self) -> int:
        """The replica a new request goes to: the fewest in flight; on a tie the one given the fewest so far
        (an idle server alternates), then the lowest index."""
        return min(range(len(self.replicas)), key=lambda i: (self.in_flight[i], self.num_routed[i], i))

    async def add(self, request_id: str, prompt: str | None, params: SamplingParams,
                  prompt_token_ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
        """AsyncEngine.add on the least loaded replica (ValueError for a bad request, as there)."""
        i = self.pick()
        self.in_flight[i] += 1
        self.num_routed[i] += 1
        self._owner[request_id] = i
        try:
            stream = await self.replicas[i].add(request_id, prompt, params, prompt_token_ids)
        except BaseException:
            self._release(request_id)
            raise
        return _Tracked(stream, lambda: self._release(request_id))

    def _release(self, request_id: str) -> None:
        """The request left its replica (finished, failed, aborted, or its stream was closed): once."""
        i = self._owner.pop(request_id, None)
        if i is not None:
            self.in_flight[i] -= 1

    def abort(self, request_id: str) -> None:
        i = self._owner.get(request_id)
        if i is not None:
            self.replicas[i].abort(request_id)
            self._release(request_id)


class _Tracked:
    """A replica's output stream that tells the router when the request is over: at its end, on an
    error, on aclose() (even before the first item: an async generator's finally would not run then)."""

    def __init__(self, stream, release: Callable[[], None]) -> None:
        self._stream, self._release = stream, release

    def __aiter__(self) -> _Tracked:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            return await self._stream.__anext__()
        except BaseException:  # StopAsyncIteration included: the request is over
            self._release()
            raise

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()  # a client that left early: the replica aborts the request
        finally:
            self._release()
