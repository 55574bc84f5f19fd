"""AttentionBackend: the interface every paged-attention backend implements (after mini-sglang's
BaseAttnBackend).

A backend is an object the model holds (CausalLM.attn_backend) and hands to every layer. It owns:
  * its metadata needs: prepare_metadata() returns what it adds to a step's AttentionMetadata beyond
    the common tensors (slot_mapping, query_start_loc, seq_lens, block_tables), and
    needs_reference_indices says whether a builder must add them (worker/inputs.build_batch);
  * its K/V write: write_kv() stores this step's K/V in the paged cache [2, num_slots, KH, D], and
    rotary_write_kv() rotates q and k to their positions on the way (the Triton backend does both in
    one kernel on CUDA);
  * the attention itself: forward(q, kv_cache, meta, scale, prefetch);
  * what a CUDA graph needs: supports_graphs (every per-step value is read from the metadata
    tensors, none baked into a launch as a host value), prepare_for_capture() before a shape is
    captured over the graph's static metadata, prepare_for_replay() before each replay.
The graph runner (worker/graphs.py) calls the last two; the backends here have nothing to stage
there (the runner copies the common metadata into the static buffers), so the hooks check the
contract. Backends: attention/reference.py (plain torch, the reference and the CPU path) and
attention/triton.py (the Triton paged kernels, CUDA).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from verispec.core.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from verispec.kernels.l2_prefetch import Regions


class AttentionBackend:
    """Paged attention over one layer's cache [2, num_slots, KH, D] (slot = block_id * block_size +
    offset). Subclasses implement write_kv() and forward(); the defaults here add no metadata, rotate
    with the model's rotary module before the write, and ask for no L2 prefetch."""

    name = "base"
    supports_graphs = False  # per-step values only from metadata tensors: safe to capture and replay
    needs_reference_indices = False  # metadata must carry build_reference_indices' gather indices

    # ---- metadata ----------------------------------------------------------------------------
    def prepare_metadata(self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                         block_size: int, device, causal: bool = True,
                         kv_starts: list[int] | None = None) -> dict[str, torch.Tensor | bool]:
        """This backend's fields of a step's AttentionMetadata, from the host lists (none here)."""
        return {}

    # ---- K/V write ---------------------------------------------------------------------------
    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store K/V [T, KH, D] at slot_mapping (negative: not written)."""
        raise NotImplementedError

    def rotary_write_kv(self, rotary, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Rotate q and k to `positions` with `rotary` (models/layers/rotary.py) and write k, v into
        the cache; returns the rotated q."""
        q, k = rotary(positions, q, k)
        self.write_kv(kv_cache, k, v, slot_mapping)
        return q

    # ---- attention ---------------------------------------------------------------------------
    def l2_prefetch_bytes(self, num_tokens: int, meta: AttentionMetadata) -> int:
        """Bytes of the next MLP weight this step's attention launch asks L2 for (0: none)."""
        return 0

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                prefetch: Regions | None = None, window: int = 0) -> torch.Tensor:
        """Paged attention, q [T, H, D] -> [T, H, D]: query i of a sequence with q_len queries sees
        context positions [0, seq_len - q_len + i] (meta.causal False: all of [0, seq_len)), keys
        below meta.kv_start[b] are invisible, and a query with no visible key gets zeros. window > 0
        (a layer's sliding window, a per-layer constant): a query at position p also loses the keys at
        positions <= p - window. prefetch: weight regions the launch may ask L2 for (a hint; backends
        may ignore it)."""
        raise NotImplementedError

    # ---- CUDA graphs -------------------------------------------------------------------------
    def prepare_for_capture(self, meta: AttentionMetadata) -> None:
        """Before a CUDA graph is captured over `meta` (the graph's static metadata)."""
        if not self.supports_graphs:
            raise ValueError(f"the {self.name} attention backend cannot be captured in a CUDA graph")

    def prepare_for_replay(self, meta: AttentionMetadata) -> None:
        """Before a replay whose step is `meta` (already staged into the graph's static buffers)."""
