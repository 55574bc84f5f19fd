"""Exclusive CPU time per engine phase per step on the tiny model (host only: the forward, logits and
reference attention indices are one FORWARD row), to see where a step's host time goes.

    PYTHONPATH=$PWD python3 scripts/host_phases.py sync|async CASE BATCH STEPS   (CASE: host_overhead.py's)

Each phase is a wrapped method (about 1 us of wrapper per call lands in its caller's row)."""
import collections
import statistics
import sys
import time

loop, case, batch, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, "scripts")
sys.path.insert(0, "tests")
import host_overhead as h  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
from tiny import tiny_config, tiny_engine, tiny_model  # noqa: E402

import verispec.worker.runner as R  # noqa: E402
from verispec import SamplingParams  # noqa: E402

model = tiny_model(tiny_config(vocab=512))
spec = h.CASES[case]
eng = tiny_engine(model, spec=spec, async_scheduling=loop == "async", max_num_seqs=batch, max_num_batched_tokens=4096,
                  num_gpu_blocks=batch * ((64 + steps * 6) // 16 + 4) + 16, gc_freeze=True)
params = SamplingParams(temperature=0.0, max_tokens=steps * 5 + 64, ignore_eos=True)
for i, p in enumerate(h.prompts(batch, 64)):
    eng.add_request(f"r{i}", None, params, p)
for _ in range(5):
    eng.step()
acc = collections.defaultdict(float)
stack = []
def wrap(obj, name, label):
    fn = getattr(obj, name)
    def w(*a, **k):
        t = time.thread_time()
        stack.append(0.0)
        try:
            return fn(*a, **k)
        finally:
            dt = time.thread_time() - t
            inner = stack.pop()
            acc[label] += dt - inner
            if stack:
                stack[-1] += dt
    setattr(obj, name, w)
wrap(eng, "_schedule", "schedule")
wrap(eng.runner, "launch", "launch(other)")
wrap(R, "build_host_batch", "build_host_batch")
wrap(R, "stage_plan", "stage_plan")
wrap(R, "gather_plan", "gather_plan")
wrap(eng.runner.staging, "stage", "staging.stage")
wrap(eng.runner.verifier, "run", "verifier.run")
wrap(eng.runner, "collect", "collect")
wrap(eng, "_commit", "commit")
wrap(eng, "_commit_optimistic", "commit_optimistic")
wrap(eng.scheduler, "commit", "scheduler.commit")
wrap(eng.scheduler, "resolve", "scheduler.resolve")
wrap(eng, "_add_text", "add_text(detok)")
wrap(eng, "_count_acceptance", "count_acceptance")
wrap(eng.scheduler, "publish_rest", "publish_rest")
wrap(eng, "_propose", "propose(other)")
wrap(eng, "_ready", "ready")
if eng.proposer:
    wrap(eng.proposer, "propose", "proposer.propose")
    wrap(eng.proposer, "observe", "proposer.observe")
wrap(eng.scheduler, "reserve", "reserve")
wrap(eng, "_outputs", "outputs")
wrap(eng, "_drain", "drain(other)")
wrap(eng.runner.model, "forward", "FORWARD")
wrap(eng.runner.model, "compute_logits", "FORWARD")
wrap(eng.runner.model.attn_backend, "prepare_metadata", "FORWARD")
t0 = time.thread_time()
for _ in range(steps):
    eng.step()
total = time.thread_time() - t0
acc["step(other)"] = total - sum(acc.values())
host = total - acc["FORWARD"]
print(f"{loop} {case} {batch}: total {1e3*total/steps:.3f} ms/step, host {1e3*host/steps:.3f}")
for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
    print(f"  {k:22} {1e3*v/steps:7.3f} ms  {1e6*v/steps/batch:6.1f} us/req")
lens = [len(d._ids) for g in eng.groups.values() for d in g.detoks]
print("detok window lens: median", statistics.median(lens), "max", max(lens))
print("output lens", statistics.median(len(s.output_token_ids) for g in eng.groups.values() for s in g.seqs))
print("memo size", len(next(iter(eng.groups.values())).detoks[0]._context_lengths.lengths))
