"""CPU matmul kernels at M = 1 in the 0.5B's shapes: ms per step for 24 layers of distinct random weights
(qkv, o, gate_up, down), per weight format: float32 / bf16 (F.linear), int8 per channel
(_weight_int8pack_mm), int4 one plane (_weight_int4pack_mm_for_cpu), bf16 activations for the quantized ones.

usage: python3 scripts/cpu_matmul_probe.py [f32 bf16 i8 i4] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]
LAYERS = 24


def weights(kind: str) -> list:
    out = []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            if kind in ("f32", "bf16"):
                w = torch.randn(n, k)
                out.append(w.bfloat16() if kind == "bf16" else w)
            elif kind == "i8":
                out.append((torch.randint(-127, 127, (n, k), dtype=torch.int8), torch.rand(n).bfloat16()))
            else:
                q = torch.randint(0, 16, (n, k), dtype=torch.int32)
                out.append((torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1),
                            torch.rand(k // 32, n, 2).bfloat16()))
    return out


def step(kind: str, ws: list, xs: dict) -> None:
    for w, (_, k) in zip(ws, SHAPES * LAYERS, strict=True):
        x = xs[k]
        if kind == "f32":
            F.linear(x, w)
        elif kind == "bf16":
            F.linear(x.bfloat16(), w).float()
        elif kind == "i8":
            torch.ops.aten._weight_int8pack_mm(x.bfloat16(), w[0], w[1]).float()
        else:
            torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), w[0], 32, w[1]).float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kinds", nargs="*", default=["f32", "bf16", "i8", "i4"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    xs = {896: torch.randn(1, 896), 4864: torch.randn(1, 4864)}
    for kind in a.kinds:
        ws = weights(kind)
        step(kind, ws, xs)
        t0 = time.perf_counter()
        for _ in range(a.iters):
            step(kind, ws, xs)
        print(f"{kind}: {(time.perf_counter() - t0) / a.iters * 1e3:.2f} ms per step (all layer matmuls, "
              f"{torch.get_num_threads()} threads)", flush=True)


if __name__ == "__main__":
    main()
