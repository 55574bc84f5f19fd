"""Speed of the GGUF-block kernels (verispec/kernels/gguf_matmul.py) against dense bf16 at the 1.5B's layer shapes.

For each layer shape (qkv, o, gate_up, down, lm_head) and row count M: dense = the repo's linear() and
F.linear on a bf16 weight; gguf = gguf_linear's pick (gm.linear_plan: the GEMV for few rows, the tensor-core
kernel above) with its default tiles. Each line gives us per call, GB/s and the fraction of the H200's
4.8 TB/s HBM bandwidth from the bytes read (weights + x + out). A second pass (until --budget-s) tries
alternative tiles of the kernel(s) for each case and prints the best, so one run finds better defaults.
CUDA timing: bench/linear.py's _time (calls replayed from a CUDA graph, cycling through weight copies
totalling > 4x L2, so the bytes come from HBM). --device cpu: a dry run in Triton's interpreter at tiny
shapes (wall-clock, meaningless as speed: it checks that everything runs).
usage: python3 scripts/gguf_bench.py [--device cpu --shapes tiny] [--rows 1,16,64] [--qtypes Q4_K,Q6_K]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time

import torch
import torch.nn.functional as F

from verispec.core.options import KernelOptions
from verispec.kernels import gguf_matmul as gm

HBM = 4.8e12  # the H200's nominal HBM bandwidth (bench/hardware.py's 4.3e12 is the measured copy rate)
L2_BYTES = 50 << 20
SHAPES = {
    "1.5b": [("qkv", 2048, 1536), ("o", 1536, 1536), ("gate_up", 17920, 1536), ("down", 1536, 8960),
             ("lm_head", 151936, 1536)],
    "tiny": [("qkv", 40, 256), ("down", 24, 512), ("lm_head", 100, 256)],
}


def timer(device: str, iters: int):
    """fn(w), weights -> seconds per call: CUDA-graph replay on CUDA, wall clock (one call) on CPU."""
    if device == "cuda":
        from verispec.bench.linear import _time

        return lambda fn, weights: _time(fn, weights, iters)

    def wall(fn, weights):
        fn(weights[0])
        t = time.perf_counter()
        fn(weights[0])
        return time.perf_counter() - t

    return wall


def resident_configs() -> list[dict]:
    """kernels/gguf_gemv.py's resident one-row tiles: 1..16 rows a program, 1..8 warps (Q6_K's only form)."""
    return [dict(ONE_ROW=1, BLOCK_M=1, BLOCK_N=bn, num_warps=w) for bn, w in
            itertools.product([1, 2, 4, 8, 16], [1, 2, 4, 8]) if bn * 32 * w <= 8192]


def gemv_configs(m: int, int8: bool = False, one_row: bool = False, resident: bool = False,
                 q6k: bool = False) -> list[dict]:
    """BLOCK_N x BLOCK_K tiles with 4..64 weight elements per thread; at one row also the single-row
    variant (BLOCK_M 1) of the same tiles. int8: the integer-dot GEMV's tiles (BLOCK_N 4..64 rows, 1 or 2
    super-blocks a step, 4 or 8 warps). one_row (one row of Q4_K: kernels/gguf_gemv.py): SB 1..8 super-blocks
    a step with 4 SB threads a row, 1..8 warps (BLOCK_N = 32 warps / SB rows), and twice those rows; resident:
    the resident form's tiles instead (RES=1). q6k (one row of Q6_K on kernels/gguf_gemv.py): resident_configs."""
    if q6k and m == 1:
        return resident_configs()
    if one_row and m == 1 and resident:
        return [dict(c, RES=1) for c in resident_configs()]
    if one_row and m == 1:
        return [dict(ONE_ROW=1, BLOCK_M=1, BLOCK_N=bn, SB=sb, num_warps=w)
                for sb, w in itertools.product([1, 2, 4, 8], [1, 2, 4, 8]) for bn in (32 * w // (4 * sb),) * 1
                if bn >= 1] + [dict(ONE_ROW=1, BLOCK_M=1, BLOCK_N=2 * 32 * w // (4 * sb), SB=sb, num_warps=w)
                               for sb, w in itertools.product([2, 4, 8], [2, 4]) if 32 * w // (4 * sb) >= 1]
    if int8:
        bm = 1 if m == 1 else gm.GEMV_MAX_ROWS
        return [dict(I8=1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w)
                for bn, bk, w in itertools.product([8, 16, 32, 4, 64], [512, 256], [4, 8])]
    out = []
    for bm, bn, bk, w in itertools.product([1, gm.GEMV_MAX_ROWS] if m == 1 else [gm.GEMV_MAX_ROWS],
                                           [1, 2, 4, 8, 16], [256, 512, 1024, 2048], [4, 8]):
        if 4 <= bn * bk // (32 * w) <= 64:
            out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w))
    return out


def near(configs: list[dict], default: dict | None) -> list[dict]:
    """configs sorted by how far (in powers of two) their tiles are from the default's."""
    if default is None:
        return configs
    d = default["config"]

    def dist(c: dict) -> float:
        return sum(abs(math.log2(c[key]) - math.log2(d[key])) for key in c if key in d)

    return sorted(configs, key=dist)


def mma_configs(m: int, n: int, k: int, qtype: int) -> list[dict]:
    """Tiles around mma_config's, most promising first (a budget cut keeps the head of the list). Q4_K / Q6_K:
    the super-block kernel's knobs (a super-block in one part or two, L2 prefetch 0 / 1 / 2 blocks ahead, W as
    the MMA's left or right operand, BLOCK_N, BLOCK_M, warps, stages, split K: none, the default's, twice it) and the generic kernel's default for comparison; other types:
    wider / narrower N and K tiles, 8 warps, split K on or off."""
    base = gm.mma_config(m, n, k, qtype)
    if base.get("SB"):
        bm, sp, w = base["BLOCK_M"], base["SPLIT_K"], base["num_warps"]
        up = min(256, 2 * bm)
        pf = base.get("PREFETCH", 0)
        variants = [dict(PARTS=1), dict(PREFETCH=1 - min(pf, 1)), dict(SWAP=0), dict(BLOCK_N=128, num_warps=8),
                    dict(PREFETCH=2), dict(BLOCK_N=128), dict(num_stages=3),
                    dict(num_stages=1), dict(SPLIT_K=2 * sp), dict(SPLIT_K=1), dict(BLOCK_M=up, num_warps=8),
                    dict(SWAP=0, BLOCK_N=32), dict(SWAP=0, BLOCK_N=128, num_warps=8), dict(num_warps=8 if w == 4 else 4),
                    dict(BLOCK_M=max(16, bm // 2), num_warps=4), dict(BLOCK_M=64, num_warps=4, SPLIT_K=2 * sp),
                    dict(SWAP=0, BLOCK_M=max(64, bm)), dict(BLOCK_N=128, BLOCK_M=up, num_warps=8),
                    dict(PARTS=1, num_stages=1), dict(BLOCK_M=64, num_warps=4, num_stages=1),
                    dict(BLOCK_M=up, num_warps=8, num_stages=1), dict(BLOCK_N=128, num_warps=8, num_stages=3),
                    dict(BLOCK_N=128, num_warps=8, PARTS=1), dict(BLOCK_N=256, num_warps=8),
                    dict(BLOCK_N=128, num_warps=8, SPLIT_K=2 * sp), dict(num_stages=4)]
        out = []
        for v in variants:
            c = dict(base, **v)
            if c != base and c not in out:
                out.append(c)
        generic = {key: val for key, val in base.items() if key not in ("SB", "SWAP", "PARTS", "PREFETCH")}
        return out + [dict(generic, BLOCK_K=64, num_stages=3)]
    out = []
    for bn, bk, w, st in [(64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3), (32, 64, 4, 3),
                          (64, 32, 4, 4), (128, 32, 4, 4), (256, 64, 8, 3)]:
        for split in sorted({1, base["SPLIT_K"]}):
            out.append(dict(BLOCK_M=base["BLOCK_M"], BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=w,
                            num_stages=st))
    return out


def measure(ctx: dict, m: int, kname: str, c: dict, default: bool) -> dict | None:
    """Time one kernel config on one case (ctx: the shape's inputs, weights and dense times); the result row."""
    fn = {"gemv": gm.gguf_gemv, "mma": gm.gguf_mma, "dense": gm.gguf_dense}[kname]
    x = ctx["xs"][m]
    try:
        t = ctx["time_it"](lambda w: fn(x, w, config=c), ctx["ws"])
    except Exception as e:  # noqa: BLE001 - a tile that does not compile (out of resources)
        print(f"  {kname} {c}: {type(e).__name__}: {str(e)[:120]}")
        return None
    d_lin, d_f, io = ctx["dense_t"][m]
    d_best, nbytes, n, k = min(d_lin, d_f), ctx["nbytes_w"] + io, ctx["n"], ctx["k"]
    r = dict(layer=ctx["layer"], n=n, k=k, m=m, qtype=gm.type_name(ctx["qt"]), kernel=kname, config=c, us=t * 1e6,
             gbs=nbytes / t / 1e9, hbm=nbytes / t / HBM, dense_us=d_best * 1e6,
             dense_hbm=(n * k * 2 + io) / d_best / HBM, linear_us=d_lin * 1e6, flinear_us=d_f * 1e6, default=default)
    ctx["results"].append(r)
    return r


def copies(device: str, nbytes: int) -> int:
    """Weight copies per case: > 4x L2 in all on CUDA (HBM, not cache, bandwidth), one on CPU."""
    return max(2, math.ceil(4 * L2_BYTES / nbytes)) if device == "cuda" else 1


def line(r: dict) -> str:
    return (f"{r['layer']:>8} {r['n']}x{r['k']} M={r['m']:<3} {r['qtype']:>5} {r['kernel']:>5}: "
            f"{r['us']:8.1f} us {r['gbs']:6.0f} GB/s {100 * r['hbm']:4.0f}% | dense {r['dense_us']:7.1f} us "
            f"{100 * r['dense_hbm']:4.0f}% (F.linear {r['flinear_us']:.1f}) x{r['dense_us'] / r['us']:.2f} {r['config']}")


def run_shape(args, layer: tuple[str, int, int], deadline: float, time_it, results: list[dict]) -> None:
    """One layer shape: dense bf16, then each type with its default tiles (checked against the reference),
    then the sweep of --sweep-qtypes until `deadline` (each swept type its share of the time left)."""
    name, n, k = layer
    dev, rows = args.device, args.rows
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    if dev == "cuda":
        from verispec.kernels.linear import linear
    else:
        linear = F.linear
    dense = [torch.randn(n, k, device=dev, dtype=dtype) * k**-0.5 for _ in range(copies(dev, n * k * 2))]
    xs = {m: torch.randn(m, k, device=dev, dtype=dtype) for m in rows}
    # (linear() s, F.linear s, bytes of x and out) per M
    dense_t = {m: (time_it(lambda w, x=x: linear(x, w), dense), time_it(lambda w, x=x: F.linear(x, w), dense),
                   x.numel() * x.element_size() * (1 + n / k)) for m, x in xs.items()}
    del dense
    start = time.time()
    swept = [q for q in args.qtypes if q in args.sweep_qtypes]
    for qt in args.qtypes:
        if k % gm.GGML_QUANT_SIZES[gm.T(qt)][0]:
            continue
        share = start + (deadline - start) * (swept.index(qt) + 1) / len(swept) if qt in swept else deadline
        nbytes_w = gm.random_weight(qt, 1, k).nbytes * n
        ws = [gm.random_weight(qt, n, k, seed=i, device=dev) for i in range(copies(dev, nbytes_w))]
        ctx = dict(layer=name, n=n, k=k, qt=qt, xs=xs, ws=ws, dense_t=dense_t, nbytes_w=nbytes_w,
                   time_it=time_it, results=results)
        defaults = {}
        for m in rows:  # pass 1: gguf_linear's pick with its default tiles, checked against the reference
            kname, cfg = gm.linear_plan(m, n, k, qt, args.options)
            ref = gm.gguf_linear_ref(xs[m], ws[0]).float()
            out = {"gemv": gm.gguf_gemv, "mma": gm.gguf_mma, "dense": gm.gguf_dense}[kname](xs[m], ws[0], config=cfg)
            err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
            r = measure(ctx, m, kname, cfg, True)
            if r is not None:
                defaults[m] = r
                r["rel_err"] = err
                print(line(r) + f" err {err:.1e}" + ("" if err < 2e-2 else " ** WRONG **"), flush=True)
        if qt not in args.sweep_qtypes:
            continue
        # pass 2: other tiles, round-robin over the cases (each case's closest alternatives first), so a cut
        # by the budget leaves a few tried per case
        int8 = args.options.gguf_int8_gemv and qt in gm.KQUANT_GEMV_TYPES
        one = args.options.gguf_gemv1 and not int8 and qt == gm.T.Q4_K
        q6k = args.options.gguf_gemv1_q6k and not int8 and qt == gm.T.Q6_K
        groups = [[(m, "gemv", c) for c in near(gemv_configs(m, int8, one, args.options.gguf_gemv1_resident, q6k),
                                                defaults.get(m))] for m in rows if m <= gm.GEMV_MAX_ROWS]
        groups += [[(m, "mma", c) for c in mma_configs(m, n, k, qt)] for m in rows if m >= 8]
        groups = [[(m, "dense", {}) for m in rows if m >= 16 and m < gm.DENSE_MIN_ROWS]] + groups  # the dense route below its threshold
        todo = [g[i] for i in range(max(map(len, groups), default=0)) for g in groups if i < len(g)]
        best = dict(defaults)
        for i, (m, kname, c) in enumerate(todo):
            if time.time() > share:
                print(f"  ({name}: sweep budget spent, {len(todo) - i} of {len(todo)} configs untried)")
                break
            if m in defaults and c == defaults[m]["config"]:
                continue
            r = measure(ctx, m, kname, c, False)
            if r is not None and (m not in best or r["us"] < best[m]["us"]):
                best[m] = r
        for m in rows:
            if m in best and not best[m]["default"]:
                print("   best " + line(best[m]), flush=True)
        del ws


# The 1.5B Q4_K_M file's linear layers (checked with loader/gguf.py): 28 layers of q / k / o / gate / up in
# Q4_K, down in Q4_K in 14 layers and Q6_K in 14 (v too, a small share of qkv, counted as Q4_K here), and
# an untied Q6_K output (LM head).
STEP_MIX = {"gguf": [("qkv", "Q4_K", 28), ("o", "Q4_K", 28), ("gate_up", "Q4_K", 28), ("down", "Q4_K", 14),
                     ("down", "Q6_K", 14), ("lm_head", "Q6_K", 1)],
            "dense": [("qkv", 28), ("o", 28), ("gate_up", 28), ("down", 28), ("lm_head", 1)]}


def step_estimate(results: list[dict], rows: list[int]) -> None:
    """Per M: the 1.5B's linear layers of one step, summed from the default-tile lines (gguf vs dense)."""
    got = {(r["layer"], r["qtype"], r["m"]): r for r in results if r["default"]}
    for m in rows:
        try:
            g = sum(c * got[(layer, q, m)]["us"] for layer, q, c in STEP_MIX["gguf"])
            d = sum(c * got[(layer, "Q4_K", m)]["dense_us"] for layer, c in STEP_MIX["dense"])
        except KeyError:
            continue
        print(f"  1.5B linear layers per step, M={m:<3}: gguf {g:8.0f} us vs dense bf16 {d:8.0f} us (x{d / g:.2f}); "
              f"at M=1 that bounds decode at {1e6 / g:.0f} vs {1e6 / d:.0f} tok/s" if m == 1 else
              f"  1.5B linear layers per step, M={m:<3}: gguf {g:8.0f} us vs dense bf16 {d:8.0f} us (x{d / g:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shapes", default="1.5b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="1,2,4,8,16,64,256")
    ap.add_argument("--qtypes", default="Q4_K,Q6_K", help="types timed with the default tiles")
    ap.add_argument("--sweep-qtypes", default="Q4_K", help="types whose tiles are swept (second pass)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--budget-s", type=float, default=150.0, help="no new sweep config after this many seconds")
    ap.add_argument("--int8", action="store_true",
                    help="Q4_K / Q6_K at one row: the integer-dot GEMV (KernelOptions.gguf_int8_gemv), its tiles swept")
    ap.add_argument("--gemv1", action="store_true",
                    help="one row of Q4_K on kernels/gguf_gemv.py's GEMV (KernelOptions.gguf_gemv1; the default)")
    ap.add_argument("--no-gemv1", action="store_true", help="gguf_matmul's super-block GEMV instead")
    ap.add_argument("--gemv1-q6k", action="store_true",
                    help="one row of Q6_K on kernels/gguf_gemv.py's resident GEMV (KernelOptions.gguf_gemv1_q6k)")
    ap.add_argument("--resident", action="store_true",
                    help="one row of Q4_K in gguf_gemv1's resident form (KernelOptions.gguf_gemv1_resident; its tiles swept)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.options = KernelOptions(gguf_int8_gemv=args.int8, gguf_gemv1=not args.no_gemv1,
                                 gguf_gemv1_q6k=args.gemv1_q6k, gguf_gemv1_resident=args.resident)
    args.rows = [int(r) for r in args.rows.split(",")]
    args.qtypes = [int(gm.T[q]) for q in args.qtypes.split(",")]
    args.sweep_qtypes = [int(gm.T[q]) for q in args.sweep_qtypes.split(",") if q]
    t0, results = time.time(), []
    time_it = timer(args.device, args.iters)
    shapes = SHAPES[args.shapes]
    for i, layer in enumerate(shapes):
        deadline = t0 + args.budget_s * (i + 1) / len(shapes)  # each shape's share of the sweep budget
        try:
            run_shape(args, layer, deadline, time_it, results)
        except Exception as e:  # noqa: BLE001 - one shape failing (a compile, memory) must not cost the others
            print(f"  {layer}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.shapes == "1.5b":
        step_estimate(results, args.rows)
    print(f"done in {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
