"""ngram at batch > 1 on the GPU: padded verify steps replay graphs (ModelRunner._pad).

Runs the same HumanEval prompts with ngram (greedy and seeded sampled requests) eagerly
(enforce_eager) and with CUDA graphs, and prints tok/s, the runner's graph / padded / eager step
counts, acceptance counters and how many requests' tokens differ (bf16: a different kernel shape
may flip a near-tie, so differences are reported, with the first differing index, not fatal).

    python3 scripts/ngram_pad_probe.py [MODEL] [BATCH] [K] [MAX_TOKENS]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from verispec import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def run(model: str, batch: int, k: int, n: int, eager: bool, prompts: list[str]) -> tuple[list[list[int]], dict]:
    """(tokens per prompt, stats) for one engine."""
    llm = LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": k}, max_num_seqs=batch,
              max_model_len=4096, enforce_eager=eager)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=n, ignore_eos=True)
              for i in range(len(prompts))]
    llm.generate(prompts[:2], params[:2])  # warm-up (Triton compiles)
    r = llm.engine.runner
    r.graph_steps = r.padded_steps = r.eager_steps = 0
    m0 = llm.engine.get_metrics()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    m = llm.engine.get_metrics()
    toks = [o.outputs[0].token_ids for o in outs]
    stats = {"tok_s": round(sum(map(len, toks)) / wall, 1), "graph_steps": r.graph_steps,
             "padded_steps": r.padded_steps, "eager_steps": r.eager_steps}
    for key in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
        stats[key] = m[key] - m0[key]
    return toks, stats


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b-instruct"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    k = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 128
    lines = (ROOT / "humaneval.jsonl").read_text().splitlines()[:batch]
    prompts = [json.loads(line)["prompt"] for line in lines]
    eager_toks, eager = run(model, batch, k, n, True, prompts)
    graph_toks, graph = run(model, batch, k, n, False, prompts)
    diffs = [next((j for j, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), None)
             for x, y in zip(eager_toks, graph_toks, strict=True)]
    print("eager ", eager)
    print("graphs", graph)
    print(f"requests with different tokens: {sum(d is not None for d in diffs)}/{len(diffs)}; first index: {diffs}")


if __name__ == "__main__":
    main()
