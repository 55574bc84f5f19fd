"""Where a CPU decode step goes: 64 greedy tokens of README command 1's prompt through LLM.generate under
cProfile (by own time) and torch.profiler (by op). PYTHONPATH=$PWD python3 scripts/cpu_decode_profile.py
[VERISPEC_CPU_OPS=0 for the torch ops]."""

from __future__ import annotations

import cProfile
import pstats

from torch.profiler import ProfilerActivity, profile

from verispec import LLM, SamplingParams

llm = LLM("qwen2.5-coder-0.5b-instruct", device="cpu")
sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
llm.generate(["def fibonacci(n):"], sp, use_tqdm=False)  # warm-up
pr = cProfile.Profile()
pr.enable()
llm.generate(["def fibonacci(n):"], sp, use_tqdm=False)
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(35)
with profile(activities=[ProfilerActivity.CPU]) as p:
    llm.generate(["def fibonacci(n):"], sp, use_tqdm=False)
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
