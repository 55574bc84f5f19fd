"""GB/s of the CPU integer-dot GEMV at the 0.5B shapes, weights streamed from DRAM (24 distinct copies; the LM head
once): PYTHONPATH=$PWD:tests python3 scripts/cpu_int8_bw.py [EXTRA CC FLAGS, e.g. -mno-avx512vnni] (session 26)."""
import statistics
import sys
import time

import torch

sys.path.insert(0, "tests")
from test_cpu_gguf import T, _weight

from verispec.kernels import cpu_gguf

lib = cpu_gguf.variant(tuple(sys.argv[1:])) if len(sys.argv) > 1 else cpu_gguf.library()
print("route", cpu_gguf.int8_route(lib))
for name, qt, n, k, copies in [("gate_up Q5_0", T.Q5_0, 9728, 896, 24), ("down Q6_K", T.Q6_K, 896, 4864, 24),
                               ("down Q4_K", T.Q4_K, 896, 4864, 24), ("lm_head Q8_0", T.Q8_0, 151936, 896, 1)]:
    w0, _ = _weight(qt, n, k, seed=1)
    ws = [cpu_gguf.CPUBlocks(w0.blocks.clone(), w0.qtype, w0.shape) for _ in range(copies)]
    x = torch.randn(1, k)
    for w in ws:
        cpu_gguf.gemv_int8(lib, x, w)
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for w in ws:
            cpu_gguf.gemv_int8(lib, x, w)
        ts.append((time.perf_counter() - t) / copies)
    b = w0.blocks.numel()
    print(f"{name:14s} {b/1e6:6.2f} MB x{copies}  {statistics.median(ts)*1e6:7.0f} us  {b / statistics.median(ts) / 1e9:5.1f} GB/s")
