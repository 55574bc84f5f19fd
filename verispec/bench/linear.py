"""`verispec bench linear`: the model's linear layers, our path against torch.nn.functional.linear, in GB/s.

For each of the model's weight shapes (fused qkv, o, fused gate_up with SiLU-and-mul, down, lm_head)
and each row count M, times torch (F.linear, plus the separate SiLU-and-mul kernel for gate_up) and
verispec's path (verispec.kernels.linear: the weight-resident GEMV for M <= KernelOptions.gemv_max_rows, the skinny
Triton kernel up to SKINNY_MAX_ROWS where it wins, the split-K kernel for KernelOptions.splitk_min_rows..splitk_max_rows rows, else torch);
up to SKINNY_MAX_ROWS rows also the GEMV, and from 2 rows up the split-K kernel with splitk_config's tiles, whatever the dispatch. Each timed call reads a different copy of the weight (copies totalling > 4x the L2 cache),
so the figures are HBM bandwidth, not cache bandwidth; the calls are replayed from a CUDA graph, as
in the engine, so they are GPU time without Python launch overhead. --sweep also tries a grid of tile sizes for
the skinny kernel, the GEMV (up to SKINNY_MAX_ROWS rows) and (from 2 rows up) the split-K kernel and prints the best of each per
shape (how their tables were chosen).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
import triton

from verispec.bench.hardware import HBM_BYTES_PER_S
from verispec.config import ModelConfig

L2_BYTES = 50 << 20  # H200: 50 MiB


def model_shapes(cfg: ModelConfig) -> list[tuple[str, int, int, bool]]:
    """(name, N, K, silu_mul) of every distinct linear layer of a decoder step."""
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return [("qkv_proj", q + 2 * kv, h, False), ("o_proj", h, q, False), ("gate_up_proj+silu", 2 * inter, h, True),
            ("down_proj", h, inter, False), ("lm_head", cfg.vocab_size, h, False)]


def _time(fn, weights: list[torch.Tensor], iters: int) -> float:
    """Mean GPU seconds per call: `iters` calls (cycling through the weight copies) captured in one
    CUDA graph and replayed, so Python launch overhead is not measured."""
    for w in weights[:2]:
        fn(w)  # compile / pick kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            fn(weights[i % len(weights)])
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(3):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    del graph
    return a.elapsed_time(b) / 1e3 / (3 * iters)


def _sweep_configs(m: int) -> list[dict]:
    if m == 1:
        grid = itertools.product([1], [2, 4, 8, 16], [256, 512, 1024], [4, 8], [3, 4], [False])
    elif m <= 4:
        grid = itertools.product([triton.next_power_of_2(m)], [4, 8, 16], [128, 256, 512], [4], [3], [False])
    elif m <= 16:
        grid = itertools.product([16], [16, 32, 64], [64, 128, 256], [4], [3, 4], [True])
    else:  # batched decode (no split-K in the kernel: only wide layers have enough column blocks)
        grid = itertools.product([min(64, triton.next_power_of_2(m))], [32, 64], [64, 128], [4, 8], [4], [True])
    return [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s, USE_DOT=d)
            for bm, bn, bk, w, s, d in grid]


def _splitk_configs(m: int, n_out: int, k: int, silu: bool) -> list[dict]:
    """The split-K kernel's sweep, pruned to ~100-170 compiles per M for the 1.5B's four shapes (qkv and o
    share theirs; ~0.4 s each to compile for sm_90 on a 2-core CPU, so about a minute per M on the first
    run, then Triton's cache):
    BLOCK_M the power of two >= m (16..64), and half that (3 stages, 4 warps) where it splits the rows
    into two full tiles; each split >= 2 BLOCK_K iterations (duplicates of the rounding of KS dropped);
    100..800 programs (0.75..6 waves on 132 SMs); shared memory of the stages <= 200 KiB; 8 warps only
    for 64 x 128 tiles; 4-5 stages only where the split has the iterations to fill them, 5 only with
    BLOCK_K and BLOCK_N <= 64. splitk_config's choice is always in the grid."""
    from verispec.kernels.linear import splitk_split

    bm0 = min(64, max(16, triton.next_power_of_2(m)))
    bms = [bm0] + ([bm0 // 2] if bm0 >= 32 and m <= bm0 and m % (bm0 // 2) == 0 else [])
    seen, out = set(), []
    for bm, bn, bk, sk, w, st in itertools.product(bms, [32, 64, 128], [64, 128, 256], [1, 2, 4, 8, 16], [4, 8],
                                                   [3, 4, 5]):
        ks, splits = splitk_split(k, bk, sk)
        iters = ks // bk
        programs = triton.cdiv(m, bm) * triton.cdiv(n_out, bn) * splits
        key = (bm, bn, bk, ks, w, st)
        if ((sk > 1 and iters < 2) or not 100 <= programs <= 800 or key in seen
                or st * (bm + bn * (2 if silu else 1)) * bk * 2 > 200 << 10
                or (st > 3 and st > iters + 1) or (st == 5 and (bk > 64 or bn > 64))
                or (w == 8 and bm * bn < 64 * 128) or (bm < bm0 and (st > 3 or w > 4))):
            continue
        seen.add(key)
        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=w, num_stages=st))
    return out


def _small_m_configs(k: int) -> list[dict]:
    """The small-M kernel's sweep (kernels/small_m.py): column tiles 16..64, K tiles 128..512 (no
    wider than K), split K 1, 2 or 4 (each split >= 2 tiles), 3 or 4 stages: <= 54 compiles per shape."""
    out = []
    for bn, bk, sk, st in itertools.product([16, 32, 64], [128, 256, 512], [1, 2, 4], [3, 4]):
        if bk <= max(128, triton.next_power_of_2(k)) and (sk == 1 or k >= 2 * sk * bk):
            out.append(dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=4, num_stages=st))
    return out


