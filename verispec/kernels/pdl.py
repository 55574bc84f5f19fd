"""Programmatic dependent launch (PDL): a kernel starts while the one before it finishes.

On Hopper and newer, a kernel launched with `launch_pdl=True` may begin as soon as every program of
the previous kernel has called `griddepcontrol.launch_dependents` (or exited). Before it touches
anything the previous kernel may read or write, it must execute `griddepcontrol.wait`, which
returns once the previous kernel has completed and its writes are visible. In a CUDA graph this
overlaps one kernel's launch and prologue with the tail of the one before: at batch-1 decode a
step is ~280 short kernels, so the gaps are a large share of it.

A kernel may overlap only the kernel launched right before it (that one has passed its own wait,
so everything earlier is complete). The contract every kernel launched through `launch_kwargs`
follows:
  * before `wait_prior(PDL)` it writes nothing, and reads only what the previous kernel cannot be
    writing: constants (weights, biases, norm weights); in kernels/qkv_rope.py, the step's
    positions and slots (in the model the kernel before it is the embedding, the previous layer's
    down projection or an RMSNorm, none of which writes them); in kernels/paged_attention.py, the
    attention metadata (query_start_loc, seq_lens, kv_start, block_tables: every caller runs the
    K/V-cache write or q's projection right before attention). Never an activation, the KV cache
    or a scratch buffer. (A test must not create a weight with a kernel and pass it straight
    to one of these kernels: make it on the CPU, or with a copy.)
  * `wait_prior(PDL)` waits for the previous kernel, then lets the next kernel launch.
Kernels from torch or cuBLAS are launched without PDL and wait for everything before them as usual.
KernelOptions(pdl=False) turns it off (for an A/B measurement or a suspected race): every kernel
entry point passes its options' `pdl` to launch_kwargs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SM90: dict[int, bool] = {}
_ON, _NO = {"PDL": True, "launch_pdl": True}, {"PDL": False}  # never mutated (callers unpack them)


def hopper_or_newer(device: torch.device) -> bool:
    """True for a CUDA device of compute capability >= 9.0 (cached per device index)."""
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM90:
        _SM90[idx] = torch.cuda.get_device_capability(idx) >= (9, 0)
    return _SM90[idx]


def pdl_enabled(device: torch.device, pdl: bool = True) -> bool:
    """True where kernels on `device` are launched with PDL: `pdl` (KernelOptions.pdl) on a CUDA
    device of compute capability >= 9.0."""
    return pdl and hopper_or_newer(device)


def launch_kwargs(device: torch.device, pdl: bool = True) -> dict:
    """Keyword arguments for a Triton launch: the kernel's PDL constexpr and the launch flag
    (`pdl`: KernelOptions.pdl of the caller)."""
    return _ON if pdl and hopper_or_newer(device) else _NO


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """Wait for the previous kernel (its writes become visible), then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
