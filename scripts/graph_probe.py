"""Verify-shaped CUDA graphs on the H200: is a graph replay equal to the same padded forward run
eagerly (it must be bitwise: same kernels, same shapes), and how far is either from the unpadded
eager forward and from the torch reference? Random weights, Qwen2.5-1.5B shapes.

    python3 scripts/graph_probe.py
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from verispec.bench.models import random_model, shapes_for  # noqa: E402
from verispec.models.kernel_path import enable_triton  # noqa: E402
from verispec.worker.graphs import CudaGraphRunner  # noqa: E402
from verispec.worker.inputs import SeqChunk, allocate_kv_cache, build_batch  # noqa: E402

DEV, BS, NUM_BLOCKS = torch.device("cuda"), 16, 2048


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6)).item()


def main() -> int:
    cfg = shapes_for("qwen2.5-coder-1.5b-instruct")
    model = random_model(cfg, DEV, torch.bfloat16)
    kv = allocate_kv_cache(cfg.num_layers, NUM_BLOCKS, BS, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, DEV)
    enable_triton(model, True)
    g = CudaGraphRunner(model, kv, max_batch=16, query_lens=(1, 5), block_size=BS, max_blocks_per_seq=128,
                        with_logits=True)
    p = CudaGraphRunner(model, kv, max_batch=16, query_lens=(1, 5), block_size=BS, max_blocks_per_seq=128,
                        with_logits=True, capture=False)
    rng = random.Random(0)
    bad = 0
    for n, q in [(1, 1), (3, 1), (1, 5), (2, 5), (3, 5), (4, 5), (5, 5), (11, 5), (16, 5)]:
        perm = list(range(NUM_BLOCKS - 1))
        rng.shuffle(perm)
        chunks = []
        for _ in range(n):
            sl = rng.randint(q + 1, 1500)
            chunks.append(SeqChunk([rng.randrange(cfg.vocab_size) for _ in range(q)], sl - q,
                                   [perm.pop() for _ in range(-(-sl // BS))]))
        ids, pos, meta = build_batch(chunks, BS, DEV)
        og = g.run(ids, pos, meta, n, q)
        hg, lg = og.hidden.clone(), og.logits.clone()
        op = p.run(ids, pos, meta, n, q)
        hp, lp = op.hidden.clone(), op.logits.clone()
        he, _ = model(ids, pos, meta, kv)
        le = model.compute_logits(he)
        enable_triton(model, False)
        hr, _ = model(ids, pos, meta, kv)
        enable_triton(model, True)
        same = torch.equal(hg, hp) and torch.equal(lg, lp)
        agree = (lg.argmax(-1) == le.argmax(-1)).float().mean().item()
        print(f"n={n:2d} q={q}: graph==padded-eager {same} | rel(graph, padded) {rel(hg, hp):.1e} "
              f"rel(padded, eager) {rel(hp, he):.1e} rel(eager, torch ref) {rel(he, hr):.1e} "
              f"rel(graph, torch ref) {rel(hg, hr):.1e} | argmax agree graph/eager {agree:.3f}", flush=True)
        bad += not same
    print("verdict:", "graph replay equals its padded eager forward everywhere" if not bad
          else f"{bad} shapes where the replay differs from its padded eager forward (capture bug)")
    return int(bad > 0)


if __name__ == "__main__":
    raise SystemExit(main())
