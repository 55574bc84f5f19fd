"""Triton paged causal attention (decode, verify, varlen prefill): the kernels behind attention/triton.py.

CUDA-graph contract (read this before capturing a graph around these functions):
  * Every value that changes from step to step is read by the kernels from device tensors of
    AttentionMetadata: query_start_loc [B+1], seq_lens [B], block_tables [B, max_blocks] and
    slot_mapping [T]. Nothing per-step is baked into a launch as a Python int.
  * The launch itself depends only on shapes and on two Python ints that are fixed for a
    captured graph: meta.max_query_len (picks the query tile and the grid's query-tile count;
    a graph must only be replayed for steps whose every sequence has exactly that query length)
    and meta.block_size (an engine constant). meta.max_seq_len is never used, and the split-K
    factor depends only on shapes, so a graph replays correctly for any context length.
  * Batch-invariant mode (KernelOptions.batch_invariant): one query tile size for every query length,
    and split s holds keys [s * invariant_kv_split, (s + 1) * invariant_kv_split) of its sequence, for
    as many splits as the block table's width holds keys (a shape); the splits are merged in order. So
    a query's result depends on its sequence's keys only: not on the other sequences, its own query
    count (decode, verify, prefill chunk) or the block table's width.
  * Sequence b's queries are tokens [query_start_loc[b], query_start_loc[b+1]); query i of a
    sequence with q_len queries sees context positions [0, seq_len - q_len + i]. A sequence whose
    query tokens have no visible key (e.g. a padding row with seq_len 0) gets zeros, never NaN.
  * meta.causal=False (a Python bool, fixed per graph): every query sees [0, seq_len) (the DFlash
    drafter's block attends bidirectionally). meta.kv_start [B] (optional): sequence b's keys
    below kv_start[b] are invisible.
  * Tokens whose slot_mapping entry is negative are not written to the cache.
  * window (a Python int, a per-layer constant, so fixed per captured launch; 0: off): a query at
    position p sees no key at a position <= p - window (Gemma 3's local layers). The key loop
    starts at the tile's first visible key, so a local layer reads at most window + BLOCK_Q keys.

Layout: q [T, H, D]; one layer's cache [2, num_slots, KH, D] with slot = block_id * block_size +
offset. The H / KH query heads sharing a KV head are packed into one tile with the queries, so
each program reads its KV head's context once. Accumulation is float32 (online softmax in base 2).
With TRITON_INTERPRET=1 (tests on a machine without CUDA) the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from verispec.core import envs
from verispec.core.attention_metadata import AttentionMetadata
from verispec.core.options import DEFAULT_OPTIONS, KernelOptions
from verispec.kernels.l2_prefetch import Regions, prefetch_regions, prefetch_supported
from verispec.kernels.pdl import launch_kwargs, wait_prior

MAX_SPLITS = 32
POISON_SCRATCH = False  # tests: fill split-K partial buffers with NaN so unwritten entries show
_INTERPRET = envs.triton_interpret()  # read when triton is: at import
_NUM_SMS: dict[int, int] = {}


@triton.jit
def _tile_slots(bt_ptr, start, lo_key, hi, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Cache slots of keys [start, start + BLOCK_N) ∩ [lo_key, hi) (0 where outside)."""
    n = start + tl.arange(0, BLOCK_N)
    n_ok = (n < hi) & (n >= lo_key)
    blk = tl.load(bt_ptr + n // PAGE, mask=n_ok, other=0)
    return blk.to(tl.int64) * PAGE + n % PAGE


@triton.jit
def _softmax_step(q, kt, n, n_ok, qpos, m_i, l_i, scale_log2, DOT_PREC: tl.constexpr, WINDOW: tl.constexpr):
    """The online-softmax update for one tile of keys kt [D, BLOCK_N] at positions n: returns the
    probabilities p, the rescale factor of the old accumulator, the new running max and sum.
    WINDOW > 0: keys at positions <= qpos - WINDOW are masked too."""
    s = tl.dot(q, kt, input_precision=DOT_PREC) * scale_log2
    visible = n_ok[None, :] & (n[None, :] <= qpos[:, None])
    if WINDOW > 0:
        visible = visible & (n[None, :] > qpos[:, None] - WINDOW)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _attn_tile(q, k_ptr, v_ptr, slot, start, lo_key, hi, qpos, d, m_i, l_i, acc, scale_log2, stride_kvs,
               BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, EARLY_V: tl.constexpr, WINDOW: tl.constexpr):
    """One BLOCK_N-key step of the online softmax over keys [start, start + BLOCK_N) ∩ [lo_key, hi),
    whose cache slots the caller loaded (one tile ahead, so the block-table read is off the path).
    EARLY_V: issue the V load with the K load (decode / verify, where a program sees few tiles and
    the two memory round trips would otherwise run one after the other)."""
    n = start + tl.arange(0, BLOCK_N)
    n_ok = (n < hi) & (n >= lo_key)
    kt = tl.load(k_ptr + slot[None, :] * stride_kvs + d[:, None], mask=n_ok[None, :], other=0.0)
    if EARLY_V:
        v = tl.load(v_ptr + slot[:, None] * stride_kvs + d[None, :], mask=n_ok[:, None], other=0.0)
    p, alpha, m_new, l_i = _softmax_step(q, kt, n, n_ok, qpos, m_i, l_i, scale_log2, DOT_PREC, WINDOW)
    if not EARLY_V:
        v = tl.load(v_ptr + slot[:, None] * stride_kvs + d[None, :], mask=n_ok[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _attend_split(q_ptr, k_base, v_base, out_ptr, po_ptr, pm_ptr, pl_ptr, bt_row, token, head, row_ok, qpos, d,
                  lo, hi, lo_key, slot, split, store_ok, has_keys, scale_log2, num_tokens, stride_qt, stride_qh,
                  stride_kvs, stride_ot, stride_oh,
                  NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PREC: tl.constexpr, WHILE_LOOP: tl.constexpr,
                  EARLY_V: tl.constexpr, WINDOW: tl.constexpr):
    """One split of one query tile: the online softmax over keys [lo, hi) (slot: the first tile's cache
    slots, loaded by the caller), then the output (one split) or the split's partials. store_ok: this
    split exists; has_keys: its acc is stored (else only its (m, l))."""
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & has_keys, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if WHILE_LOOP:  # the interpreter cannot take tensor bounds in range() (numpy 2)
        start = lo
        while start < hi:
            nxt = _tile_slots(bt_row, start + BLOCK_N, lo_key, hi, BLOCK_N, PAGE)
            m_i, l_i, acc = _attn_tile(q, k_base, v_base, slot, start, lo_key, hi, qpos, d, m_i, l_i, acc,
                                       scale_log2, stride_kvs, BLOCK_N, DOT_PREC, EARLY_V, WINDOW)
            slot = nxt
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            nxt = _tile_slots(bt_row, start + BLOCK_N, lo_key, hi, BLOCK_N, PAGE)
            m_i, l_i, acc = _attn_tile(q, k_base, v_base, slot, start, lo_key, hi, qpos, d, m_i, l_i, acc,
                                       scale_log2, stride_kvs, BLOCK_N, DOT_PREC, EARLY_V, WINDOW)
            slot = nxt

    ok = row_ok & store_ok
    out_rows = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_rows, o.to(out_ptr.dtype.element_ty), mask=ok[:, None])
    else:
        row = (split * num_tokens + token) * NUM_HEADS + head  # partials: [S, T, H, (D)]
        tl.store(po_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=ok[:, None] & has_keys)
        tl.store(pm_ptr + row, m_i, mask=ok)
        tl.store(pl_ptr + row, l_i, mask=ok)


@triton.jit
def _attn_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, po_ptr, pm_ptr, pl_ptr,
    qsl_ptr, seq_lens_ptr, bt_ptr, kv_start_ptr,
    scale_log2, num_tokens,
    stride_qt, stride_qh, stride_kvs, stride_kvh, stride_ot, stride_oh, stride_bt,
    pf_a0, pf_n0, pf_a1, pf_n1,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PREC: tl.constexpr, WHILE_LOOP: tl.constexpr, CAUSAL: tl.constexpr, HAS_KV_START: tl.constexpr,
    EARLY_V: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr, WINDOW: tl.constexpr,
    FIXED_SPLIT: tl.constexpr, SPLIT_PROGRAMS: tl.constexpr, SPLIT_ITERS: tl.constexpr,
):
    """Grid (sequences [+ 1 prefetch row], KV heads, query tiles x SPLIT_PROGRAMS).

    FIXED_SPLIT == 0: NUM_SPLITS == SPLIT_PROGRAMS splits, one per program, cutting the keys the query
    tile sees into equal parts. FIXED_SPLIT > 0 (batch-invariant mode): split s covers keys
    [s * FIXED_SPLIT, (s + 1) * FIXED_SPLIT) of its sequence whatever the step, its key tiles at
    multiples of BLOCK_N; program p does splits p, p + SPLIT_PROGRAMS, ... (SPLIT_ITERS of them), so how
    many programs share the work (a shape choice) never changes a split; an empty split stores only its
    (m, l) = (-inf, 0)."""
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    b = tl.program_id(0)
    if PREFETCH:  # the grid's last row of programs: L2 prefetch of the next weights, then exit
        if b == tl.num_programs(0) - 1:
            prefetch_regions(pf_a0, pf_n0, pf_a1, pf_n1, tl.program_id(1) * tl.num_programs(2) + tl.program_id(2),
                             tl.num_programs(1) * tl.num_programs(2), 32 * 4)
            return
    kvh = tl.program_id(1)
    qt = tl.program_id(2) // SPLIT_PROGRAMS
    split = tl.program_id(2) % SPLIT_PROGRAMS

    # The step's metadata (and the first tile's block ids) are read before the PDL wait, as the kernel
    # before this one writes q and the KV cache, never the metadata (pdl.py).
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    ctx0 = seq_len - q_len  # context position of the sequence's first query

    r = tl.arange(0, BLOCK_M)
    qi = qt * BLOCK_Q + r // GROUP_PAD
    g = r % GROUP_PAD
    row_ok = (qi < q_len) & (g < GROUP)
    token = (q_start + qi).to(tl.int64)
    head = kvh * GROUP + g
    if CAUSAL:
        qpos = ctx0 + qi
    else:  # every query sees the whole sequence
        qpos = tl.zeros([BLOCK_M], tl.int32) + seq_len - 1
    d = tl.arange(0, HEAD_DIM)

    # Keys this tile may see: up to its last query's position; then this split's share of them.
    last_q = tl.minimum(q_len, (qt + 1) * BLOCK_Q)
    if CAUSAL:
        kv_end = tl.where(qt * BLOCK_Q < q_len, tl.minimum(seq_len, ctx0 + last_q), 0)
    else:
        kv_end = tl.where(qt * BLOCK_Q < q_len, seq_len, 0)
    kv_end = tl.maximum(kv_end, 0)
    if HAS_KV_START:
        lo_key = tl.load(kv_start_ptr + b).to(tl.int32)
    else:
        lo_key = 0
    kv_begin = 0
    if WINDOW > 0:  # the tile's first query sees keys from first_qpos - WINDOW + 1 on; later ones, fewer
        if CAUSAL:
            first_qpos = ctx0 + qt * BLOCK_Q
        else:
            first_qpos = seq_len - 1
        kv_begin = tl.maximum(first_qpos - WINDOW + 1, 0)
        kv_begin = tl.minimum(kv_begin, kv_end)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    k_base = k_ptr + kvh.to(tl.int64) * stride_kvh
    v_base = v_ptr + kvh.to(tl.int64) * stride_kvh
    if FIXED_SPLIT == 0:
        per_split = tl.cdiv(tl.cdiv(kv_end - kv_begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = kv_begin + split * per_split
        hi = tl.minimum(lo + per_split, kv_end)
        slot = _tile_slots(bt_row, lo, lo_key, hi, BLOCK_N, PAGE)
        wait_prior(PDL)
        _attend_split(q_ptr, k_base, v_base, out_ptr, po_ptr, pm_ptr, pl_ptr, bt_row, token, head, row_ok, qpos, d,
                      lo, hi, lo_key, slot, split, True, True, scale_log2, num_tokens, stride_qt, stride_qh,
                      stride_kvs, stride_ot, stride_oh, NUM_HEADS, HEAD_DIM, BLOCK_M, BLOCK_N, PAGE, NUM_SPLITS,
                      DOT_PREC, WHILE_LOOP, EARLY_V, WINDOW)
    else:
        wait_prior(PDL)
        # Keys below kv_begin are invisible to every query of the tile, so skipping their tiles changes
        # nothing; the tiles that remain keep their absolute positions.
        first = kv_begin // BLOCK_N * BLOCK_N
        for j in range(SPLIT_ITERS):
            s = split + j * SPLIT_PROGRAMS
            lo = tl.maximum(s * FIXED_SPLIT, first)
            hi = tl.minimum(s * FIXED_SPLIT + FIXED_SPLIT, kv_end)
            slot = _tile_slots(bt_row, lo, lo_key, hi, BLOCK_N, PAGE)
            _attend_split(q_ptr, k_base, v_base, out_ptr, po_ptr, pm_ptr, pl_ptr, bt_row, token, head, row_ok,
                          qpos, d, lo, hi, lo_key, slot, s, s < NUM_SPLITS, hi > lo, scale_log2, num_tokens,
                          stride_qt, stride_qh, stride_kvs, stride_ot, stride_oh, NUM_HEADS, HEAD_DIM, BLOCK_M,
                          BLOCK_N, PAGE, NUM_SPLITS, DOT_PREC, WHILE_LOOP, EARLY_V, WINDOW)


@triton.jit
def _combine_kernel(
    out_ptr, po_ptr, pm_ptr, pl_ptr, num_tokens, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merge the split-K partials of one (token, head): [S] (m, l) and [S, D] acc."""
    wait_prior(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLIT_PAD)
    ok = s < NUM_SPLITS
    row = (s * num_tokens + t) * NUM_HEADS + h  # [S]
    m = tl.load(pm_ptr + row, mask=ok, other=float("-inf"))
    lsum = tl.load(pl_ptr + row, mask=ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # [S]
    denom = tl.sum(w * lsum, 0)
    d = tl.arange(0, HEAD_DIM)[None, :]
    o = tl.load(po_ptr + row[:, None] * HEAD_DIM + d, mask=ok[:, None], other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)  # [D]
    tl.store(out_ptr + t * stride_ot + h * stride_oh + tl.arange(0, HEAD_DIM), o.to(out_ptr.dtype.element_ty))


@triton.jit
def _combine_ordered_kernel(
    out_ptr, po_ptr, pm_ptr, pl_ptr, num_tokens, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, PDL: tl.constexpr,
):
    """Batch-invariant merge of one (token, head)'s split partials: the splits added in order 0, 1, ...,
    and a split without keys for this query (weight 0) skipped, never loaded, so a query's result is
    the same whatever the number of (empty) splits after its last key, and equals the one-split store."""
    wait_prior(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    stride_s = num_tokens * NUM_HEADS  # between splits (int32: splits * tokens * heads is far below 2^31)
    row0 = t * NUM_HEADS + h
    m_max = tl.load(pm_ptr + row0)
    for s in tl.range(1, NUM_SPLITS):
        m_max = tl.maximum(m_max, tl.load(pm_ptr + s * stride_s + row0))
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    zeros = tl.zeros([HEAD_DIM], tl.float32)
    w = tl.exp2(tl.load(pm_ptr + row0) - m_max)
    denom = w * tl.load(pl_ptr + row0)
    wv = zeros + w
    o = wv * tl.load(po_ptr + row0 * HEAD_DIM + d, mask=wv > 0, other=0.0)
    for s in tl.range(1, NUM_SPLITS):
        row = s * stride_s + row0
        w = tl.exp2(tl.load(pm_ptr + row) - m_max)
        denom += w * tl.load(pl_ptr + row)  # + 0.0 when the split has no key for this query: exact
        wv = zeros + w
        part = tl.load(po_ptr + row * HEAD_DIM + d, mask=wv > 0, other=0.0)
        o = tl.where(wv > 0, o + wv * part, o)
    o = o / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty))


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: keep the split count small
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


INVARIANT_TILE_ROWS = 64  # batch-invariant mode: query rows (queries x padded head group) of every tile


def _tiles(num_heads: int, num_kv_heads: int, max_query_len: int, invariant: bool = False) -> tuple[int, int, int]:
    """(GROUP_PAD, BLOCK_Q, number of query tiles) for this query length (invariant: one tile size for
    every query length, INVARIANT_TILE_ROWS rows)."""
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    if invariant:
        block_q = max(1, INVARIANT_TILE_ROWS // group_pad)
    elif max_query_len <= 16:  # decode / verify: all of a sequence's queries in one tile if possible
        block_q = min(triton.next_power_of_2(max_query_len), max(1, 128 // group_pad))
    else:  # prefill: 64-row tiles
        block_q = max(1, 64 // group_pad)
    block_q = max(block_q, 16 // group_pad, 1)  # tl.dot wants at least 16 rows
    return group_pad, block_q, triton.cdiv(max_query_len, block_q)


def pick_num_splits(num_programs: int, device: torch.device, programs_per_sm: int = 2) -> int:
    """Split-K factor from shapes only (graph-safe): about programs_per_sm (KernelOptions.
    attn_programs_per_sm) programs per SM, so the key loop's memory latency is hidden by other
    programs (one program per (sequence, KV head) left batch-64 decode attention at ~25% of HBM
    bandwidth: docs/BENCHMARKS.md, session 4)."""
    want = programs_per_sm * _num_sms(device)
    if num_programs >= want:
        return 1
    # A power of two: NUM_SPLITS is a compile-time constant, so few distinct values = few JIT compiles.
    return min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(want, num_programs)))


def triton_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    num_splits: int | None = None, out: torch.Tensor | None = None, prefetch: Regions | None = None,
    options: KernelOptions = DEFAULT_OPTIONS, window: int = 0,
) -> torch.Tensor:
    """Paged causal attention; q: [T, H, D] -> [T, H, D]. Same contract as reference_attention
    (window: the layer's sliding window, 0 for a global layer).

    num_splits forces the split-K factor (default: from shapes and options.attn_programs_per_sm; ignored
    with options.batch_invariant, whose splits are invariant_kv_split keys each);
    out: optional output buffer; prefetch: weight regions an extra row of programs asks L2 for
    (kernels/l2_prefetch.py; ignored where unsupported); options: PDL and the split target."""
    if meta.block_size is None:
        raise ValueError("triton_attention needs meta.block_size (build_batch fills it)")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[2]
    assert num_heads % num_kv_heads == 0 and head_dim in (16, 32, 64, 128, 256)
    assert kv_cache.stride(-1) == 1 and kv_cache.dtype == q.dtype
    if q.stride(-1) != 1:
        q = q.contiguous()
    num_seqs = meta.query_start_loc.shape[0] - 1
    invariant = options.batch_invariant
    group_pad, block_q, q_tiles = _tiles(num_heads, num_kv_heads, meta.max_query_len, invariant)
    block_n = 64 if head_dim <= 128 else 32
    if invariant:  # fixed key positions per split: as many splits as the block table can hold keys (shape only)
        if options.invariant_kv_split % block_n:
            raise ValueError(f"invariant_kv_split must be a multiple of {block_n}, got {options.invariant_kv_split}")
        num_splits = triton.cdiv(meta.block_tables.shape[1] * meta.block_size, options.invariant_kv_split)
        # How many programs share a tile's splits follows the default heuristic; it moves no split.
        split_programs = min(num_splits, pick_num_splits(num_seqs * num_kv_heads * q_tiles, q.device,
                                                         options.attn_programs_per_sm))
    else:
        if num_splits is None:
            num_splits = pick_num_splits(num_seqs * num_kv_heads * q_tiles, q.device, options.attn_programs_per_sm)
        split_programs = num_splits
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0:
        return out
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if num_splits > 1:
        po = torch.empty(num_splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
        pm = torch.empty(num_splits, num_tokens, num_heads, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        if POISON_SCRATCH:
            for t in (po, pm, pl):
                t.fill_(float("nan"))
    else:
        po = pm = pl = out  # unused
    pf = prefetch if prefetch is not None and prefetch_supported(q.device) else None
    _attn_kernel[(num_seqs + (pf is not None), num_kv_heads, q_tiles * split_programs)](
        q, k_cache, v_cache, out, po, pm, pl,
        meta.query_start_loc, meta.seq_lens, meta.block_tables,
        meta.kv_start if meta.kv_start is not None else meta.seq_lens,
        scale * 1.4426950408889634, num_tokens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0), *(pf or (0, 0, 0, 0)),
        NUM_HEADS=num_heads, GROUP=num_heads // num_kv_heads, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        BLOCK_N=block_n, HEAD_DIM=head_dim, PAGE=meta.block_size, NUM_SPLITS=num_splits,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", WHILE_LOOP=_INTERPRET,
        CAUSAL=meta.causal, HAS_KV_START=meta.kv_start is not None, EARLY_V=invariant or meta.max_query_len <= 16,
        PREFETCH=pf is not None, WINDOW=int(window), FIXED_SPLIT=options.invariant_kv_split if invariant else 0,
        SPLIT_PROGRAMS=split_programs, SPLIT_ITERS=triton.cdiv(num_splits, split_programs),
        num_warps=4, num_stages=3, **launch_kwargs(q.device, options.pdl),
    )
    if num_splits > 1 and invariant:
        _combine_ordered_kernel[(num_tokens, num_heads)](
            out, po, pm, pl, num_tokens, out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits, num_warps=1, **launch_kwargs(q.device, options.pdl),
        )
    elif num_splits > 1:
        _combine_kernel[(num_tokens, num_heads)](
            out, po, pm, pl, num_tokens, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            SPLIT_PAD=triton.next_power_of_2(num_splits), num_warps=1, **launch_kwargs(q.device, options.pdl),
        )
    return out
