"""A/B of one decode step's CUDA-graph replay on the GPU: variants of the kernels side by side in
one process, random weights with a registry model's shapes. Each variant is a KernelOptions
(verispec/core/options.py) the model is switched onto (or a stand-in for one part of the step); its
graphs are captured under it and the replays are timed in interleaved rounds, so drift hits every
variant alike. Each variant's logits are compared with the first variant's (a race or a wrong merge
shows as a large difference).

    python3 scripts/step_ablation.py --batch-sizes 1,64 --context 256 \
        --variants base,no-attention,splits=8,no-pdl+splits=8
    python3 scripts/step_ablation.py --batch-sizes 1 --context 1024 --query-len 1,4,8,16 \
        --variants base,small-m=16    # verify / decode with and without the small-M kernels
Variants (comma-separated, the first is the reference; "+" joins parts):
  base               the defaults
  logits-cast        the LM head's output cast to float32 by a separate kernel (a stand-in)
  no-attention       attention replaced by returning q (what attention costs in the step; a stand-in)
  splits=N           attention's split-K factor forced to N (attn_num_splits)
  pps=N              attention's split-K target: N programs per SM (attn_programs_per_sm)
  splitk=R           the split-K GEMM for up to R rows (splitk_max_rows; 0: off)
  splitk-min=R       the split-K GEMM from R rows (splitk_min_rows)
  no-pdl             programmatic dependent launch off (pdl)
  gemv=R             the GEMV and the fused layer path for steps of up to R rows (gemv_max_rows)
  small-splitk       2..16 rows of down_proj through the split-K kernel, not cuBLAS (small_splitk)
  small-m=R          2..R rows (R <= 16) on the small-M tensor-core kernels and the fused layer path
                     (small_m_max_rows; kernels/small_m.py)
  fused-qkv=R        2..R rows: only the norm + qkv + rotary + K/V write fused, in the one-row family's kernel
                     (fused_qkv_max_rows)
  l2=MB              attention asks L2 for MB of the next gate_up weight (l2_prefetch_bytes; 0: off)
  l2rows=N           ... in steps of up to N tokens (l2_prefetch_max_rows)
  l2seqs=N           ... in steps of up to N sequences (l2_prefetch_max_seqs)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from verispec.attention.triton import TritonBackend  # noqa: E402
from verispec.bench.models import random_model, shapes_for  # noqa: E402
from verispec.bench.profile import _step_inputs  # noqa: E402
from verispec.core.options import KernelOptions  # noqa: E402
from verispec.kernels import linear  # noqa: E402
from verispec.models.kernel_path import enable_triton  # noqa: E402
from verispec.worker.graphs import CudaGraphRunner  # noqa: E402

FIELDS = {"splits": ("attn_num_splits", int), "pps": ("attn_programs_per_sm", int),
          "splitk": ("splitk_max_rows", int), "splitk-min": ("splitk_min_rows", int),
          "gemv": ("gemv_max_rows", int), "small-m": ("small_m_max_rows", int),
          "fused-qkv": ("fused_qkv_max_rows", int),
          "l2": ("l2_prefetch_bytes", lambda mb: int(float(mb) * (1 << 20))),
          "l2rows": ("l2_prefetch_max_rows", int), "l2seqs": ("l2_prefetch_max_seqs", int)}


class NoAttention(TritonBackend):
    """The Triton backend with attention replaced by returning q (its K/V write stays)."""

    def forward(self, q, kv_cache, meta, scale, prefetch=None, window=0):
        return q


def variant(model, name: str) -> None:
    """Switch `model` onto variant `name`: its KernelOptions, then its stand-ins."""
    opts, standins = KernelOptions(), []
    for part in name.split("+"):
        key, _, arg = part.partition("=")
        if key == "base":
            pass
        elif key == "no-pdl":
            opts = dataclasses.replace(opts, pdl=False)
        elif key == "small-splitk":
            opts = dataclasses.replace(opts, small_splitk=True)
        elif key in FIELDS:
            field, parse = FIELDS[key]
            opts = dataclasses.replace(opts, **{field: parse(arg)})
        elif key in ("logits-cast", "no-attention"):
            standins.append(key)
        else:
            raise SystemExit(f"unknown variant {name!r}")
    enable_triton(model, True, options=opts)
    model.__dict__.pop("compute_logits", None)  # the class's method again
    if "logits-cast" in standins:  # the LM head in x's dtype, then a separate cast kernel to float32

        def cast_logits(h, out=None):
            y = linear.linear(h, model.lm_head_weight, options=opts)
            return y.float() if out is None else out.copy_(y)  # copy_ into the float32 buffer: the cast

        model.compute_logits = cast_logits
    if "no-attention" in standins:
        model.attn_backend = NoAttention(opts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--query-len", default="1",
                    help="comma-separated new tokens per sequence (1 + k for a verify); with 1 listed, every "
                         "row also prints its time over the first variant's at query 1 (verify / decode)")
    ap.add_argument("--variants", default="base,no-attention")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = shapes_for(args.model)
    model = random_model(cfg, dev, torch.bfloat16)
    names = args.variants.split(",")
    qlens = [int(q) for q in args.query_len.split(",")]
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        decode_us = None  # the first variant's replay at query 1 (the verify / decode denominator)
        for qlen in qlens:
            med = ablate(model, names, batch, qlen, args, dev)
            if qlen == 1:
                decode_us = med[names[0]]
            if decode_us is not None:
                print("  verify / decode: " + ", ".join(f"{n} {med[n] / decode_us:.3f}" for n in names))
    return 0


def ablate(model, names: list[str], batch: int, qlen: int, args, dev) -> dict[str, float]:
    """Capture every variant's graph for `batch` sequences of `qlen` new tokens, time the replays in
    interleaved rounds and print them; returns each variant's median replay in us."""
    kv, ids, pos, meta = _step_inputs(model, batch, qlen, args.context, 16, dev)
    runners, logits = {}, {}
    for name in names:
        variant(model, name)  # the graph runner stages with the model's options
        g = CudaGraphRunner(model, kv, max_batch=batch, query_lens=(qlen,), block_size=16,
                            max_blocks_per_seq=meta.block_tables.shape[1], with_logits=True,
                            progress=False, lazy=True)
        out = g.run(ids, pos, meta, batch, qlen)
        logits[name] = out.logits[: batch * qlen].float().clone()
        runners[name] = g
    variant(model, "base")
    times: dict[str, list[float]] = {n: [] for n in names}
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(args.rounds):
        for name in names:  # a replay runs the captured kernels (and stages with its runner's options)
            g = runners[name]
            for _ in range(5):
                g.run(ids, pos, meta, batch, qlen)
            a.record()
            for _ in range(args.reps):
                g.run(ids, pos, meta, batch, qlen)
            b.record()
            torch.cuda.synchronize()
            times[name].append(a.elapsed_time(b) * 1e3 / args.reps)
    ref = logits[names[0]]
    print(f"batch {batch} x query {qlen} at context {args.context}: replay us (median of "
          f"{args.rounds} rounds of {args.reps}), max |logit - {names[0]}|")
    for name in names:
        t = times[name]
        diff = (logits[name] - ref).abs().max().item()
        print(f"  {name:<16} {statistics.median(t):8.1f} us  (min {min(t):7.1f}, max {max(t):7.1f})  "
              f"diff {diff:.3g}", flush=True)
    del runners, logits
    torch.cuda.empty_cache()
    return {n: statistics.median(times[n]) for n in names}
    return 0


if __name__ == "__main__":
    sys.exit(main())
