"""Greedy decode tok/s of one prompt on the CPU through LLM.generate (prefill included), a few rounds in
one process: PYTHONPATH=$PWD python3 scripts/cpu_decode_tps.py [MODEL] [--tokens N] [--rounds R].
For A/B of a change, run it on both trees alternately (the machine's speed drifts over minutes)."""

from __future__ import annotations

import argparse
import time

from verispec import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model, device="cpu")
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate([args.prompt], sp, use_tqdm=False)  # warm-up
    for r in range(args.rounds):
        t = time.perf_counter()
        llm.generate([args.prompt], sp, use_tqdm=False)
        dt = time.perf_counter() - t
        print(f"round {r + 1}: {args.tokens} tokens in {dt:.2f} s, {args.tokens / dt:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
