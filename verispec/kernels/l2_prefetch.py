"""Weights pulled into L2 while the GPU waits on latency: a hint issued from spare programs.

At batch-1 decode a layer's attention (and its split-K combine) moves a few hundred KB: for ~6 us
per layer the HBM sits almost idle, then the MLP's gate_up projection streams 55 MB (1.5B). The
attention launch can carry a few extra programs that ask the memory system to bring the first
part of that weight into L2 (`cp.async.bulk.prefetch.L2`, Hopper's bulk prefetch: no registers,
nothing the program waits on; the programs issue it and exit). The GEMV that follows then finds that
part in L2. A prefetch is only a hint: it reads constants (weights), writes nothing, and a line
evicted before use is simply read again from HBM, so results are unchanged whatever it does.

The regions are (address, bytes) pairs of host ints (a weight's data_ptr never changes, so they
are safe to bake into a CUDA graph). How much of the next MLP weight is asked for, and in which
steps, is the Triton attention backend's option (KernelOptions.l2_prefetch_*; attention/triton.py).
A launch whose programs prefetch seems to complete only once the prefetch has landed, so the
prefetch must fit in the time its host kernel takes anyway: attention, launched early (PDL) and
bound by latency, is that host. The measurements behind the defaults and the placements that lost
are in docs/BENCHMARKS.md ("Session 7"; "Moved from docstrings (0.2 layout)").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from verispec.core import envs
from verispec.kernels.pdl import hopper_or_newer

_INTERPRET = envs.triton_interpret()  # read when triton is: at import

Regions = tuple[int, int, int, int]  # (address 0, bytes 0, address 1, bytes 1)


def prefetch_supported(device: torch.device) -> bool:
    """True on a compiled (not interpreted) CUDA device of compute capability >= 9.0."""
    return not _INTERPRET and hopper_or_newer(device)


def stacked_head(weight: torch.Tensor, nbytes: int) -> Regions | None:
    """The regions a GEMV over a [gate; up] stacked weight reads first: the leading rows of both
    halves (its program i reads gate row i and up row i), nbytes in all (rounded down to 256-byte
    units); None for nbytes <= 0 or a weight that is not a contiguous CUDA tensor."""
    if nbytes <= 0 or not weight.is_cuda or not weight.is_contiguous():
        return None
    half = weight.numel() * weight.element_size() // 2
    each = min(half, nbytes // 2) // 256 * 256
    if each <= 0:
        return None
    base = weight.data_ptr()
    return (base, each, base + half, each)


@triton.jit
def _prefetch(addr, nbytes, t, threads, CHUNK_ALIGN: tl.constexpr):
    """Thread t of `threads` asks for its share of [addr, addr + nbytes) (16-byte units)."""
    share = tl.cdiv(tl.cdiv(nbytes, threads), CHUNK_ALIGN) * CHUNK_ALIGN
    off = t.to(tl.int64) * share
    size = tl.minimum(tl.maximum(nbytes - off, 0), share).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr + off, size], dtype=tl.int32, is_pure=False, pack=1,
    )


@triton.jit
def prefetch_regions(a0, n0, a1, n1, prog, num_progs, THREADS: tl.constexpr):
    """Program `prog` of `num_progs` (each THREADS wide: one element per thread) issues its share of
    both regions. Call only where prefetch_supported() (the interpreter has no inline PTX)."""
    t = prog * THREADS + tl.arange(0, THREADS)
    total = num_progs * THREADS
    _prefetch(a0, n0, t, total, 256)
    _prefetch(a1, n1, t, total, 256)
