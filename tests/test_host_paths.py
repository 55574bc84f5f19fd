"""The host-side fast paths equal their plain definitions: n-gram lookup, cache slots, staging."""

from __future__ import annotations

import random

import torch

from verispec.spec.ngram import ngram_lookup
from verispec.worker.inputs import Staging, extend_slots, padded_tables


def ngram_reference(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_lookup_matches_reference():
    rng = random.Random(0)
    for _ in range(3000):
        length = rng.randrange(0, 50)
        vocab = rng.choice([2, 3, 50, 70000])
        toks = [rng.randrange(vocab) for _ in range(length)]
        if rng.random() < 0.3:  # byte patterns that produce misaligned bytes.rfind hits
            toks = [rng.choice([0, 1, 255, 256, 65536, 2**32]) for _ in range(length)]
        k, lo = rng.randrange(1, 6), rng.randrange(1, 4)
        hi = rng.randrange(lo, 6)
        assert ngram_lookup(toks, k, lo, hi) == ngram_reference(toks, k, lo, hi), (toks, k, lo, hi)


def test_extend_slots_and_tables():
    rng = random.Random(1)
    for _ in range(200):
        bs = rng.choice([1, 4, 16])
        blocks = rng.sample(range(100), 12)
        start = rng.randrange(0, 5 * bs)
        n = rng.randrange(0, len(blocks) * bs - start + 1)
        out: list[int] = []
        extend_slots(out, blocks, start, n, bs)
        assert out == [blocks[p // bs] * bs + p % bs for p in range(start, start + n)]
        one: list[int] = [7]
        extend_slots(one, blocks, start, 1, bs)  # the decode-row fast path
        assert one == [7, blocks[start // bs] * bs + start % bs]
    assert padded_tables([[3, 4], [5]], 3) == [3, 4, 0, 5, 0, 0]


def test_staging_round_trip_and_ring():
    st = Staging(torch.device("cpu"), slots=2, capacity=4)
    first = st.stage([[1, 2, 3], [], [-2]], [[7], [8, 9]])
    assert [None if v is None else v.tolist() for v in first] == [[1, 2, 3], None, [-2], [7], [8, 9]]
    assert first[0].dtype == torch.long and first[3].dtype == torch.int32
    second = st.stage([list(range(20))], [[5] * 9])  # grows its slot; the first step's views stay intact
    assert second[0].tolist() == list(range(20)) and second[1].tolist() == [5] * 9
    assert first[0].tolist() == [1, 2, 3]
