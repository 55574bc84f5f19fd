"""The C paged attention (kernels/cpu_ops.py) of one layer in the 0.5B's shapes (14 query heads, 2 K/V heads, head
dim 64), one sequence, random values: us a layer and ns per key and query head, median of 50.
PYTHONPATH=$PWD python3 scripts/cpu_attention_bench.py"""

from __future__ import annotations

import statistics
import time

import torch

from verispec.core.attention_metadata import AttentionMetadata
from verispec.kernels import cpu_ops


def main() -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 14, 2, 64, 16
    for ctx, queries in ((300, 1), (1000, 1), (1000, 5)):
        blocks = -(-ctx // bs)
        kv = torch.randn(2, blocks * bs + bs, kv_heads, dim)
        q = torch.randn(queries, heads, dim)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(ctx - queries, ctx), query_start_loc=torch.tensor([0, queries], dtype=torch.int32),
            seq_lens=torch.tensor([ctx], dtype=torch.int32), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
            max_query_len=queries, max_seq_len=ctx, block_size=bs)
        for _ in range(3):
            cpu_ops.paged_attention(q, kv, meta, 0.125)
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            cpu_ops.paged_attention(q, kv, meta, 0.125)
            times.append(time.perf_counter() - t0)
        us = 1e6 * statistics.median(times)
        print(f"context {ctx}, {queries} queries: {us:.1f} us a layer, {1e3 * us / (ctx * heads * queries):.2f} ns "
              "per key and query head", flush=True)


if __name__ == "__main__":
    main()
