"""Torch-profiler view of DFlash decoding: one chat-rendered HumanEval prompt, 128 tokens, k=7, batch 1.

    python3 scripts/dflash_profile.py TARGET.gguf DRAFTER_DIR
Prints the wall time under the profiler, then the top ops by self CPU time and by self CUDA time
(the CUDA total over the number of speculative steps is the GPU time of one step).
"""

from __future__ import annotations

import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from verispec import LLM, SamplingParams
from verispec.train.data import render_prompts


def main() -> None:
    target, drafter = sys.argv[1], sys.argv[2]
    spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": 7}
    llm = LLM(target, speculative_config=spec, max_num_seqs=4)
    prompts = render_prompts(llm.tokenizer, [json.loads(line)["prompt"] for line in open("humaneval.jsonl")][:3])
    sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate(prompts[:1], sp)  # warm-up
    m0 = llm.get_metrics()["spec_decode_num_drafts"]
    torch.cuda.synchronize()
    t = time.time()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts[1:2], sp)
    torch.cuda.synchronize()
    print(f"wall {time.time() - t:.2f}s under the profiler; {llm.get_metrics()['spec_decode_num_drafts'] - m0} steps")
    avg = prof.key_averages()
    print(avg.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    print(avg.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
