"""Probe: Triton paged attention with verify shapes (q > 1) vs the torch reference, for every batch
size 1..8 and split-K settings, on CUDA (bf16). Prints the worst relative error per case."""

import random

import torch

from verispec.attention.reference import reference_attention
from verispec.kernels import paged_attention as pa
from verispec.worker.inputs import SeqChunk, allocate_kv_cache, build_batch

torch.manual_seed(0)
dev = torch.device("cuda")
H, KH, D, BS, NB = 12, 2, 128, 16, 2048
kv = allocate_kv_cache(1, NB, BS, KH, D, torch.bfloat16, dev)[0]
kv.normal_()
rng = random.Random(0)
for q in (1, 2, 5, 9):
    for b in range(1, 9):
        for splits in (None, 1):
            worst = 0.0
            for _ in range(3):
                perm = list(range(NB - 1))
                rng.shuffle(perm)
                chunks = []
                for _ in range(b):
                    sl = rng.randint(q, 1500)
                    chunks.append(SeqChunk([0] * q, sl - q, [perm.pop() for _ in range(-(-sl // BS))]))
                _, _, meta = build_batch(chunks, BS, dev)
                x = torch.randn(b * q, H, D, device=dev, dtype=torch.bfloat16)
                ref = reference_attention(x.float(), kv.float(), meta, D**-0.5)
                got = pa.triton_attention(x, kv, meta, D**-0.5, num_splits=splits).float()
                worst = max(worst, ((got - ref).norm() / ref.norm()).item())
            auto = pa.pick_num_splits(b * KH * pa._tiles(H, KH, q)[2], dev)
            flag = "BAD" if worst > 2e-2 else "ok"
            print(f"{flag} q={q} b={b} splits={splits or f'auto({auto})'}: rel err {worst:.1e}", flush=True)
