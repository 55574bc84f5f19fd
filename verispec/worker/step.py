"""A launched step and its results: the device-side packed result (the truth), the reusable host
mirror its one device->host copy lands in, and the host values collect() builds from it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verispec.core.scheduler_output import ScheduledRequest, SchedulerOutput
from verispec.worker.token_state import DeviceTokens
from verispec.worker.verifier import Audit


@dataclass
class StepResult:
    """What one target step produced, by request id (host values, after collect())."""

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    # Hidden states of the captured layers at every scheduled position (for drafters), and
    # for each request the index of its first token in that flat batch.
    captured: list[torch.Tensor] = field(default_factory=list)
    token_offsets: dict[str, int] = field(default_factory=dict)
    audit_mismatches: int = 0
    audited: int = 0
    # Audited rows that passed the runner's checks: the accepted drafts the host re-verification
    # found (the engine checks its counters against them).
    audit_accepted: dict[str, int] = field(default_factory=dict)


@dataclass
class StepHandle:
    """A launched step. Device tensors are the truth; `host` is their mirror, valid after collect()
    (or after counts(), which waits for the same copy)."""

    sched: SchedulerOutput
    sampling: list[tuple[ScheduledRequest, int]]
    captured: list[torch.Tensor]
    token_offsets: dict[str, int]
    # The results on the device, packed: [S*W tokens (PLACEHOLDER past each count) | S counts].
    packed: torch.Tensor | None = None
    width: int = 0  # W: 1 + the most drafts of any row
    # Mirror of `packed` on the host (stale until the event completed).
    host: torch.Tensor | None = None
    event: object | None = None
    logits: torch.Tensor | None = None
    audit: Audit | None = None
    collected: StepResult | None = None
    _mirror_slot: tuple | None = None

    @property
    def sampled_dev(self) -> torch.Tensor | None:
        """[S, W] long on the device: each row's tokens, PLACEHOLDER past its count."""
        if self.packed is None:
            return None
        return self.packed[: len(self.sampling) * self.width].view(len(self.sampling), self.width)

    @property
    def num_sampled_dev(self) -> torch.Tensor | None:
        """[S] on the device: tokens each row emitted."""
        return None if self.packed is None else self.packed[len(self.sampling) * self.width :]

    def device_tokens(self) -> DeviceTokens | None:
        """This step's sampled tokens as a device buffer keyed by request id (output indices)."""
        if self.packed is None:
            return None
        rows: dict[str, int] = {}
        base: dict[str, int] = {}
        for i, (s, _) in enumerate(self.sampling):
            rid = s.request.request_id
            rows[rid] = i
            base[rid] = s.output_base
        return DeviceTokens(self.sampled_dev, rows, base)

    def counts(self) -> list[int]:
        """Tokens each sampling request emitted (1 + accepted drafts). Waits for the step's copy
        to the host (no extra transfer) and reads only the counts."""
        if self.packed is None:
            return []
        if self.host is None:  # already collected: the mirror went back to the pool
            return self.num_sampled_dev.tolist()
        if self.event is not None:
            self.event.synchronize()
        return self.host[len(self.sampling) * self.width :].tolist()

    def host_values(self) -> list[int]:
        """Wait for the step's copy and read the whole mirror (collect() only: it then hands the
        mirror back to the pool)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()

    def sampled_by_id(self, values: list[int]) -> dict[str, list[int]]:
        """Each sampling request's emitted tokens, from the packed host values."""
        w, num = self.width, len(self.sampling)
        counts = values[num * w :]
        return {
            s.request.request_id: values[o : o + c]
            for (s, _), o, c in zip(self.sampling, range(0, num * w, w), counts, strict=False)
        }


class HostMirrors:
    """Reusable host buffers (pinned on CUDA) and events for the results' device->host copies."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.free: list[tuple[torch.Tensor, object | None]] = []

    def copy(self, src: torch.Tensor) -> tuple[torch.Tensor, object | None, tuple]:
        """Start a copy of the 1-D long src to the host: (host view, event, slot to release)."""
        buf, event = self.free.pop() if self.free else (None, torch.cuda.Event() if self.cuda else None)
        n = src.numel()
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 1024), dtype=torch.long, pin_memory=self.cuda)
        view = buf[:n]
        view.copy_(src, non_blocking=True)
        if event is not None:
            event.record()
        return view, event, (buf, event)

    def release(self, slot: tuple) -> None:
        """Hand a mirror back to the pool (nothing may read it afterwards)."""
        self.free.append(slot)
