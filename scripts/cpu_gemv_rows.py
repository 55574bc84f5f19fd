"""The integer-dot GEMV of one CPU decode / verify step of the 0.5B at m rows: its layers' weights by type and the
LM head, ms (median of --reps runs of the whole set), and each m's time over m = 1's: what a verify row costs
beside a decode row. --gemm also times every layer at m rows through the dequantize + torch GEMM route (what prompt
chunks took before session 30) against the integer dot over the same rows, all layers summed.
PYTHONPATH=$PWD python3 scripts/cpu_gemv_rows.py [--rows 1,2,3,5] [--reps 7] [--gemm]"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from verispec.kernels import cpu_gguf
from verispec.loader.model_loader import load_model

NAMES = {2: "Q4_0", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--rows", default="1,2,3,5")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--gemm", action="store_true", help="also the dequantize + GEMM route, all layers summed")
    args = ap.parse_args()
    _, _, model = load_model(args.model, torch.device("cpu"), torch.float32, progress=False, quantization="gguf")
    lib = cpu_gguf._lib()
    by_type: dict[str, list] = collections.defaultdict(list)
    for name, mod in model.named_modules():
        for s in getattr(mod, "segments", ()) or ():
            w = s.weight
            by_type["lm_head" if "lm_head" in name else NAMES.get(w.qtype, str(w.qtype))].append(w)
    base: dict[str, float] = {}
    print(f"int8 route {cpu_gguf.int8_route()}, {torch.get_num_threads()} threads; ms per step (median of {args.reps})")
    for m in (int(r) for r in args.rows.split(",")):
        row = []
        for kind, ws in sorted(by_type.items()):
            xs = {w.shape[1]: torch.randn(m, w.shape[1]) for w in ws}
            for w in ws:  # warm up
                cpu_gguf.gemv_int8(lib, xs[w.shape[1]], w)
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                for w in ws:
                    cpu_gguf.gemv_int8(lib, xs[w.shape[1]], w)
                times.append(time.perf_counter() - t0)
            ms = 1e3 * statistics.median(times)
            base.setdefault(kind, ms)
            row.append(f"{kind} {ms:.2f} ({ms / base[kind]:.2f}x)")
        print(f"m={m}: " + ", ".join(row), flush=True)
        if args.gemm:
            ws = [w for group in by_type.values() for w in group]
            xs = {w.shape[1]: torch.randn(m, w.shape[1]) for w in ws}
            for name, fn in (("dequantize + GEMM", lambda w, xs=xs: cpu_gguf.linear(xs[w.shape[1]], w)),
                             ("integer dot", lambda w, xs=xs: cpu_gguf.gemv_int8(lib, xs[w.shape[1]], w))):
                times = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    for w in ws:
                        fn(w)
                    times.append(time.perf_counter() - t0)
                print(f"  m={m} all layers, {name}: {1e3 * statistics.median(times):.1f} ms", flush=True)


if __name__ == "__main__":
    main()
