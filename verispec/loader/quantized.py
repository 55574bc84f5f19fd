"""Load a GGUF model with its weights kept quantized (quantization="gguf"): the linear layers and the
embedding become models/layers/quant.py modules, everything else (norms, biases, float tensors) a
state dict for build_model.

CPU: int4 planes for the 32-element group types (Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K), bf16 for the
others (Q6_K, Q3_K, Q2_K), run by torch's CPU int4 matmul (loader/cpu_pack.py). CUDA: the raw blocks
as h3's kernels.gguf_matmul.GGUFWeight, multiplied by its gguf_linear (imported here, lazily: a CPU
load never imports it, nor triton). Nothing is cached on disk: packing reads the file directly.
"""

from __future__ import annotations

import functools
import logging
import os
from collections import Counter
from collections.abc import Callable

import torch

from verispec.config import ModelConfig
from verispec.core import envs
from verispec.loader import cpu_pack
from verispec.loader.dequant import SUPPORTED_TYPES, dequantize, type_name
from verispec.loader.gguf import GGUFError, GGUFFile, model_config_from_metadata
from verispec.loader.weights import _check_complete, hf_name, unpermute_rope
from verispec.models.layers.quant import DenseSegment, GGUFSegment, QuantLinear, Segment

log = logging.getLogger("verispec")

# Our fused module -> the GGUF tensors stacked into it (per layer), in order.
_LAYER_LINEARS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}
_FLOAT_TYPES = frozenset({0, 1, 30})  # F32, F16, BF16: kept dense in the model's dtype
Part = tuple[torch.Tensor, int, tuple[int, int]]  # raw bytes, ggml type, (N, K)


def _gguf_kernels() -> tuple[type, Callable[..., torch.Tensor]]:
    """(GGUFWeight, gguf_linear) from verispec/kernels/gguf_matmul.py, or a clear error without it."""
    try:
        from verispec.kernels.gguf_matmul import GGUFWeight, gguf_linear
    except ModuleNotFoundError as e:
        if e.name not in ("verispec.kernels.gguf_matmul", "triton"):
            raise
        raise ValueError(
            "quantization='gguf' on CUDA needs the GGUF kernels (verispec/kernels/gguf_matmul.py and triton), "
            f"which this install lacks ({e.name} is missing); use quantization='none'"
        ) from None
    return GGUFWeight, gguf_linear


def _cuda_segments(parts: list[Part], device: torch.device, dtype: torch.dtype, held: Counter,
                   kernels: tuple[type, Callable[..., torch.Tensor]] | None = None) -> list[Segment]:
    """GGUF blocks for the kernels; runs of one type stacked into one GGUFWeight; types without a kernel
    dequantized to `dtype`. kernels: (GGUFWeight, gguf_linear) (None: kernels/gguf_matmul.py's)."""
    GGUFWeight, gguf_linear = kernels or _gguf_kernels()
    segs: list[Segment] = []
    run: list[Part] = []

    def flush() -> None:
        if run:
            n = sum(p[2][0] for p in run)
            blocks = torch.cat([p[0].reshape(p[2][0], -1) for p in run]).to(device).contiguous()
            segs.append(GGUFSegment(GGUFWeight(blocks, run[0][1], (n, run[0][2][1])), gguf_linear,
                                    epilogues=kernels is None))
            run.clear()

    for raw, t, shape in parts:
        try:
            GGUFWeight(raw.reshape(shape[0], -1)[:1].contiguous(), t, (1, shape[1]))
            ok = True
        except ValueError:
            ok = False
        if ok and (not run or run[-1][1] == t):
            run.append((raw, t, shape))
            held[f"{type_name(t)}: GGUF blocks"] += 1
            continue
        flush()
        if ok:
            run.append((raw, t, shape))
            held[f"{type_name(t)}: GGUF blocks"] += 1
        else:
            segs.append(DenseSegment(dequantize(raw, t, shape, device=device, dtype=dtype)))
            held[f"{type_name(t)}: {str(dtype).removeprefix('torch.')}"] += 1
    flush()
    return segs


def _permuted(f: GGUFFile, cfg: ModelConfig, name: str) -> Part:
    """A tensor's (raw, type, shape); llama's q/k rows put back in Hugging Face's order (rows of blocks)."""
    info = f.tensors[name]
    shape = (int(info.shape[0]), int(info.shape[1]))
    raw = f.raw(name)
    if cfg.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = cfg.num_heads if "attn_q" in name else cfg.num_kv_heads
        raw = unpermute_rope(raw.reshape(shape[0], -1), heads).contiguous().reshape(-1)
    return raw, info.ggml_type, shape


def _linear(f: GGUFFile, cfg: ModelConfig, names: list[str], bias: torch.Tensor | None, device: torch.device,
            dtype: torch.dtype, held: Counter) -> QuantLinear | None:
    """The QuantLinear of GGUF tensors stacked along N (None when all are float tensors: those stay an
    nn.Linear)."""
    parts = [_permuted(f, cfg, n) for n in names]
    if all(t in _FLOAT_TYPES for _, t, _ in parts):
        return None
    if device.type == "cuda":
        return QuantLinear(_cuda_segments(parts, device, dtype, held), bias, dtype)
    segs = _cpu_segments(parts, held)
    pure = all(isinstance(s, GGUFSegment) for s in segs)  # the C kernel takes float32 activations
    q = QuantLinear(segs, bias, torch.float32 if pure else cpu_pack.COMPUTE_DTYPE)
    if pure and envs.cpu_ops():  # one kernel call per segment into one output (decode is op-bound)
        from verispec.kernels import cpu_gguf

        int8 = _cpu_int8_types()
        q.cpu_linear = cpu_gguf.StackedLinear([s.weight for s in segs], [s.weight.qtype in int8 for s in segs])
    return q


