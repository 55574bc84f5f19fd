"""The engine side of tensor parallelism: start one process per non-zero rank (torch.multiprocessing,
spawn), join them in a torch.distributed group (gloo on CPU, NCCL on CUDA) as rank 0, watch them,
and stop them.

The engine process is rank 0: it keeps the scheduler, the books, the sampler and the proposer, and its
runner broadcasts each step's inputs (distributed/comm.py). Ranks 1..N-1 run distributed/follower.py.
Before every step rank 0 checks that every rank process is alive; a collective that fails or times out
(`distributed_timeout`) becomes a RankFailure naming the rank and how it ended. Environment variables
are inherited as they are (NCCL_NVLS_ENABLE is never touched).
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import tempfile
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verispec.config import EngineConfig
from verispec.core.parallel import RankFailure
from verispec.distributed.comm import TPComm
from verispec.distributed.follower import RankArgs, follower_main, rank_device

log = logging.getLogger("verispec")


def _exit_text(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


class TensorParallelGroup:
    """Rank 0's handle on a tensor-parallel group: its collectives (`comm`), the rank processes, shutdown."""

    def __init__(self, config: EngineConfig) -> None:
        """Start ranks 1..N-1 and join them (bounded by config.distributed_timeout). Raises ValueError if
        this process already holds a group (one tensor-parallel engine per process)."""
        if dist.is_available() and dist.is_initialized():
            raise ValueError("this process already runs a tensor-parallel engine (torch.distributed is "
                             "initialized): shut it down first (engine.shutdown())")
        n = config.tensor_parallel_size
        self.world_size = n
        self.timeout = config.distributed_timeout
        self.device = rank_device(config, 0)
        if self.device.type == "cuda" and torch.cuda.device_count() < self.device.index + n:
            raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs from {self.device}, "
                             f"this machine has {torch.cuda.device_count()}")
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self._dir = tempfile.mkdtemp(prefix="verispec-tp-")
        store_path = os.path.join(self._dir, "store")
        store = dist.FileStore(store_path, n)
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=follower_main, args=(RankArgs(config, r, n, store_path, backend),),
                                  name=f"verispec-tp-rank{r}", daemon=True) for r in range(1, n)]
        for p in self.procs:
            p.start()
        self._closed = False
        self._finalizer = weakref.finalize(self, _reap, self.procs, self._dir)
        t0 = time.monotonic()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            self._wait_for_ranks(store, n)
            dist.init_process_group(backend, store=store, rank=0, world_size=n,
                                    timeout=datetime.timedelta(seconds=self.timeout))
            self.comm = TPComm(0, n, self.device, self.timeout, on_error=self.describe_failure,
                               precheck=self.check_alive)
        except Exception as err:
            why = err.args[0] if isinstance(err, RankFailure) else self.describe_failure(err)
            self.shutdown()
            raise RankFailure(why) from err
        log.info("tensor parallel: %d ranks (%s) joined in %.1fs", n, backend, time.monotonic() - t0)

    def _wait_for_ranks(self, store, n: int) -> None:
        """Until every rank process has reached the store (it sets joined<r>), checking twice a second that
        none has died on the way (an import error; a script without the __main__ guard, which spawn
        re-runs), and at most distributed_timeout seconds."""
        keys = [f"joined{r}" for r in range(1, n)]
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                store.wait(keys, datetime.timedelta(seconds=0.5))
                return
            except Exception:  # the wait timed out (DistStoreError, RuntimeError on older torch)
                dead = self._first_dead()
                if dead is not None:
                    raise RankFailure(f"{dead} before joining the group (its traceback is above; a script that "
                                      "builds a tensor-parallel engine needs the if __name__ == '__main__': guard)"
                                      ) from None
                if time.monotonic() > deadline:
                    raise RankFailure(f"the tensor-parallel ranks did not start within distributed_timeout="
                                      f"{self.timeout:g}s") from None

    def _first_dead(self) -> str | None:
        for r, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                return f"tensor-parallel rank {r} (pid {p.pid}) {_exit_text(p.exitcode)}"
        return None

    def check_alive(self) -> str | None:
        """None while every rank process runs, else what became of the first one that does not."""
        dead = self._first_dead()
        return None if dead is None else f"{dead}; the engine cannot go on"

    def describe_failure(self, err: BaseException) -> str:
        """Why a collective failed, for the RankFailure: a rank that ended (given a moment to be
        reaped), else a timeout or the backend's own words."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            dead = self.check_alive()
            if dead is not None:
                return dead
            time.sleep(0.05)
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "timeout" in text.lower() or "timed out" in text.lower():
            return (f"a tensor-parallel rank did not answer within distributed_timeout={self.timeout:g}s "
                    f"(hung or too slow); the engine cannot go on ({text})")
        return f"a tensor-parallel collective failed ({type(err).__name__}: {text}); the engine cannot go on"

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the ranks (a stop message when the group is healthy, else terminate), leave the group.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        comm = getattr(self, "comm", None)
        if comm is not None and comm.failed is None and self.check_alive() is None:
            try:
                comm.send_stop()
            except RankFailure:
                pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a failed backend may refuse a clean destroy; the processes are gone anyway
                log.debug("destroy_process_group failed", exc_info=True)
        self._finalizer()


def _reap(procs: list, tmpdir: str) -> None:
    """Terminate rank processes still running, and remove the store's directory (also at exit)."""
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    for p in procs:
        p.join(5.0)
        if p.exitcode is None:
            p.kill()
    shutil.rmtree(tmpdir, ignore_errors=True)
