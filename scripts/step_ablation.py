"""A/B of one decode step's CUDA-graph replay on the GPU: variants of the kernels side by side in
one process, random weights with a registry model's shapes. Each variant is a patch of module
switches (or a stand-in for one part of the step); its graphs are captured under the patch and the
replays are timed in interleaved rounds, so drift hits every variant alike. Each variant's logits
are compared with the first variant's (a race or a wrong merge shows as a large difference).

    python3 scripts/step_ablation.py --batch-sizes 1,64 --context 256 \
        --variants base,meta-late,no-attention,splits=8,meta-late+splits=8
Variants (comma-separated, the first is the reference; "+" joins patches):
  base               the defaults
  meta-late          attention reads its metadata after the PDL wait (META_EARLY off)
  logits-cast        the LM head's output cast to float32 by a separate kernel
  no-attention       attention replaced by returning q (what attention costs in the step)
  splits=N           attention's split-K factor forced to N
  pps=N              attention's PROGRAMS_PER_SM = N
  splitk=R           the split-K GEMM for up to R rows (linear.SPLITK_MAX_ROWS = R)
  splitk-min=R       the split-K GEMM from R rows (linear.SPLITK_MIN_ROWS = R)
  no-pdl             programmatic dependent launch off
  l2=MB              attention asks L2 for MB of the next gate_up weight (0: off)
  l2rows=N           ... in steps of up to N tokens (l2_prefetch.MAX_ROWS)
  l2seqs=N           ... in steps of up to N sequences (l2_prefetch.MAX_SEQS)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from verispec.bench.models import random_model, shapes_for  # noqa: E402
from verispec.bench.profile import _step_inputs  # noqa: E402
from verispec.kernels import fused, l2_prefetch, linear, pdl  # noqa: E402
from verispec.kernels import paged_attention as pa  # noqa: E402
from verispec.worker.graphs import CudaGraphRunner  # noqa: E402


def patch(model, name: str) -> list[tuple[object, str, object]]:
    """Apply variant `name`; return (object, attribute, old value) to undo it."""
    undo: list[tuple[object, str, object]] = []

    def setv(obj, attr, val):
        undo.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, val)

    for part in name.split("+"):
        _patch_one(model, part, setv)
    return undo


def _patch_one(model, name: str, setv) -> None:
    key, _, arg = name.partition("=")
    if key == "base":
        pass
    elif key == "meta-late":
        setv(pa, "META_EARLY", False)
    elif key == "logits-cast":  # the LM head in x's dtype, then a separate cast kernel to float32
        setv(model, "compute_logits", lambda h: linear.linear(h, model.lm_head_weight).float())
    elif key == "no-attention":
        setv(model, "attn_fn", lambda q, kv, meta, scale: q)
    elif key == "splits":
        n = int(arg)
        setv(pa, "pick_num_splits", lambda num_programs, device: n)
    elif key == "pps":
        setv(pa, "PROGRAMS_PER_SM", int(arg))
    elif key == "splitk":
        setv(linear, "SPLITK_MAX_ROWS", int(arg))
    elif key == "splitk-min":
        setv(linear, "SPLITK_MIN_ROWS", int(arg))
    elif key == "l2":
        setv(l2_prefetch, "PREFETCH_BYTES", int(float(arg) * (1 << 20)))
    elif key == "l2seqs":
        setv(l2_prefetch, "MAX_SEQS", int(arg))
    elif key == "l2rows":
        setv(l2_prefetch, "MAX_ROWS", int(arg))
    elif key == "no-pdl":
        setv(pdl, "_OFF", True)
    else:
        raise SystemExit(f"unknown variant {name!r}")


def unpatch(undo) -> None:
    for obj, attr, old in reversed(undo):
        setattr(obj, attr, old)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--query-len", type=int, default=1)
    ap.add_argument("--variants", default="base,meta-late,no-attention")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = shapes_for(args.model)
    model = random_model(cfg, dev, torch.bfloat16)
    fused.enable_triton(model, True)
    names = args.variants.split(",")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        kv, ids, pos, meta = _step_inputs(model, batch, args.query_len, args.context, 16, dev)
        runners, logits = {}, {}
        for name in names:
            undo = patch(model, name)
            try:
                g = CudaGraphRunner(model, kv, max_batch=batch, query_lens=(args.query_len,), block_size=16,
                                    max_blocks_per_seq=meta.block_tables.shape[1], with_logits=True,
                                    progress=False, lazy=True)
                out = g.run(ids, pos, meta, batch, args.query_len)
                logits[name] = out.logits[: batch * args.query_len].float().clone()
            finally:
                unpatch(undo)
            runners[name] = g
        times: dict[str, list[float]] = {n: [] for n in names}
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(args.rounds):
            for name in names:  # a replay runs the captured kernels: no patch needed now
                g = runners[name]
                for _ in range(5):
                    g.run(ids, pos, meta, batch, args.query_len)
                a.record()
                for _ in range(args.reps):
                    g.run(ids, pos, meta, batch, args.query_len)
                b.record()
                torch.cuda.synchronize()
                times[name].append(a.elapsed_time(b) * 1e3 / args.reps)
        ref = logits[names[0]]
        print(f"batch {batch} x query {args.query_len} at context {args.context}: replay us (median of "
              f"{args.rounds} rounds of {args.reps}), max |logit - {names[0]}|")
        for name in names:
            t = times[name]
            diff = (logits[name] - ref).abs().max().item()
            print(f"  {name:<16} {statistics.median(t):8.1f} us  (min {min(t):7.1f}, max {max(t):7.1f})  "
                  f"diff {diff:.3g}")
        del runners, logits
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
