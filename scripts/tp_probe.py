"""TP=N against TP=1 on one model: greedy agreement (tokens and first divergences), the largest logprob
gap of the tokens both chose, and (CUDA, --profile) the all-reduce / all-gather kernel time per decode
step from torch.profiler, on rank 0.

usage: PYTHONPATH=$PWD python3 scripts/tp_probe.py --model M.gguf [--tp 2] [--device cuda] [--dtype bfloat16]
       [--num-prompts 64] [--max-tokens 128] [--profile]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from verispec import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):", "import numpy as np\n\ndef softmax(x):", "class LRUCache:", "SELECT name FROM",
           "# Parse a CSV file and print the sum of the second column\n", "fn main() {", "The capital of France is",
           "Explain what a mutex is in one paragraph."]


def run(llm: LLM, prompts: list[str], max_tokens: int):
    """Greedy ids, the chosen tokens' logprobs, each step's top-1 - top-2 margin, seconds."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    secs = time.perf_counter() - t0
    ids = [o.outputs[0].token_ids for o in outs]
    lps = [[lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)] for o in outs]
    margins = [[(lambda v: v[0] - v[1])(sorted(lp.values(), reverse=True)) for lp in o.outputs[0].logprobs]
               for o in outs]
    return ids, lps, margins, secs


def profile_collectives(llm: LLM, steps: int = 20) -> None:
    """Decode steps of 64 sequences under torch.profiler: the collective kernels' time per step."""
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(64):
        eng.add_request(f"p{i}", PROMPTS[i % len(PROMPTS)], sp)
    for _ in range(4):  # prefill and the first decode steps outside the window
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    while eng.has_unfinished_requests():
        eng.step()
    kernels = [e for e in prof.key_averages() if e.device_type is not None and "cuda" in str(e.device_type).lower()]
    total = sum(e.self_device_time_total for e in kernels) / steps
    nccl = sum(e.self_device_time_total for e in kernels if "nccl" in e.key.lower()) / steps
    print(f"profile: {steps} decode steps of 64 seqs, {1e3 * wall / steps:.2f} ms/step wall; GPU kernels "
          f"{total / 1e3:.2f} ms/step, of which NCCL {nccl / 1e3:.3f} ms/step ({100 * nccl / max(total, 1):.1f}%)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--profile", action="store_true", help="(CUDA) the collectives' kernel time per step")
    a = ap.parse_args()
    prompts = [PROMPTS[i % len(PROMPTS)] + f"  # {i}" for i in range(a.num_prompts)]
    kw = dict(device=a.device, dtype=a.dtype, max_model_len=1024, enforce_eager=a.enforce_eager)
    ref = LLM(a.model, **kw)
    want, want_lp, margins, secs1 = run(ref, prompts, a.max_tokens)
    cfg = dataclasses.replace(ref.config)
    del ref
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    llm = LLM(a.model, tensor_parallel_size=a.tp, **kw)
    got, got_lp, _, secs = run(llm, prompts, a.max_tokens)
    same_seq = sum(g == w for g, w in zip(got, want, strict=True))
    firsts = [next((i for i, (x, y) in enumerate(zip(g, w, strict=True)) if x != y), None)
              for g, w in zip(got, want, strict=True)]
    same_tok = sum(min(f if f is not None else len(w), len(w)) for f, w in zip(firsts, want, strict=True))
    gaps = [abs(x - y) for gl, wl, f in zip(got_lp, want_lp, firsts, strict=True)
            for x, y in list(zip(gl, wl, strict=True))[: f if f is not None else None]]
    total = sum(map(len, want))
    print(f"{cfg.model} {cfg.dtype} TP={a.tp} vs TP=1, {a.num_prompts} prompts x {a.max_tokens} greedy tokens: "
          f"{same_seq}/{a.num_prompts} sequences identical, {same_tok}/{total} tokens before the first divergence "
          f"({100 * same_tok / total:.1f}%); first divergences at {sorted(f for f in firsts if f is not None)[:16]}; "
          f"max |logprob gap| before divergence {max(gaps, default=0.0):.2e}; smallest TP=1 top-1 - top-2 "
          f"margin {min(min(m) for m in margins):.2e}; "
          f"generate {secs1:.2f}s (TP=1) vs {secs:.2f}s (TP={a.tp})")
    if a.profile and torch.cuda.is_available():
        profile_collectives(llm)
    llm.shutdown()


if __name__ == "__main__":
    main()
