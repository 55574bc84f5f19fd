"""Switch a model between its plain-torch path and the Triton kernels (CUDA tensors only).

The model code never imports a kernel module (nor triton): enable_triton builds a Kernels object,
which imports them, and hands it to every module that calls kernels, together with the Triton
attention backend; both carry one KernelOptions (core/options.py).
"""

from __future__ import annotations

import dataclasses

import torch

from verispec.core.options import DEFAULT_OPTIONS, KernelOptions


class Kernels:
    """The kernel entry points a switched-on model calls for CUDA tensors, and the options every call
    passes (options=self.options). One per enable_triton call, shared by the model's modules."""

    def __init__(self, options: KernelOptions = DEFAULT_OPTIONS) -> None:
        from verispec.kernels import fused, linear, qkv_rope, small_m, small_m_qkv

        self.options = options
        self.linear, self.gemv, self.gate_up_silu = linear.linear, linear.gemv, linear.gate_up_silu
        self.gemv_max_rows = options.gemv_max_rows  # steps of at most this many rows: the one-row path
        # Steps of 2..small_m_max_rows rows (above gemv_max_rows): the same fused layer path on the
        # small-M tensor-core kernels.
        self.small_m_max_rows = options.small_m_max_rows
        if self.small_m_max_rows >= 2:  # o, down, LM head too (takes_small_m)
            self.linear, self.gate_up_silu = small_m.linear, small_m.gate_up_silu
        self.fused_qkv_max_rows = options.fused_qkv_max_rows  # 2..this many rows: the fused qkv kernel only
        self.small_m_linear = small_m.small_m_linear
        self.small_m_qkv_rope_write_kv = small_m_qkv.small_m_qkv_rope_write_kv
        self.small_m_head_dim = 2 * small_m_qkv.ROPE_PAIRS  # its qkv kernel takes head dims divisible by this
        if options.batch_invariant:  # one kernel config per weight for every row count, no one-row path
            from verispec.kernels import invariant

            self.linear, self.gate_up_silu = invariant.linear, invariant.gate_up_silu
            self.gemv_max_rows = self.small_m_max_rows = self.fused_qkv_max_rows = 0
        self.rms_norm = fused.rms_norm
        self.qkv_rope_write_kv = qkv_rope.qkv_rope_write_kv


def enable_triton(model: torch.nn.Module, on: bool = True, attention: bool = True,
                  options: KernelOptions | None = None) -> None:
    """Switch a CausalLM's linear layers, norms, SiLU-mul and (attention=True) its attention backend
    (attention, rotary + K/V write, L2 prefetch) to the Triton kernels, run with `options` (None:
    the defaults). The switched modules still use torch for CPU tensors. on=False restores the
    torch path and the reference backend."""
    from verispec.attention.reference import ReferenceBackend

    options = options or DEFAULT_OPTIONS
    kernels = Kernels(options) if on else None
    for m in model.modules():
        if hasattr(m, "kernels"):
            m.kernels = kernels
    if attention:
        if on:
            from verispec.attention.triton import TritonBackend

            model.attn_backend = TritonBackend(options)
        else:
            model.attn_backend = ReferenceBackend()


def enable_cpu_ops(model: torch.nn.Module) -> None:
    """Switch a quantized CPU model's norms and attention (rotary, K/V write, paged attention) onto the C ops of
    kernels/cpu_ops.py (attention/cpu.py's backend); a no-op where the C library is not available. The float32
    reference model is never switched (its tests compare against plain torch)."""
    from verispec.kernels import cpu_ops

    if not cpu_ops.available():
        return
    from verispec.attention.cpu import CPUBackend

    for m in model.modules():
        if hasattr(m, "cpu_ops"):  # the modules that take them (models/layers/norm.RMSNorm)
            m.cpu_ops = cpu_ops
    model.attn_backend = CPUBackend()


def use_batch_invariant(model: torch.nn.Module, on: bool) -> None:
    """Switch a CUDA model onto the Triton kernels with KernelOptions.batch_invariant = on, keeping the
    other options it already runs with (an A/B script's); nothing changes when it already runs so."""
    current = options_of(model)
    if not kernels_on(model) or current.batch_invariant != on:
        enable_triton(model, options=dataclasses.replace(current, batch_invariant=on))


def options_of(model: torch.nn.Module) -> KernelOptions:
    """The options a model's kernels run with (the defaults when it is on the torch path)."""
    kernels = getattr(model, "kernels", None)
    return kernels.options if kernels is not None else DEFAULT_OPTIONS


def kernels_on(model: torch.nn.Module) -> bool:
    """True when enable_triton switched the model on (and nothing switched it off since)."""
    return getattr(model, "kernels", None) is not None
