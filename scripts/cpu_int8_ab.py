"""In one process, alternating: README command 1 decode tok/s on the VNNI route, the AVX2 route (a -mno-avx512vnni build)
and the float GEMVs (VERISPEC_CPU_GGUF_INT8=0 at load): PYTHONPATH=$PWD python3 scripts/cpu_int8_ab.py (session 26)."""
import os
import statistics
import time

from verispec import LLM, SamplingParams
from verispec.kernels import cpu_gguf

sp = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
native = cpu_gguf.library()
avx2 = cpu_gguf.variant(("-mno-avx512vnni",))
a = LLM("qwen2.5-coder-0.5b-instruct", device="cpu")
os.environ["VERISPEC_CPU_GGUF_INT8"] = "0"
c = LLM("qwen2.5-coder-0.5b-instruct", device="cpu")
res = {}
def run(name, llm, lib):
    cpu_gguf._lib = lambda: lib
    llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    t = time.perf_counter()
    llm.generate(["def fibonacci(n):"], sp, use_tqdm=False)
    res.setdefault(name, []).append(96 / (time.perf_counter() - t))
for _ in range(5):
    run("int8 VNNI-512", a, native)
    run("int8 AVX2", a, avx2)
    run("float GEMV (INT8=0)", c, native)
for k, v in res.items():
    print(f"{k:22s} median {statistics.median(v):5.1f} tok/s  {[round(x, 1) for x in v]}")
