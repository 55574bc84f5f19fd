"""The 0.5B's 96 layer GEMVs of one step at m rows on the CPU: session 26's rule (the integer dot for one row, and
for Q4_K at every row count; the float GEMV otherwise) against the integer dot for every type (session 27's).
Mean of 5 runs, ms. PYTHONPATH=$PWD python3 scripts/cpu_int8_rows.py"""

from __future__ import annotations

import time

import torch

from verispec.kernels import cpu_gguf
from verispec.loader.model_loader import load_model

_, _, model = load_model("qwen2.5-coder-0.5b-instruct", torch.device("cpu"), torch.float32, progress=False,
                         quantization="gguf")
lib = cpu_gguf._lib()
mods = [model.get_submodule(f"model.layers.{i}.{n}") for i in range(model.config.num_layers)
        for n in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]


def layer_ms(m: int, int8_all: bool, reps: int = 5) -> float:
    xs = {q.in_features: torch.randn(m, q.in_features) for q in mods}

    def run() -> None:
        for q in mods:
            for s in q.segments:
                if int8_all or m == 1 or s.weight.qtype == 12:
                    cpu_gguf.gemv_int8(lib, xs[q.in_features], s.weight)
                else:
                    cpu_gguf.linear(xs[q.in_features], s.weight)

    run()
    t = time.perf_counter()
    for _ in range(reps):
        run()
    return (time.perf_counter() - t) / reps * 1e3


for m in (1, 2, 4, 5, 8, 16):
    print(f"m={m}: session-26 rule {layer_ms(m, False):.1f} ms, int8 for every type {layer_ms(m, True):.1f} ms")
