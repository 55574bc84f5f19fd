"""Where a real engine step's GPU time goes: a torch.profiler trace of the engine's own decode loop
(async scheduling, CUDA graphs, staging, sampling, the result copy), random weights with a registry
model's shapes. Steps are cut at the device->host copy of each step's results; for the steady-state
decode steps it prints the median step wall time, the time the GPU was busy, and per kernel name
(graph kernels included) its count and time per step, so the work around the graph shows too.

    python3 scripts/step_trace.py --model qwen2.5-coder-1.5b-instruct --batch 1 --output-len 48 \
        --variants base,old  [--spec self --k 4: a speculative engine's steps]
Variants (comma-separated; "+" joins parts; each gets a fresh engine, traced in turn, on the model
switched onto the variant's KernelOptions, verispec/core/options.py):
  base             the defaults
  torch-stage      the graph's inputs staged by torch copies and fills (stage_kernel=False)
  torch-argmax     torch.argmax instead of the Triton kernels, at any batch size (a stand-in: the
                   argmax threshold is the sampler's, not a kernel option)
  no-l2            no L2 prefetch from the batch-1 attention (l2_prefetch_bytes=0)
  old              torch-stage + torch-argmax (the engine before session 6's changes)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from verispec.bench.drive import drive, greedy, make_engine  # noqa: E402
from verispec.bench.models import BenchSetup, load_bench_model  # noqa: E402
from verispec.bench.profile import category  # noqa: E402
from verispec.config import EngineConfig  # noqa: E402


def gpu_ops(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every kernel / memcpy / memset on the GPU, by start."""
    ops = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            ops.append((e.time_range.start, e.time_range.end, e.name))
    return sorted(ops)


def steps_of(ops: list[tuple[float, float, str]]) -> list[list[tuple[float, float, str]]]:
    """Ops split after each device->host copy (the end of a step)."""
    steps, cur = [], []
    for op in ops:
        cur.append(op)
        if "DtoH" in op[2] or "Device -> Pageable" in op[2] or "Device -> Pinned" in op[2]:
            steps.append(cur)
            cur = []
    return steps


def busy_us(step: list[tuple[float, float, str]]) -> float:
    """Union of the ops' intervals."""
    total, end = 0.0, float("-inf")
    for s, e, _ in step:
        if e > end:
            total += e - max(s, end)
            end = e
    return total


OPTIONS = {"torch-stage": {"stage_kernel": False}, "no-l2": {"l2_prefetch_bytes": 0}}


def variant(model, name: str) -> list[tuple[object, str, object]]:
    """Switch `model` onto variant `name`'s KernelOptions (the engine's runner keeps them) and apply
    its stand-ins; return (object, attribute, old value) to undo the stand-ins."""
    from verispec.core.options import KernelOptions
    from verispec.models.kernel_path import enable_triton
    from verispec.worker import sampler, verifier

    parts = name.split("+")
    if "old" in parts:
        parts = ["torch-stage", "torch-argmax"]
    opts, undo = KernelOptions(), []
    for part in parts:
        if part in OPTIONS:
            opts = dataclasses.replace(opts, **OPTIONS[part])
        elif part == "torch-argmax":  # both callers' view of the threshold: never the kernels
            for mod in (verifier, sampler):
                undo.append((mod, "triton_argmax_ok", mod.triton_argmax_ok))
                mod.triton_argmax_ok = lambda logits: False
        elif part != "base":
            raise SystemExit(f"unknown variant {part!r}")
    if model.lm_head_weight.is_cuda:  # (on a CPU the engine stays on the torch path)
        enable_triton(model, True, options=opts)
    return undo


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--variants", default="base")
    ap.add_argument("--spec", default="none", help="a speculative method (self, ngram): trace its engine steps")
    ap.add_argument("--k", type=int, default=4, help="speculative tokens per step (with --spec)")
    args = ap.parse_args()
    bm = load_bench_model(BenchSetup(EngineConfig(model=args.model), random_weights=True))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, bm.config.vocab_size, (args.input_len,), generator=g).tolist()
               for _ in range(args.batch)]
    rc = 0
    for name in args.variants.split(","):
        undo = variant(bm.model, name)
        try:
            rc |= trace(bm, prompts, args, name)
        finally:
            for obj, attr, old in reversed(undo):
                setattr(obj, attr, old)
    return rc


def trace(bm, prompts: list[list[int]], args, name: str) -> int:
    """Trace one engine's second run of the prompts and print where its decode steps' time goes."""
    from torch.profiler import ProfilerActivity, profile

    lens = [args.output_len] * args.batch
    from verispec.bench.spec import spec_config

    engine = make_engine(bm, spec_config(args.spec, args.k, None), args.batch, prompts, lens)
    params = [greedy(n) for n in lens]
    stream = args.spec != "none"  # final-only runs cannot count a speculative step's tokens
    drive(engine, prompts, params, bm.device, stream=stream)  # compiles, graph capture
    with profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
        drive(engine, prompts, params, bm.device, stream=stream)
    steps = steps_of(gpu_ops(prof))
    decode = [s for s in steps[2:-1] if len(s) > 10]  # past the prefill, before the last
    if len(decode) < 3:
        print(f"too few decode steps traced ({len(steps)} steps; GPU ops are traced on CUDA only)")
        return 1
    walls = [b[-1][1] - a[-1][1] for a, b in zip(decode, decode[1:], strict=False)]
    busy = [busy_us(s) for s in decode[1:]]
    print(f"[{name}] {args.model}, batch {args.batch}: {len(decode)} decode steps traced")
    print(f"  step wall (D2H end to D2H end) median {statistics.median(walls):.1f} us, GPU busy "
          f"{statistics.median(busy):.1f} us, ops per step {statistics.median(len(s) for s in decode):.0f}")
    per_name: dict[str, list[float]] = defaultdict(list)
    for s in decode[1:]:
        for a, b, name in s:
            per_name[name].append(b - a)
    n = len(decode) - 1
    cats: dict[str, float] = defaultdict(float)
    for name, ds in per_name.items():
        cats[category(name)] += sum(ds) / n
    print("  per step by category: " + ", ".join(f"{c} {t:.1f} us" for c, t in sorted(cats.items(), key=lambda x: -x[1])))
    print(f"  {'count/step':>10} {'us/step':>9}  kernel")
    for name, ds in sorted(per_name.items(), key=lambda x: -sum(x[1]))[: args.top]:
        print(f"  {len(ds) / n:10.1f} {sum(ds) / n:9.1f}  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
