"""The plain-torch reference attention against a loop written from the definition: per sequence, per
query head, softmax over the keys it may see. The reference's shortcuts (the host flags ref_unpadded /
ref_all_visible, GQA without repeating K/V) must give the definition's numbers on every step shape."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from verispec.attention.reference import build_reference_indices, reference_attention


def naive(q, kv, shapes, tables, block_size, scale, causal=True, kv_starts=None):
    """q [T, H, D]; shapes [(q_len, seq_len)]: query i of a sequence sits at seq_len - q_len + i (causal) and
    sees keys lo..its position (not causal: lo..seq_len - 1)."""
    heads, kv_heads = q.shape[1], kv.shape[2]
    out, t = [], 0
    for b, (ql, sl) in enumerate(shapes):
        slots = [tables[b][p // block_size] * block_size + p % block_size for p in range(sl)]
        k, v = kv[0][slots], kv[1][slots]  # [sl, KH, D]
        lo = kv_starts[b] if kv_starts else 0
        for i in range(ql):
            hi = sl - ql + i if causal else sl - 1
            row = []
            for h in range(heads):
                kh = h // (heads // kv_heads)
                s = (k[lo: hi + 1, kh] @ q[t + i, h]) * scale
                row.append(torch.softmax(s, 0) @ v[lo: hi + 1, kh])
            out.append(torch.stack(row))
        t += ql
    return torch.stack(out)


CASES = {
    "decode one sequence": [(1, 37)],
    "decode, equal lengths": [(1, 20), (1, 20), (1, 20)],
    "decode, unequal lengths": [(1, 5), (1, 33), (1, 17)],
    "verify, equal": [(4, 40), (4, 40)],
    "verify, unequal": [(3, 9), (5, 30)],
    "prefill one sequence": [(23, 23)],
    "prefill and decode": [(11, 11), (1, 29)],
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)])
def test_reference_matches_the_definition(name, heads, kv_heads):
    shapes, bs, d = CASES[name], 8, 16
    rng = random.Random(name)
    need = sum(math.ceil(sl / bs) for _, sl in shapes)
    perm = list(range(need + 2))
    rng.shuffle(perm)
    tables = [[perm.pop() for _ in range(math.ceil(sl / bs))] for _, sl in shapes]
    g = torch.Generator().manual_seed(len(name))
    kv = torch.randn(2, (need + 2) * bs, kv_heads, d, generator=g)
    q = torch.randn(sum(ql for ql, _ in shapes), heads, d, generator=g)
    ref = build_reference_indices([ql for ql, _ in shapes], [sl for _, sl in shapes], tables, bs, "cpu")
    got = reference_attention(q, kv, SimpleMeta(**ref), 0.3)
    torch.testing.assert_close(got, naive(q, kv, shapes, tables, bs, 0.3), atol=1e-5, rtol=1e-5)
    # Without the shortcuts (the flags off: the gathers and the mask read in full), the same numbers.
    slow = reference_attention(q, kv, SimpleMeta(**{**ref, "ref_unpadded": False, "ref_all_visible": False}), 0.3)
    torch.testing.assert_close(got, slow, atol=0, rtol=0)


@pytest.mark.parametrize("kv_starts", [None, [0, 3]])
def test_bidirectional_blocks(kv_starts):
    """Not causal (DFlash's drafter blocks): every query sees its sequence's keys from kv_start on."""
    shapes, bs = [(4, 12), (4, 12)], 4
    tables = [[0, 1, 2], [5, 4, 3]]
    g = torch.Generator().manual_seed(3)
    kv, q = torch.randn(2, 24, 2, 8, generator=g), torch.randn(8, 4, 8, generator=g)
    ref = build_reference_indices([4, 4], [12, 12], tables, bs, "cpu", causal=False, kv_starts=kv_starts)
    assert ref["ref_all_visible"] is (kv_starts is None)
    got = reference_attention(q, kv, SimpleMeta(**ref), 0.5)
    torch.testing.assert_close(got, naive(q, kv, shapes, tables, bs, 0.5, causal=False, kv_starts=kv_starts),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(40))
def test_flags_say_what_the_tensors_say(seed):
    """ref_unpadded holds exactly when q_pad_idx is the identity grid; ref_all_visible exactly when the
    mask is all True and the step is unpadded (random step shapes)."""
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    qls = [rng.choice([1, 1, 2, 5]) for _ in range(n)]
    if rng.random() < 0.5:
        qls = [qls[0]] * n
    sls = [ql + rng.choice([0, 3, 3, 9]) for ql in qls]
    if rng.random() < 0.5:
        sls = [max(sls)] * n if all(q == 1 for q in qls) else sls
    tables = [list(range(i * 8, i * 8 + math.ceil(sl / 4))) for i, sl in enumerate(sls)]
    ref = build_reference_indices(qls, sls, tables, 4, "cpu")
    identity = ref["q_pad_idx"].flatten().tolist() == list(range(sum(qls)))
    assert ref["ref_unpadded"] is identity
    assert ref["ref_all_visible"] is (identity and bool(ref["attn_mask"].all()))


@dataclasses.dataclass
class SimpleMeta:
    """The fields reference_attention reads."""

    kv_gather_idx: torch.Tensor
    q_pad_idx: torch.Tensor
    q_unpad_idx: torch.Tensor
    attn_mask: torch.Tensor
    q_positions: torch.Tensor
    ref_unpadded: bool
    ref_all_visible: bool
