"""The collectives of one tensor-parallel group (core.parallel.TensorParallel) over torch.distributed,
and the step channel: rank 0 broadcasts each step's packed inputs, the other ranks receive them.

Two process groups over one store: `compute` (all-reduce, all-gather) waits at most `timeout` seconds
for a rank, so a rank that died or hangs fails the step instead of blocking it; `steps` (the step
broadcast, and the set-up objects) waits without a practical bound, since the other ranks sit in it
while the engine is idle. A rank that dies closes its connections, so a collective with it fails at
once; `on_error` (the engine side: the rank processes' exit codes) turns any failure into a RankFailure
that says which rank and why, and the group stays failed afterwards (no later collective is tried).

The step channel sends a fixed-size int64 buffer, so a receiver needs no length first: one broadcast per
step. A message larger than the buffer is preceded by a GROW message, after which both sides reallocate.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

from verispec.core.parallel import RankFailure
from verispec.worker.step_message import HEADER, OP_GROW, OP_SETUP, OP_STOP

IDLE_TIMEOUT = datetime.timedelta(days=365)


class TPComm:
    """One rank's view of a tensor-parallel group (the default torch.distributed group and a second
    group over its ranks for the step channel). Satisfies core.parallel.TensorParallel."""

    def __init__(self, rank: int, world_size: int, device: torch.device, timeout: float,
                 on_error: Callable[[BaseException], str] | None = None,
                 precheck: Callable[[], str | None] | None = None, capacity: int = 1 << 14) -> None:
        """on_error(err) -> why a collective failed (rank 0: the rank processes' fate); precheck() -> why
        the group cannot run a step, or None (rank 0, before every step: the processes are alive)."""
        self.rank, self.world_size, self.device = rank, world_size, device
        self.timeout = timeout
        self.on_error, self.precheck = on_error, precheck
        self.failed: str | None = None
        self.steps_group = dist.new_group(list(range(world_size)), timeout=IDLE_TIMEOUT)
        self.buffer = torch.zeros(capacity, dtype=torch.long, device=device)

    # ---- failures ------------------------------------------------------------------------------
    def _fail(self, err: BaseException) -> RankFailure:
        why = self.on_error(err) if self.on_error is not None else ""
        self.failed = why or f"a tensor-parallel collective failed on rank {self.rank}: {err}"
        return RankFailure(self.failed)

    def _check(self) -> None:
        if self.failed is not None:
            raise RankFailure(self.failed)

    # ---- compute collectives ---------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._check()
        try:
            dist.all_reduce(x)
        except Exception as err:  # gloo / NCCL report a lost peer or a timeout as various errors
            raise self._fail(err) from err
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self._check()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        try:
            dist.all_gather(parts, x)
        except Exception as err:
            raise self._fail(err) from err
        return torch.cat(parts, dim=-1)

    # ---- the step channel ------------------------------------------------------------------------
    def _broadcast(self, buf: torch.Tensor) -> None:
        try:
            dist.broadcast(buf, 0, group=self.steps_group)
        except Exception as err:
            raise self._fail(err) from err

    def send_step(self, message: torch.Tensor) -> None:
        """Rank 0: broadcast message (int64, its op in slot 0) in the fixed-size buffer."""
        self._check()
        why = self.precheck() if self.precheck is not None else None
        if why is not None:
            self.failed = why
            raise RankFailure(why)
        n = message.numel()
        if n > self.buffer.numel():
            grow = torch.zeros(HEADER, dtype=torch.long)
            grow[0], grow[1] = OP_GROW, max(n, 2 * self.buffer.numel())
            self.buffer[:HEADER].copy_(grow)
            self._broadcast(self.buffer)
            self.buffer = torch.zeros(int(grow[1]), dtype=torch.long, device=self.device)
        self.buffer[:n].copy_(message)
        self._broadcast(self.buffer)

    def _send_op(self, op: int) -> None:
        message = torch.zeros(HEADER, dtype=torch.long)
        message[0] = op
        self.send_step(message.to(self.device))

    def send_stop(self) -> None:
        """Rank 0: tell the other ranks to leave their step loops."""
        self._send_op(OP_STOP)

    def send_setup(self, setup: dict) -> None:
        """Rank 0: a new engine over the same shards: every rank builds its runner from `setup` (the KV
        block count, the graph options); returns once all are ready (bounded by the timeout)."""
        self._send_op(OP_SETUP)
        self.broadcast_object(setup)
        if not self.barrier_ok(True):
            raise self._fail(RuntimeError("a rank failed to set up its runner"))

    def recv_step(self) -> torch.Tensor:
        """Other ranks: the next message (a view of the buffer, valid until the next recv_step)."""
        while True:
            self._broadcast(self.buffer)
            op, size = self.buffer[:2].tolist()
            if op != OP_GROW:
                return self.buffer
            self.buffer = torch.zeros(size, dtype=torch.long, device=self.device)

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's obj on every rank (the set-up, once)."""
        box = [obj]
        try:
            dist.broadcast_object_list(box, 0, group=self.steps_group,
                                       device=self.device if self.device.type == "cuda" else None)
        except Exception as err:
            raise self._fail(err) from err
        return box[0]

    def barrier_ok(self, ok: bool) -> bool:
        """All ranks say whether they are ready; True when every one is (a compute collective, so bounded)."""
        flag = torch.tensor([0 if ok else 1], dtype=torch.long, device=self.device)
        return int(self.all_reduce(flag).item()) == 0
