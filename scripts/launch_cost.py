"""Host cost per call of the eager per-step kernels around a CUDA-graph replay, against the torch
ops they replace: the graph-input staging kernel vs seven torch copies / fills, the Triton argmax
vs torch's argmax + cat, one Triton GEMV launch and one torch op for scale. Calls are queued
without a sync inside the timed loop, so the figure is the host's time per call.

    python3 scripts/launch_cost.py [--rows 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from verispec.kernels.argmax import argmax_rows  # noqa: E402
from verispec.kernels.graph_inputs import stage_graph_inputs  # noqa: E402
from verispec.kernels.linear import gemv  # noqa: E402


def per_call_us(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return 1e6 * (t1 - t0) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64, help="sequences in the step (decode: one token each)")
    b = ap.parse_args().rows
    dev = torch.device("cuda")
    i64, i32 = dict(dtype=torch.long, device=dev), dict(dtype=torch.int32, device=dev)
    src = (torch.zeros(b, **i64), torch.zeros(b, **i64), torch.zeros(b, **i64), torch.arange(b + 1, **i32),
           torch.ones(b, **i32), torch.zeros(b, 20, **i32))
    dst = (torch.zeros(b, **i64), torch.zeros(b, **i64), torch.zeros(b, **i64), torch.zeros(b + 1, **i32),
           torch.zeros(b, **i32), torch.zeros(b, 64, **i32))
    logits = torch.randn(b, 151936, device=dev)
    ones = torch.ones(b, **i64)
    x = torch.randn(1, 1536, device=dev, dtype=torch.bfloat16)
    w = torch.randn(1536, 1536, device=dev, dtype=torch.bfloat16)

    def torch_stage() -> None:
        for s, d in zip(src[:5], dst[:5], strict=True):
            d[: s.shape[0]].copy_(s, non_blocking=True)
        dst[5].fill_(0)
        dst[5][:, :20].copy_(src[5], non_blocking=True)

    cases = [("stage_graph_inputs", lambda: stage_graph_inputs(src, dst, b, b, 1, 0, 16)),
             ("torch stage (7 ops)", torch_stage),
             ("argmax_rows (with counts)", lambda: argmax_rows(logits, True)),
             ("torch argmax + cat", lambda: torch.cat([logits.argmax(-1), ones])),
             ("gemv (one Triton launch)", lambda: gemv(x, w)),
             ("torch add (one op)", lambda: x.add(1))]
    print(f"host us per call, {b} rows")
    for name, fn in cases:
        print(f"  {name:<28} {per_call_us(fn):7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