def _gemv_configs() -> list[dict]:
    return [dict(BLOCK_N=bn, num_warps=w) for bn, w in itertools.product([1, 2, 4], [2, 4, 8, 16])]


def _best(kernel, configs: list[dict], x: torch.Tensor, silu: bool, weights: list[torch.Tensor],
          iters: int) -> tuple[float, dict] | None:
    """The fastest (seconds, config) of `kernel` over `configs` (configs that fail to compile skipped)."""
    best = None
    for c in configs:
        try:
            t = _time(lambda w, c=c: kernel(x, w, silu_mul=silu, config=c), weights, iters)
        except Exception:  # noqa: BLE001 - a tile that does not compile (out of resources)
            continue
        if best is None or t < best[0]:
            best = (t, c)
    return best


def run_linear(cfg: ModelConfig, rows: list[int], device: torch.device, dtype: torch.dtype, sweep: bool,
               iters: int = 100) -> list[dict]:
    """One result row per (shape, M): torch and verispec seconds and GB/s (and the best swept config)."""
    from verispec.kernels import linear as lin
    from verispec.kernels import small_m as sm
    from verispec.kernels.fused import silu_and_mul

    out = []
    for name, n, k, silu in model_shapes(cfg):
        wbytes = n * k * torch.tensor([], dtype=dtype).element_size()
        copies = max(2, math.ceil(4 * L2_BYTES / wbytes))
        weights = [torch.randn(n, k, device=device, dtype=dtype) * k**-0.5 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=dtype)

            def torch_fn(w, x=x, n=n, silu=silu):
                y = F.linear(x, w)
                return silu_and_mul(y[:, : n // 2], y[:, n // 2 :]) if silu else y

            def ours(w, x=x, silu=silu):
                return lin.gate_up_silu(x, w) if silu else lin.linear(x, w)

            t_torch, t_ours = _time(torch_fn, weights, iters), _time(ours, weights, iters)
            row = dict(layer=name, m=m, n=n, k=k, weight_mb=wbytes / 1e6, torch_us=t_torch * 1e6, ours_us=t_ours * 1e6,
                       torch_gbs=wbytes / t_torch / 1e9, ours_gbs=wbytes / t_ours / 1e9,
                       ours_hw=wbytes / t_ours / HBM_BYTES_PER_S, speedup=t_torch / t_ours)
            n_out = n // 2 if silu else n
            splitk = lin.splitk_config(m, n_out, k, silu) if m >= 2 else None
            if m <= lin.SKINNY_MAX_ROWS:  # the GEMV at every row count a batch-1 verify can have
                t = _time(lambda w, x=x, silu=silu: lin.gemv(x, w, silu_mul=silu), weights, iters)
                row.update(gemv_us=t * 1e6, gemv_gbs=wbytes / t / 1e9)
            if 2 <= m <= sm.SMALL_M_MAX_ROWS:  # the tensor-core kernel of KernelOptions.small_m_max_rows
                t = _time(lambda w, x=x, silu=silu: sm.small_m_linear(x, w, silu_mul=silu), weights, iters)
                row.update(small_m_us=t * 1e6, small_m_gbs=wbytes / t / 1e9)
            if splitk:
                t = _time(lambda w, x=x, silu=silu, c=splitk: lin.splitk_linear(x, w, silu_mul=silu, config=c),
                          weights, iters)
                row.update(splitk_us=t * 1e6, splitk_gbs=wbytes / t / 1e9, splitk_config=splitk)
            if sweep:
                families = [("best", lin.skinny_linear, _sweep_configs(m))]
                if m <= lin.SKINNY_MAX_ROWS:
                    families.append(("gemv_best", lin.gemv, _gemv_configs()))
                if splitk:
                    families.append(("splitk_best", lin.splitk_linear, _splitk_configs(m, n_out, k, silu)))
                if 2 <= m <= sm.SMALL_M_MAX_ROWS:
                    families.append(("small_m_best", sm.small_m_linear, _small_m_configs(k)))
                for prefix, kernel, configs in families:
                    best = _best(kernel, configs, x, silu, weights, iters // 2)
                    if best:
                        row[f"{prefix}_us"], row[f"{prefix}_config"] = best[0] * 1e6, best[1]
                        row[f"{prefix}_gbs"] = wbytes / best[0] / 1e9
            out.append(row)
            print(_fmt(row), flush=True)
        del weights
        torch.cuda.empty_cache()
    return out


def _fmt(r: dict) -> str:
    s = (f"{r['layer']:>18} M={r['m']:<3} {r['n']}x{r['k']} ({r['weight_mb']:.1f} MB): torch {r['torch_us']:8.1f} us "
         f"{r['torch_gbs']:7.0f} GB/s | ours {r['ours_us']:8.1f} us {r['ours_gbs']:7.0f} GB/s "
         f"({100 * r['ours_hw']:.0f}% of 4.3 TB/s, x{r['speedup']:.2f})")
    if "gemv_us" in r:
        s += f" | gemv {r['gemv_us']:.1f} us {r['gemv_gbs']:.0f} GB/s (x{r['torch_us'] / r['gemv_us']:.2f})"
    if "best_config" in r:
        s += f" | best skinny {r['best_us']:.1f} us {r['best_gbs']:.0f} GB/s {r['best_config']}"
    if "gemv_best_config" in r:
        s += f" | best gemv {r['gemv_best_us']:.1f} us {r['gemv_best_gbs']:.0f} GB/s {r['gemv_best_config']}"
    if "small_m_us" in r:
        s += f" | small-M {r['small_m_us']:.1f} us {r['small_m_gbs']:.0f} GB/s (x{r['torch_us'] / r['small_m_us']:.2f})"
    if "small_m_best_config" in r:
        s += f" | best small-M {r['small_m_best_us']:.1f} us {r['small_m_best_gbs']:.0f} GB/s {r['small_m_best_config']}"
    if "splitk_us" in r:
        s += f" | splitk {r['splitk_us']:.1f} us {r['splitk_gbs']:.0f} GB/s (x{r['torch_us'] / r['splitk_us']:.2f})"
    if "splitk_best_config" in r:
        s += (f" | best splitk {r['splitk_best_us']:.1f} us {r['splitk_best_gbs']:.0f} GB/s "
              f"(x{r['torch_us'] / r['splitk_best_us']:.2f}) {r['splitk_best_config']}")
    return s
