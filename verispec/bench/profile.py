"""`verispec bench profile`: where a decode (or verify) step's GPU time goes, kernel by kernel.

Builds the model's step for `batch` sequences of `query_len` new tokens at context `context`, runs
it eagerly under torch.profiler (the kernels are the ones a CUDA graph replays) and groups the
kernel time per step by category (linear layers, attention, norms, rotary + KV write, SiLU-and-mul,
LM head, copies, other). Then times the CUDA-graph replay of the same step; the gap between the
replay time and the kernels' sum is launch and inter-kernel idle time. `--no-pdl` runs the kernels
with KernelOptions(pdl=False): isolated kernel times.
"""

from __future__ import annotations

import random
from collections import defaultdict

import torch

from verispec.bench.hardware import HBM_BYTES_PER_S, kv_bytes_per_token, weight_bytes_per_step
from verispec.core.options import KernelOptions
from verispec.models.qwen2 import CausalLM

CATEGORIES = (  # (category, substrings of the kernel name), first match wins
    ("attention", ("_attn_kernel", "_combine_kernel", "_combine_ordered_kernel")),
    ("linear (Triton GEMV)", ("_gemv_kernel", "_gemv1_kernel")),
    ("linear (skinny Triton)", ("_skinny_kernel",)),
    ("linear (small-M Triton)", ("_small_m_kernel", "_small_m_qkv")),
    ("linear (GGUF GEMV)", ("_kquant_i8_kernel",)),
    ("linear (GGUF tensor-core)", ("_mma_sb_kernel", "_mma_kernel")),
    ("GGUF dequant (dense route)", ("_dequant_kernel",)),
    ("split-K reduce", ("_splitk_reduce_kernel",)),
    ("linear (split-K Triton)", ("_splitk_kernel",)),
    ("linear (cuBLAS)", ("gemm", "gemv", "cutlass", "sm90_", "nvjet", "splitk", "splitK")),
    ("rms norm", ("_rms_norm",)),
    ("rotary + KV write", ("_rotary", "_write_kv")),
    ("silu-and-mul", ("_silu_mul",)),
    ("copies", ("memcpy", "Memcpy", "copy", "fill", "Memset")),
)


def category(name: str) -> str:
    for cat, keys in CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "other"


def _step_inputs(model: CausalLM, batch: int, query_len: int, context: int, block_size: int, device):
    from verispec.worker.inputs import SeqChunk, allocate_kv_cache, build_batch

    cfg = model.config
    per_seq = -(-(context + query_len) // block_size)
    kv = allocate_kv_cache(cfg.num_layers, batch * per_seq + 1, block_size, cfg.num_kv_heads, cfg.head_dim,
                           model.model.norm.weight.dtype, device)
    rng = random.Random(0)
    chunks = [SeqChunk([rng.randrange(cfg.vocab_size) for _ in range(query_len)], context,
                       list(range(i * per_seq, (i + 1) * per_seq))) for i in range(batch)]
    ids, pos, meta = build_batch(chunks, block_size, device, with_reference=False)
    return kv, ids, pos, meta


def run_profile(model: CausalLM, batch: int, query_len: int, context: int, iters: int = 5,
                block_size: int = 16, options: KernelOptions | None = None) -> dict:
    """Kernel-time breakdown per step (eager, profiled) and the graph replay's time for the same step,
    the model's kernels run with `options` (None: the defaults)."""
    from torch.profiler import ProfilerActivity, profile

    from verispec.kernels.pdl import pdl_enabled
    from verispec.models.kernel_path import enable_triton, options_of
    from verispec.worker.graphs import CudaGraphRunner

    device = model.model.norm.weight.device
    enable_triton(model, options=options)
    kv, ids, pos, meta = _step_inputs(model, batch, query_len, context, block_size, device)

    @torch.inference_mode()
    def step():
        hidden, _ = model(ids, pos, meta, kv)
        return model.compute_logits(hidden)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = per_kernel[ev.name]
            k[0] += 1
            k[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    kernels = sorted(((n, c / iters, us / iters) for n, (c, us) in per_kernel.items()), key=lambda r: -r[2])
    cats: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, count, us in kernels:
        c = cats[category(name)]
        c[0] += count
        c[1] += us
    kernel_us = sum(us for _, _, us in kernels)

    graphs = CudaGraphRunner(model, kv, max_batch=batch, query_lens=(query_len,), block_size=block_size,
                             max_blocks_per_seq=meta.block_tables.shape[1], with_logits=True, progress=False)
    n = batch

    def replay():
        graphs.run(ids, pos, meta, n, query_len)

    for _ in range(5):
        replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 100
    a.record()
    for _ in range(reps):
        replay()
    b.record()
    torch.cuda.synchronize()
    graph_us = a.elapsed_time(b) * 1e3 / reps
    cfg = model.config
    elem = model.model.norm.weight.element_size()
    step_bytes = weight_bytes_per_step(cfg, elem) + batch * (context + query_len) * kv_bytes_per_token(cfg, elem)
    return {
        "batch": batch, "query_len": query_len, "context": context,
        "kernels": [dict(name=n_, per_step=c, us=us) for n_, c, us in kernels],
        "categories": [dict(category=k, kernels=c, us=us) for k, (c, us) in sorted(cats.items(), key=lambda x: -x[1][1])],
        "kernel_us": kernel_us, "graph_us": graph_us, "bytes_per_step": step_bytes,
        "ideal_us": step_bytes / HBM_BYTES_PER_S * 1e6, "pdl": pdl_enabled(device, options_of(model).pdl),
    }


PDL_NOTE = ("(programmatic dependent launch is on: a kernel's time includes its wait for the one before, so the "
            "rows overlap; --no-pdl gives isolated kernel times, the replay time is the step's)")


def format_profile(res: dict, top: int = 25) -> str:
    lines = [f"step: batch {res['batch']} x query {res['query_len']} at context {res['context']}",
             f"kernels per step: {sum(c['kernels'] for c in res['categories']):.0f}, kernel time {res['kernel_us']:.0f} us; "
             f"CUDA-graph replay {res['graph_us']:.0f} us; bytes/step at 4.3 TB/s {res['ideal_us']:.0f} us "
             f"({100 * res['ideal_us'] / res['graph_us']:.0f}% of the hardware limit)",
             *([PDL_NOTE] if res.get("pdl") else []),
             "", f"{'category':<24} {'kernels':>8} {'us/step':>9} {'share':>6}"]
    for c in res["categories"]:
        lines.append(f"{c['category']:<24} {c['kernels']:>8.0f} {c['us']:>9.1f} {100 * c['us'] / res['kernel_us']:>5.1f}%")
    lines += ["", f"{'kernel':<70} {'n/step':>6} {'us/step':>9}"]
    for k in res["kernels"][:top]:
        lines.append(f"{k['name'][:70]:<70} {k['per_step']:>6.0f} {k['us']:>9.1f}")
    return "\n".join(lines)
