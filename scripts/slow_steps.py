"""What the bench's slow steps are: drive one `bench spec` workload (same engine as the bench builds) and
print, for every step slower than 5x the median, what it scheduled (prefill tokens, decoding rows, draft
tokens, the policy's k), whether Python's GC ran inside it and for how long, and then the host functions
whose cumulative time grew most against plain decoding (cProfile over the whole timed run).

    python3 scripts/slow_steps.py --model qwen2.5-coder-1.5b-instruct --prompts prompts/heldout_requests.jsonl \
        --chat --num-prompts 8 --output-len 128 --batch-size 1 --methods none,ngram [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from verispec.bench.drive import drive, greedy, make_engine, sync  # noqa: E402
from verispec.bench.models import BenchSetup, load_bench_model  # noqa: E402
from verispec.bench.spec import bench_prompt_ids, spec_config  # noqa: E402
from verispec.config import EngineConfig  # noqa: E402


class GcClock:
    """Seconds Python's collector ran, by generation, since reset()."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.total = 0.0
        self.runs: list[tuple[int, float]] = []
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
        else:
            dt = time.perf_counter() - self.t0
            self.total += dt
            self.runs.append((info["generation"], dt))

    def take(self) -> list[tuple[int, float]]:
        out, self.runs = self.runs, []
        return out


def traced_run(engine, ids, out_len, device, gcc: GcClock) -> list[dict]:
    """Step the workload; one record per engine.step()."""
    for i, p in enumerate(ids):
        engine.add_request(f"probe-{time.monotonic_ns()}-{i}", None, greedy(out_len), p)
    recs = []
    gcc.take()
    while engine.has_unfinished_requests():
        ts = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - ts
        sched = getattr(engine, "_latest_sched", None)
        rows = sched.scheduled if sched is not None else []
        recs.append(dict(
            s=dt, outs=len(outs), finished=sum(o.finished for o in outs),
            rows=len(rows), prefill=sum(max(0, s.num_new_tokens - 1 - s.num_draft_tokens) for s in rows
                                       if hasattr(s, "num_new_tokens")),
            drafts=sum(getattr(s, "num_draft_tokens", 0) for s in rows),
            gc=gcc.take()))
    sync(device)
    return recs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--methods", default="none,ngram")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--dflash-model", default=None)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--random-weights", action="store_true")
    a = ap.parse_args()
    setup = BenchSetup(EngineConfig(model=a.model, device=a.device, dtype=a.dtype), random_weights=a.random_weights)
    bm = load_bench_model(setup)
    ids, src = bench_prompt_ids(bm, a.prompts, a.num_prompts, a.output_len, a.chat)
    print(f"{len(ids)} prompts from {src}, batch {a.batch_size}, {a.output_len} tokens", flush=True)
    gcc = GcClock()
    stats = {}
    for method in a.methods.split(","):
        dflash = a.dflash_model
        if method == "dflash" and dflash == "random":
            import tempfile

            from verispec.bench.spec import random_drafter
            dflash = random_drafter(bm, tempfile.mkdtemp(prefix="verispec-dflash-"))
        spec = spec_config(method, a.k if method != "dflash" else 15, a.draft_model, dflash, True)
        draft = None
        if method == "draft_model":
            from verispec.bench.spec import load_draft
            draft = load_draft(bm, a.draft_model, None)
        engine = make_engine(bm, spec, a.batch_size, ids, [a.output_len] * len(ids), draft)
        drive(engine, ids, [greedy(a.output_len)] * len(ids), bm.device)  # warm-up, as the bench does
        recs = traced_run(engine, ids, a.output_len, bm.device, gcc)
        med = statistics.median(r["s"] for r in recs)
        slow = [(i, r) for i, r in enumerate(recs) if r["s"] > 5 * med]
        print(f"\n== {method}: {len(recs)} steps, median {1e3 * med:.3f} ms, {len(slow)} slow "
              f"({1e3 * sum(r['s'] for _, r in slow):.1f} ms); gc total {1e3 * sum(d for r in recs for _, d in r['gc']):.1f} ms")
        for i, r in slow[:12]:
            prev = recs[i - 1] if i else None
            print(f"  step {i}: {1e3 * r['s']:.2f} ms rows {r['rows']} prefill~{r['prefill']} drafts {r['drafts']} "
                  f"outs {r['outs']} fin {r['finished']} gc {[(g, round(1e3 * d, 2)) for g, d in r['gc']]} | prev: "
                  f"drafts {prev['drafts'] if prev else '-'} fin {prev['finished'] if prev else '-'}")
        # cProfile over a second timed run
        prof = cProfile.Profile()
        prof.enable()
        traced_run(engine, ids, a.output_len, bm.device, gcc)
        prof.disable()
        stats[method] = pstats.Stats(prof)
        del engine
    base = stats.get("none")
    for method, st in stats.items():
        if method == "none" or base is None:
            continue
        cum_b = {k: v[3] for k, v in base.stats.items()}
        diff = sorted(((v[3] - cum_b.get(k, 0.0), v[1], k) for k, v in st.stats.items()), reverse=True)
        print(f"\n== {method}: host functions whose cumulative time grew most over none")
        for d, ncalls, (f, line, fn) in diff[: a.top]:
            print(f"  +{1e3 * d:9.1f} ms  {ncalls:7d} calls  {Path(f).name}:{line} {fn}")


if __name__ == "__main__":
    main()
