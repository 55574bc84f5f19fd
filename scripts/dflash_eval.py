"""Evaluate a DFlash drafter in the engine against no speculation on HumanEval prompts.

usage: python scripts/dflash_eval.py TARGET.gguf DRAFTER_DIR [--k 15] [--prompts humaneval.jsonl] [--last 8] [--chat]
Prints batch-1 and batch-16 tok/s, the acceptance length tau and acceptance per position, and how
many outputs equal the no-speculation outputs (greedy). Then the training-side estimate of the same
run (train/loop.py::engine_walk: teacher-forced features, training's block forward, over the engine's
own outputs): equal to the engine's tau unless the engine drafts differently from training (then it
is a train/inference mismatch; otherwise a low tau is the drafter's, e.g. prompts unlike its data).
--chat renders the prompts as `train-drafter` renders its training prompts (chat template); the
default feeds HumanEval's raw completion prompts, which training never sees."""

import argparse
import json
import time

from verispec import LLM, SamplingParams
from verispec.train.data import render_prompts
from verispec.train.loop import engine_walk


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("drafter")
    ap.add_argument("--k", type=int, default=15)
    ap.add_argument("--prompts", default="humaneval.jsonl")
    ap.add_argument("--last", type=int, default=8, help="use the last N prompts (never seen in training)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--chat", action="store_true", help="chat-template the prompts like the training prompts")
    a = ap.parse_args()
    ps = [json.loads(line)["prompt"] for line in open(a.prompts)][-a.last :]
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    res = {}
    for name, spec in [("none", None), ("dflash", {"method": "dflash", "model": a.drafter, "num_speculative_tokens": a.k})]:
        llm = LLM(a.target, device="cuda", max_model_len=4096, speculative_config=spec, max_num_seqs=16)
        if a.chat and name == "none":  # rendered once, with the first engine's tokenizer
            ps = render_prompts(llm.tokenizer, ps)
        llm.generate(ps[:1], sp)  # warm-up
        m0 = llm.get_metrics()
        t = time.time()
        outs = [llm.generate([p], sp)[0] for p in ps]
        dt = time.time() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        m = llm.get_metrics()
        d = m["spec_decode_num_drafts"] - m0["spec_decode_num_drafts"]
        acc = m["spec_decode_num_accepted_tokens"] - m0["spec_decode_num_accepted_tokens"]
        base = m0["spec_decode_num_accepted_tokens_per_pos"] + [0] * 32
        per = [x - y for x, y in zip(m["spec_decode_num_accepted_tokens_per_pos"], base, strict=False)]
        res[name] = [o.outputs[0].token_ids for o in outs]
        print(f"{name}: batch1 {n / dt:.1f} tok/s; tau={1 + acc / max(d, 1):.2f} per-pos={[round(x / max(d, 1), 2) for x in per]}")
        if name == "dflash":
            w = engine_walk(llm.engine, [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs], a.k)
            print(f"dflash, training-side estimate on these outputs: tau={w['tau']:.2f} per-pos={w['accepted_per_pos']}")
        t = time.time()
        outs = llm.generate(ps * 2, sp)
        print(f"{name}: batch{2 * len(ps)} {sum(len(o.outputs[0].token_ids) for o in outs) / (time.time() - t):.1f} tok/s")
        del llm
    same = sum(x == y for x, y in zip(res["none"], res["dflash"], strict=True))
    print(f"identical to no speculation: {same} / {len(ps)}")


if __name__ == "__main__":
    main()
