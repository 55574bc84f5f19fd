"""What the model and the runner need from tensor parallelism, as an interface: the collectives of one
tensor-parallel group and the failure a lost rank raises. verispec/distributed implements it; the
layers below it (worker, models) only see this protocol, so they never import torch.distributed."""

from __future__ import annotations

from typing import Protocol

import torch


class RankFailure(RuntimeError):
    """A tensor-parallel rank died, hung past the collective timeout, or failed: the engine cannot go on."""


class TensorParallel(Protocol):
    """The collectives of one tensor-parallel group, as seen from one rank."""

    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks (row-parallel partial sums, vocab-parallel embeddings)."""
        ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x laid side by side along the last dimension, rank order (vocab-parallel logits)."""
        ...

    def send_step(self, message: torch.Tensor) -> None:
        """Rank 0: hand a step's packed inputs (int64, worker/step_message.py) to every other rank, one broadcast."""
        ...
