"""What DFlash costs while the adaptive policy plans k = 0 (an untrained drafter), on a tiny random-weight
model (CPU is fine): the DFlash proposer's own host time per step (observe, propose, free_request: CPU
time of the main thread), the drafter context forwards it runs and the rows they write, the drafting
forwards (probes), and the engine's host time per step against method none (model forwards subtracted,
as in host_overhead.py). Requests finish at staggered lengths, so freed requests' context is exercised.

    PYTHONPATH=$PWD python3 scripts/dflash_k0.py [--batch-sizes 1,64] [--steps 300] [--loops sync,async]
        [--profile]

The step cost makes drafts worth a probe (could_pay) but not worth keeping at acceptance 0, so the policy
settles at k = 0 and probes now and then, as on the H200 with `--dflash-model random`.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from host_overhead import ForwardTimer, prompts  # noqa: E402
from tiny import tiny_config, tiny_engine, tiny_model  # noqa: E402

from verispec import SamplingParams  # noqa: E402
from verispec.spec_decode.dflash import save_drafter  # noqa: E402
from verispec.spec_decode.dflash_model import DFlashDrafter, new_config  # noqa: E402


class ProbeWorthy:
    """A step cost under which a draft would pay if accepted (so the policy probes) but k = 0 wins at
    acceptance 0: 1 + 0.3 k (arbitrary units)."""

    def seconds(self, k: int, batch: int) -> float:
        return 1.0 + 0.3 * k


def drafter_path(model, root: Path) -> Path:
    cfg = new_config(model, "tiny", tiny_config().vocab_size - 1, block_size=16, num_layers=1)
    d = DFlashDrafter(cfg)
    d.init_weights(seed=7)
    save_drafter(d, root, torch.float32)
    return root


class Counter:
    """Thread CPU time inside the proposer's bookkeeping entry points, and its drafter forwards."""

    def __init__(self, prop) -> None:
        self.seconds, self.fwd_seconds, self.ctx_forwards, self.ctx_rows, self.draft_forwards = 0.0, 0.0, 0, 0, 0
        self.in_run = False
        for name in ("observe", "propose", "free_request"):
            setattr(prop, name, self._timed(getattr(prop, name)))
        write = prop.drafter.write_context

        def counted_write(feats, positions, slots, kv):
            if self.in_run:  # the drafting step's own inline context write: counted with it
                return write(feats, positions, slots, kv)
            self.ctx_forwards += 1
            self.ctx_rows += int(feats.shape[0])
            t = time.thread_time()
            try:
                return write(feats, positions, slots, kv)
            finally:
                self.fwd_seconds += time.thread_time() - t

        prop.drafter.write_context = counted_write
        run = prop.step.run

        def counted_run(rows, captured, sources):
            self.draft_forwards += 1
            t = time.thread_time()
            self.in_run = True
            try:
                return run(rows, captured, sources)
            finally:
                self.in_run = False
                self.fwd_seconds += time.thread_time() - t

        prop.step.run = counted_run

    def _timed(self, fn):
        def timed(*a, **kw):
            t = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.thread_time() - t

        return timed


def measure(model, path: Path | None, batch: int, async_scheduling: bool, steps: int, profile: bool) -> dict:
    spec = None if path is None else {"method": "dflash", "model": str(path), "num_speculative_tokens": 4,
                                      "adaptive": True}
    eng = tiny_engine(model, spec=spec, step_cost=ProbeWorthy() if spec else None, async_scheduling=async_scheduling,
                      max_num_seqs=batch, max_num_batched_tokens=4096,
                      num_gpu_blocks=2 * batch * ((64 + steps + 40) // 16 + 2) + 32)
    counter = Counter(eng.proposer) if spec else None
    # Requests of staggered lengths, replaced as they finish: the batch stays full and requests free often.
    n_req = [0]

    def add() -> None:
        i = n_req[0]
        n_req[0] += 1
        params = SamplingParams(temperature=0.0, max_tokens=24 + (i * 37) % 96, ignore_eos=True)
        eng.add_request(f"r{i}", None, params, prompts(i + 1, 48)[-1])

    for _ in range(batch):
        add()
    for _ in range(5):
        eng.step()
    timer = ForwardTimer(eng.runner.model)
    if counter:
        counter.seconds, counter.fwd_seconds, counter.ctx_forwards, counter.ctx_rows, counter.draft_forwards = (
            0.0, 0.0, 0, 0, 0)
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    t0 = time.thread_time()
    for _ in range(steps):
        for out in eng.step():
            if out.finished:
                add()
    total = time.thread_time() - t0
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats("dflash|policy|placeholder|inputs", 30)
    timer.close()
    fwd = counter.fwd_seconds if counter else 0.0  # the drafter's forwards (compute on the CPU)
    row = {"host_ms": 1e3 * (total - timer.seconds - fwd) / steps}
    if counter:
        row.update(prop_ms=1e3 * (counter.seconds - counter.fwd_seconds) / steps, fwd_ms=1e3 * counter.fwd_seconds / steps,
                   ctx_fwd=counter.ctx_forwards, ctx_rows=counter.ctx_rows,
                   draft_fwd=counter.draft_forwards, drafts=eng.get_metrics()["spec_decode_num_draft_tokens"])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--loops", default="sync,async")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = tiny_model()
    with tempfile.TemporaryDirectory() as tmp:
        path = drafter_path(model, Path(tmp))
        for loop in a.loops.split(","):
            for b in (int(x) for x in a.batch_sizes.split(",")):
                rows = {}
                for name, p in (("none", None), ("dflash", path)):
                    runs = [measure(model, p, b, loop == "async", a.steps, a.profile) for _ in range(a.repeats)]
                    rows[name] = min(runs, key=lambda r: r["host_ms"])
                    rows[name]["prop_ms"] = min(r.get("prop_ms", 0.0) for r in runs)
                d, n = rows["dflash"], rows["none"]
                print(f"{loop:5s} batch {b:3d}: host ms/step none {n['host_ms']:.3f} dflash {d['host_ms']:.3f} "
                      f"(+{d['host_ms'] - n['host_ms']:.3f}); proposer {d['prop_ms']:.3f} ms/step (drafter forwards "
                      f"{d['fwd_ms']:.3f} more); "
                      f"context forwards {d['ctx_fwd']} ({d['ctx_rows']} rows), drafting forwards {d['draft_fwd']}, "
                      f"drafts {d['drafts']} in {a.steps} steps", flush=True)


if __name__ == "__main__":
    main()