def _cpu_int8_types() -> frozenset[int]:
    """The types whose CPU GEMV takes the integer dot (none where VERISPEC_CPU_GGUF_INT8=0 or it is not built)."""
    from verispec.kernels import cpu_gguf

    return cpu_gguf.INT8_TYPES if envs.cpu_gguf_int8() and cpu_gguf.int8_available() else frozenset()


def _cpu_segments(parts: list[Part], held: Counter) -> list[Segment]:
    """CPU segments: runs of the types kernels/cpu_gguf.py runs (Q8_0, Q5_0, Q4_0, Q6_K; Q4_K where its integer
    dot is on) as their GGUF blocks when its vectorized (AVX-512 or AVX2) kernel is available, the rest as
    cpu_pack packs them (int4 planes, bf16)."""
    from verispec.kernels import cpu_gguf

    fast = cpu_gguf.fast()
    int8_types = _cpu_int8_types()
    int8_linear = functools.partial(cpu_gguf.linear, int8=True)
    segs: list[Segment] = []
    run: list[Part] = []

    def flush(gguf: bool) -> None:
        if not run:
            return
        if gguf:
            n = sum(p[2][0] for p in run)
            blocks = torch.cat([p[0].reshape(p[2][0], -1) for p in run]).contiguous()
            segs.append(GGUFSegment(cpu_gguf.CPUBlocks(blocks, run[0][1], (n, run[0][2][1])),
                                    int8_linear if run[0][1] in int8_types else cpu_gguf.linear))
        else:
            segs.extend(cpu_pack.pack_tensors(list(run)))
        run.clear()

    # Q4_K runs as blocks only through the integer dot (its float GEMV is slower than the int4 planes)
    block_types = cpu_gguf.GEMV_TYPES | int8_types
    kind_of = lambda t: "gguf" if fast and t in block_types else "pack"  # noqa: E731
    for raw, t, shape in parts:
        kind = kind_of(t)
        if run and (kind != kind_of(run[-1][1]) or (kind == "gguf" and t != run[-1][1])):
            flush(kind_of(run[-1][1]) == "gguf")
        run.append((raw, t, shape))
        what = "GGUF blocks (CPU kernel)"
        if t in int8_types:
            what = "GGUF blocks (CPU kernel, int8 x)"
        held[f"{type_name(t)}: {what}" if kind == "gguf" else cpu_pack.describe(t)] += 1
    flush(bool(run) and kind_of(run[-1][1]) == "gguf")
    return segs


def load_gguf_quantized(
    path: str | os.PathLike[str], *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, torch.nn.Module]]:
    """(config, dense state dict, quantized modules by module path) of a GGUF file; build_model(...,
    modules=) binds both. Tensors of an unsupported type raise GGUFError naming them."""
    device = torch.device(device)
    f = GGUFFile(path)
    cfg = model_config_from_metadata(f.metadata, tensor_names=f.tensors.keys(), source=f.path)
    for n, info in f.tensors.items():
        if hf_name(n, cfg.arch) is not None and info.ggml_type not in SUPPORTED_TYPES:
            raise GGUFError(f"{f.path}: tensor {n!r} has ggml type {type_name(info.ggml_type)}, which verispec "
                            "cannot run")
    held: Counter = Counter()
    modules: dict[str, torch.nn.Module] = {}
    dense: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for i in range(cfg.num_layers):
        for ours, gguf_parts in _LAYER_LINEARS.items():
            names = [f"blk.{i}.{p}.weight" for p in gguf_parts]
            if not all(n in f.tensors for n in names):
                continue  # _check_complete names what is missing
            bias_names = [f"blk.{i}.{p}.bias" for p in gguf_parts]
            bias = None
            if all(b in f.tensors for b in bias_names):
                bias = torch.cat([_dense(f, cfg, b, device, dtype) for b in bias_names])
            q = _linear(f, cfg, names, bias, device, dtype, held)
            if q is not None:
                modules[f"model.layers.{i}.{ours}"] = q
                used.update(names + (bias_names if bias is not None else []))
    embd = f.tensors["token_embd.weight"] if "token_embd.weight" in f.tensors else None
    head = "output.weight" if "output.weight" in f.tensors else "token_embd.weight"
    if embd is not None:
        shape = (int(embd.shape[0]), int(embd.shape[1]))
        e = cpu_pack.quant_embedding(f.raw("token_embd.weight"), embd.ggml_type, shape, dtype)
        if e is not None:
            modules["model.embed_tokens"] = e.to(device)
            used.add("token_embd.weight")
    if head in f.tensors:
        q = _linear(f, cfg, [head], None, device, dtype, held)
        if q is not None:
            modules["lm_head"] = q
            used.add(head)
    for n in f.tensors:
        h = hf_name(n, cfg.arch)
        if h is not None and n not in used:
            dense[h] = _dense(f, cfg, n, device, dtype)
    claimed = {hf_name(n, cfg.arch): torch.empty(0) for n in used}
    _check_complete({**dense, **claimed}, cfg, f.path)  # type: ignore[dict-item]
    log.info("%s: weights kept quantized (%s)", os.path.basename(f.path),
             ", ".join(f"{k} x{v}" for k, v in sorted(held.items())))
    return cfg, dense, modules


def _dense(f: GGUFFile, cfg: ModelConfig, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A tensor dequantized to `dtype` (norms, biases, float weights), llama's q/k rows unpermuted."""
    info = f.tensors[name]
    w = dequantize(f.raw(name), info.ggml_type, info.shape, device=device, dtype=dtype)
    if cfg.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
        w = unpermute_rope(w, cfg.num_heads if "attn_q" in name else cfg.num_kv_heads).contiguous()
    return w
