"""A non-zero tensor-parallel rank's process: join the group, load and shard the model, build a runner
over this rank's KV heads, then run each step rank 0 broadcasts until it says stop.

It keeps no books and samples nothing: the scheduler, the verifier and the proposer live in rank 0's
engine process. A failure here ends the process (its traceback on stderr), which rank 0 reports as a
RankFailure; when rank 0 goes away, this rank's next collective fails and it exits too.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verispec.config import EngineConfig
from verispec.core.parallel import RankFailure
from verispec.distributed.comm import TPComm
from verispec.distributed.shard import shard_model
from verispec.loader.model_loader import DTYPES, load_model
from verispec.worker.runner import ModelRunner
from verispec.worker.step_message import OP_SETUP, OP_STOP


@dataclass(frozen=True)
class RankArgs:
    """What a non-zero rank's process is started with (picklable)."""

    config: EngineConfig
    rank: int
    world_size: int
    store_path: str  # rank 0's FileStore
    backend: str


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r's device: cuda:(base + r) on CUDA (base: the configured index, default 0), else the CPU."""
    if not config.device.startswith("cuda"):
        return torch.device("cpu")
    base = int(config.device.split(":")[1]) if ":" in config.device else 0
    return torch.device("cuda", base + rank)


def follower_main(args: RankArgs) -> None:
    """The process entry point (torch.multiprocessing spawn target)."""
    config, rank, n = args.config, args.rank, args.world_size
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    store = dist.FileStore(args.store_path, n)
    store.set(f"joined{rank}", "1")  # rank 0 waits for this, watching that this process lives
    dist.init_process_group(args.backend, store=store, rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=config.distributed_timeout))
    comm = TPComm(rank, n, device, config.distributed_timeout)
    try:
        serve_steps(config, comm, device)
    except RankFailure as err:  # rank 0 went away or failed: nothing left to serve
        print(f"verispec tensor-parallel rank {rank}: {err}", file=sys.stderr)
        sys.exit(1)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


@torch.inference_mode()
def serve_steps(config: EngineConfig, comm: TPComm, device: torch.device) -> None:
    """Load and shard, then follow rank 0 until stop: a set-up (an engine built over the shards: rank
    0's KV block count and graph options) builds this rank's runner, a step runs on it."""
    dtype = DTYPES[config.dtype]
    _, _, model = load_model(config.model, device, dtype, progress=False)
    shard_model(model, comm)
    runner = None
    while True:
        message = comm.recv_step()
        op = int(message[0])
        if op == OP_STOP:
            return
        if op == OP_SETUP:
            runner = None  # the previous engine's KV cache and graphs go first
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            setup = comm.broadcast_object()
            runner = ModelRunner(model, setup["num_blocks"], setup["block_size"], device, dtype,
                                 graph_options=setup["graph_options"], tp=comm)
            comm.barrier_ok(True)
        else:
            runner.follow(message)
