"""Per-request sampling keys: the seed of each sampling event, so that a request's random stream
depends only on the request (its seed, else the engine seed and its id), the output index the event
samples and a salt (0: the target's verifier, 1: drafters), never on the batch around it.

The verifier and the proposers both key their draws here; proposers import this module, never the
runner or the verifier.
"""

from __future__ import annotations

import zlib

import torch

from verispec.core.request import Request


def sample_key(req: Request, engine_seed: int, index: int, salt: int = 0) -> int:
    """Seed for the sampling event at a request's output index (salt separates drafters)."""
    base = req.params.seed if req.params.seed is not None else engine_seed * 1_000_003 + zlib.crc32(req.request_id.encode())
    return (base * 6_364_136_223 + index * 1_442_695_041 + salt * 97_531) & (2**62 - 1)


_MASK64 = (1 << 64) - 1


def key32(key: int) -> int:
    """A sampling key folded to 32 bits (splitmix64's finalizer), for the batched draw of the verifier's
    undrafted rows (sampler.sample_by_key), which needs no torch.Generator."""
    z = (key + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 32


class RequestGenerators:
    """One torch.Generator per request, re-seeded with sample_key before every sampling event (so
    preemption, another batch or the overlapped loop never shift a request's stream)."""

    def __init__(self, device: torch.device | str, engine_seed: int, salt: int = 0) -> None:
        self.device, self.engine_seed, self.salt = device, engine_seed, salt
        self._by_id: dict[str, torch.Generator] = {}

    def at(self, req: Request, index: int) -> torch.Generator:
        """The request's generator, seeded for the event that samples output index `index`."""
        g = self._by_id.get(req.request_id)
        if g is None:
            g = self._by_id[req.request_id] = torch.Generator(device=self.device)
        g.manual_seed(sample_key(req, self.engine_seed, index, self.salt))
        return g

    def free(self, request_id: str) -> None:
        """Forget a finished or preempted request's generator."""
        self._by_id.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._by_id)
