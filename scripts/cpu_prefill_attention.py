"""A whole prefill on the quantized CPU path with the C attention for prompt chunks (the default since session 30)
against torch's SDPA for them (cpu_ops.MAX_QUERY_LEN = 16, the rule before): LLM.generate of one fresh prompt of
L token ids (no prefix hit), max_tokens 1, seconds, two runs each.
PYTHONPATH=$PWD python3 scripts/cpu_prefill_attention.py [--lens 64,512,1500]"""

from __future__ import annotations

import argparse
import time

from verispec import LLM, SamplingParams
from verispec.kernels import cpu_ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--lens", default="64,512,1500")
    args = ap.parse_args()
    llm = LLM(args.model, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=1)
    fresh = 0
    for n in (int(x) for x in args.lens.split(",")):
        body = [(i * 7919) % 30000 + 100 for i in range(1, n)]
        for label, limit in (("SDPA for chunks", 16), ("C attention", None)):
            cpu_ops.MAX_QUERY_LEN = limit
            secs = []
            for _ in range(2):
                fresh += 1  # a new first token: no prefix-cache hit on any block
                t0 = time.perf_counter()
                llm.generate(prompt_token_ids=[[fresh] + body], sampling_params=params, use_tqdm=False)
                secs.append(time.perf_counter() - t0)
            print(f"{n} tokens, {label}: " + " / ".join(f"{s:.3f}" for s in secs) + " s", flush=True)
    cpu_ops.MAX_QUERY_LEN = None


if __name__ == "__main__":
    main()
