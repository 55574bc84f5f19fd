"""Token ids that live on the device, and their host mirrors.

Rule: the device copy is the source of truth for sampled, accepted and draft token ids. The host
keeps *mirrors* for the scheduler's books, detokenization, stop checks and host-side proposers.

Host mirrors in this engine, and when each is stale:
  - Request.output_token_ids: entries equal to PLACEHOLDER stand for tokens that a launched step
    produced on the device but whose values have not been collected yet. Lifetime: from the
    step's launch (optimistic commit) until StepHandle.collect() replaces them. Readers: the
    detokenizer, stop checks, host proposers (ngram) and penalties — only after collect();
    the RequestOutputs built while a step is in flight (LLMEngine._completion), which list only
    the known prefix (placeholders always trail: steps resolve in launch order).
  - Request.spec_token_ids: in the overlapped loop, draft ids proposed on the device are
    PLACEHOLDER on the host; the engine fills them in (LLMEngine._collect_drafts) only before a
    step with penalty requests, whose penalties count the drafts. The verifier must read the
    drafts from DeviceTokens (the device buffer), never from this mirror.
  - StepHandle.host: the step's packed results [tokens | counts], one non-blocking copy into a
    reused pinned buffer; valid only after the step's event completed (collect() waits for it;
    counts() waits for it too and reads only the counts). collect() hands the buffer back to the
    runner's pool, so nothing may read it afterwards (StepHandle.collected holds the values). On
    CPU the copy is synchronous, but the mirror is still *logically* stale until collect(), so
    CPU tests exercise the same lifetimes as CUDA.
With VERISPEC_DEBUG_STALE=1, reading a stale mirror through read_mirror() raises StaleMirrorError.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verispec.core.faults import NO_FAULTS, Faults
from verispec.core.placeholder import PLACEHOLDER
from verispec.worker.inputs import to_device


@dataclass
class DeviceTokens:
    """Token ids on the device, addressed by request id (never by batch position).

    values: [R, W] long on the device; row r belongs to rows_by_id' key; base[req_id] is the index
    (in the request's output, or in its draft list) of column 0.
    """

    values: torch.Tensor
    rows_by_id: dict[str, int] = field(default_factory=dict)
    base: dict[str, int] = field(default_factory=dict)
    width: int = field(init=False)  # values.shape[1], read once (flat_index runs per placeholder)

    def __post_init__(self) -> None:
        self.width = self.values.shape[1]

    def flat_index(self, req_id: str, index: int) -> int | None:
        row = self.rows_by_id.get(req_id)
        if row is None:
            return None
        col = index - self.base[req_id]
        if not 0 <= col < self.width:
            return None
        return row * self.width + col


Owner = tuple[str, str, int]  # (request id, "out" | "draft", index) of a placeholder input
# On the device: (positions [P], source indices [P], flat [F]), meaning input_ids[positions] = flat[sources]
Placeholders = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def fill_placeholders(ids: torch.Tensor, ph: Placeholders) -> None:
    """ids[positions] = flat[sources]: the placeholders' device values (two torch index kernels)."""
    pos_t, src_t, flat = ph
    ids[pos_t] = flat[src_t]


def gather_plan(
    placeholders: list[tuple[int, Owner | None]], sources: dict[str, DeviceTokens | None]
) -> tuple[list[int], list[int], torch.Tensor | None]:
    """Host half of combining inputs: for each placeholder (input position, owner), its position
    and its index into `flat`, the referenced device sources' values flattened and concatenated.
    Raises if a placeholder has no device value."""
    positions: list[int] = []
    gather: list[int] = []
    parts: list[torch.Tensor] = []
    offsets: dict[str, int] = {}
    total = 0
    kind = src = base = None  # the last owner kind's source and offset (runs of one kind are the rule)
    for i, owner in placeholders:
        if not owner:
            raise RuntimeError(f"placeholder at input {i} ({owner}) has no device value")
        if owner[1] != kind:
            kind = owner[1]
            src = sources.get(kind)
            base = offsets.get(kind)
            if base is None and src is not None:
                base = offsets[kind] = total
                parts.append(src.values.reshape(-1))
                total += src.values.numel()
        idx = src.flat_index(owner[0], owner[2]) if src is not None else None
        if idx is None:
            raise RuntimeError(f"placeholder at input {i} ({owner}) has no device value")
        positions.append(i)
        gather.append(base + idx)
    flat = None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts)
    return positions, gather, flat


def combine_inputs(
    host_ids: list[int],
    owners: list[Owner | None],
    sources: dict[str, DeviceTokens | None],
    device: torch.device,
    faults: Faults = NO_FAULTS,
) -> torch.Tensor:
    """Device input ids for a step: host ids where known, device values where the host holds a
    PLACEHOLDER. owners[i] = (request id, "out" | "draft", index) for placeholder positions.
    One host->device copy of the ids and one gather from the device buffers; no device->host sync.
    (The target runner does the same through its staging buffers: ModelRunner.launch.)"""
    placeholders = [(i, owners[i]) for i, tok in enumerate(host_ids) if tok == PLACEHOLDER]
    positions, gather, flat = gather_plan(placeholders, sources)
    if faults.active("placeholder_leak"):  # the bug: a placeholder id reaches the model as a real token
        return to_device([0 if t == PLACEHOLDER else t for t in host_ids], torch.long, device)
    if not positions:
        return to_device(host_ids, torch.long, device)
    # One pinned copy of ids, positions and sources (pageable copies may wait for the stream).
    n, p = len(host_ids), len(positions)
    packed = to_device(host_ids + positions + gather, torch.long, device)
    ids_dev = packed[:n]
    fill_placeholders(ids_dev, (packed[n : n + p], packed[n + p :], flat))
    return ids_dev
