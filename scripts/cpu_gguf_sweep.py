"""One decode step's matmuls of a GGUF model at M = 1 on the CPU, per weight kind: the C GGUF-block kernel
(kernels/cpu_gguf.py) against the int4-plane / bf16 segments it replaces (loader/cpu_pack.py), each kind's
weights of every layer in turn (so they come from memory, as in a step); best of --iters.

usage: PYTHONPATH=$PWD python3 scripts/cpu_gguf_sweep.py [MODEL] [--threads N] [--iters 5] [--all-types]
(--all-types: every type the kernel has, Q4_K too, which the loader keeps on its int4 plane). "int8": the same
kernel weights with one row's integer-dot GEMV (linear(int8=True): Q8_0, Q5_0, Q4_0; the others as "kernel"),
the loader's default where cpu_gguf.int8_available()
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from verispec.kernels import cpu_gguf
from verispec.loader import cpu_pack
from verispec.loader.dequant import type_name
from verispec.loader.gguf import GGUFFile
from verispec.loader.registry import resolve_model


def best_ms(fn, iters: int) -> float:
    fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--all-types", action="store_true")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if not cpu_gguf.available():
        raise SystemExit("the CPU GGUF kernel is not available here (no C compiler, or it failed its check)")
    f = GGUFFile(resolve_model(a.model, progress=False))
    kinds: dict[str, list[str]] = defaultdict(list)
    for name, info in f.tensors.items():
        if len(info.shape) == 2 and name != "token_embd.weight":
            kinds["output" if name == "output.weight" else name.split(".")[2]].append(name)
    tot_c = tot_p = tot_8 = 0.0
    print(f"{torch.get_num_threads()} threads; ms per step for all layers' weights of each kind")
    for kind, names in sorted(kinds.items()):
        blocks, packed, kept, types = [], [], [], set()
        for name in names:
            info = f.tensors[name]
            shape = (int(info.shape[0]), int(info.shape[1]))
            raw = f.raw(name)
            types.add(type_name(info.ggml_type))
            packed.append(cpu_pack.pack_tensors([(raw, info.ggml_type, shape)])[0])
            if info.ggml_type in (cpu_gguf.BLOCKS if a.all_types else cpu_gguf.GEMV_TYPES):
                blocks.append(cpu_gguf.CPUBlocks(raw.reshape(shape[0], -1).contiguous(), info.ggml_type, shape))
            else:  # what the loader keeps packed beside the kernel
                kept.append(packed[-1])
        x = torch.randn(1, packed[0].shape[1])
        xb = x.to(cpu_pack.COMPUTE_DTYPE)
        tp = best_ms(lambda: [s(xb) for s in packed], a.iters)  # noqa: B023
        tc = best_ms(lambda: [cpu_gguf.linear(x, w) for w in blocks], a.iters) if blocks else 0.0  # noqa: B023
        t8 = best_ms(lambda: [cpu_gguf.linear(x, w, int8=True) for w in blocks], a.iters) if blocks else 0.0  # noqa: B023
        tk = best_ms(lambda: [s(xb) for s in kept], a.iters) if kept else 0.0  # noqa: B023
        tot_c += tc + tk
        tot_8 += t8 + tk
        tot_p += tp
        print(f"{kind:12s} x{len(names):2d} {'/'.join(sorted(types)):10s} kernel {tc:6.2f} (int8 {t8:6.2f}) + kept packed {tk:6.2f} "
              f"({len(blocks)} / {len(kept)} weights)  int4/bf16 only {tp:6.2f}", flush=True)
    print(f"total: with the kernel {tot_c:.1f} ms (int8 one-row GEMVs {tot_8:.1f} ms), int4/bf16 only {tot_p:.1f} ms")


if __name__ == "__main__":
    main()
