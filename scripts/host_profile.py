"""Where a decode step's host time goes on the real path (CUDA graphs, the Triton kernels), per method, with the
speculation policy pinned at k = 0: the host work a speculative engine adds to a plain decode step.

For each case (none, ngram, draft_model) an engine of `--batch` requests (bench spec's sizing, random prompt ids,
--output-len tokens each, no EOS) is warmed up through admission, then `--steps` steps run under cProfile. Printed:
the wall time per step without the profiler (median of --rounds blocks of steps), then per function the
difference in own time per step against `none` (the largest first).

    PYTHONPATH=$PWD python3 scripts/host_profile.py --model qwen2.5-coder-1.5b-instruct --device cuda \
        --draft-model qwen2.5-coder-0.5b-instruct --batch 64 --steps 150
    # the host work alone, on this machine's CPU (2-layer random weights: the forward is a small part of a step)
    PYTHONPATH=$PWD python3 scripts/host_profile.py --model qwen2.5-coder-1.5b-instruct --device cpu \
        --draft-model qwen2.5-coder-0.5b-instruct --random-weights --batch 64 --steps 100 --model-overrides \
        '{"hidden_size":64,"intermediate_size":128,"num_layers":2,"num_heads":4,"num_kv_heads":2,"head_dim":16}'
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import time

from verispec.bench.drive import greedy, make_engine, sync
from verispec.bench.models import BenchSetup, load_bench_model, load_draft
from verispec.bench.spec import spec_config
from verispec.config import EngineConfig
from verispec.spec_decode.policy import PolicyParams, SpeculationPolicy


class NeverPays:
    """A step cost under which no draft pays: the policy plans k = 0 every step."""

    def seconds(self, k: int, batch: int) -> float:
        return 1.0 + 10.0 * k


class OnlyPays:
    """A step cost under which exactly k drafts pay: the policy plans k every step it can."""

    def __init__(self, k: int) -> None:
        self.k = k

    def seconds(self, k: int, batch: int) -> float:
        return 1.0 if k == self.k else 1e9


def pin_k(eng, k: int) -> None:
    """Replace an adaptive engine's policy by one that plans k drafts every step (the host work of a
    speculative step, whatever the drafts' acceptance)."""
    eng.policy = SpeculationPolicy(eng.proposer.k, OnlyPays(k), PolicyParams())


def pin_plain(eng) -> None:
    """Replace an adaptive engine's policy by one that plans k = 0 every step and never probes (also
    scripts/host_overhead.py's k0 cases)."""
    never = 10**9
    eng.policy = SpeculationPolicy(eng.proposer.k, NeverPays(), PolicyParams(probe_min=never, probe_max=never))


def build(bm, method: str, draft, args, prompts):
    eng = make_engine(bm, spec_config(method, 4, args.draft_model, None, True), args.batch, prompts,
                      [args.output_len] * len(prompts), draft)
    if eng.policy is not None:
        if args.pin_k:
            pin_k(eng, args.pin_k)
        else:
            pin_plain(eng)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", None, greedy(args.output_len), p)
    while any(not r.output_token_ids for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(10):
        eng.step()
    return eng


def own_times(prof: cProfile.Profile, steps: int) -> dict[str, float]:
    st = pstats.Stats(prof)
    out = {}
    for (f, line, name), (_, _, tt, _, _) in st.stats.items():  # type: ignore[attr-defined]
        out[f"{f.split('site-packages/')[-1].split('verispec/')[-1]}:{line}({name})"] = 1e6 * tt / steps
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--cases", default="none,ngram,draft_model")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--pattern", type=int, default=0,
                    help="prompts that repeat a random pattern of this many ids (ngram then finds drafts); 0: random")
    ap.add_argument("--pin-k", type=int, default=0,
                    help="plan this many drafts every step instead of none (the host work of a speculative step)")
    ap.add_argument("--random-weights", action="store_true",
                    help="random weights in the model's shapes (no model file); with --model-overrides, e.g. a "
                         "tiny model on the CPU, where the host work is most of a step")
    ap.add_argument("--model-overrides", type=json.loads, default=None, help="ModelConfig fields, as JSON")
    args = ap.parse_args()
    bm = load_bench_model(BenchSetup(EngineConfig(model=args.model, device=args.device),
                                     random_weights=args.random_weights, model_overrides=args.model_overrides))
    rng = random.Random(0)
    if args.pattern:
        pats = [[rng.randrange(1000, 30000) for _ in range(args.pattern)] for _ in range(args.batch)]
        prompts = [(p * (args.prompt_len // args.pattern + 1))[: args.prompt_len] for p in pats]
    else:
        prompts = [[rng.randrange(1000, 30000) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    cases = [c for c in args.cases.split(",") if c != "draft_model" or args.draft_model]
    draft = load_draft(bm, args.draft_model, args.model_overrides) if "draft_model" in cases else None
    profiles: dict[str, dict[str, float]] = {}
    for case in cases:
        eng = build(bm, case, draft, args, prompts)
        walls = []
        for _ in range(args.rounds):
            sync(bm.device)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                eng.step()
            sync(bm.device)
            walls.append(1e3 * (time.perf_counter() - t0) / args.steps)
        prof = cProfile.Profile()
        before = (eng.spec.num_drafts, eng.spec.num_draft_tokens)
        prof.enable()
        for _ in range(args.steps):
            eng.step()
        prof.disable()
        profiles[case] = own_times(prof, args.steps)
        rows, drafts = eng.spec.num_drafts - before[0], eng.spec.num_draft_tokens - before[1]
        print(f"{case:12} batch {args.batch}: {statistics.median(walls):.3f} ms a step (rounds {walls}); "
              f"profiled own time {sum(profiles[case].values()) / 1e3:.3f} ms a step; profiled steps verified "
              f"{drafts} drafts in {rows} rows", flush=True)
        del eng
    base = profiles.get("none", {})
    for case in cases:
        if case == "none":
            continue
        prof = profiles[case]
        diff = sorted(((prof.get(k, 0.0) - base.get(k, 0.0), k) for k in set(prof) | set(base)), reverse=True)
        print(f"== {case} - none: {sum(d for d, _ in diff):.1f} us a step of own time (profiled); largest:")
        for d, k in diff[: args.top]:
            print(f"  {d:8.1f} us  {k}")
    top = sorted(((t, k) for k, t in base.items()), reverse=True)[: args.top]
    print("== none: largest own times")
    for t, k in top:
        print(f"  {t:8.1f} us  {k}")


if __name__ == "__main__":
    main()
