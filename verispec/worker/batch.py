"""Host batch assembly: one scheduled step as host lists, padded for a verify graph, plus the plan of
its single staged host->device copy. A pure builder: no model, no tensors, no device.

What it produces (HostBatch): input ids (PLACEHOLDER where only the device knows the value) with
the owner of each placeholder, positions, KV cache slots, per-sequence query / context lengths and
block tables, the sampling requests with their first logit row, the logit rows themselves, the
input positions of each sampling request's drafts and each request's first input index. Then
(stage_plan) the int64 and int32 sections that Staging copies to the device in one go, including
the [S, kmax] draft index and the [S, kmax + 1] verified-row index the verifier reads.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from verispec.core.placeholder import PLACEHOLDER
from verispec.core.scheduler_output import ScheduledRequest, SchedulerOutput
from verispec.worker.inputs import extend_padding, extend_slots, padded_tables
from verispec.worker.token_state import Owner

# The id of the sentinel input appended after a step's ids: padded draft slots point at it, and
# no token has a negative id, so a padded draft never matches (never a placeholder either).
SENTINEL_ID = -2

#: graph_fit(num_seqs, longest chunk) -> the query length a verify graph would replay, or None.
GraphFit = Callable[[int, int], "int | None"]

# What a second replay costs, in tokens of padded compute: one more pass over the weights (~1.1 ms for the
# 1.5B on the H200, a batch-1 decode step) against ~3.5-7 us a token of a padded prefill row (session 20's
# H100 traces: 16 rows padded to 128 queries, 2,048 tokens, took 11.6 ms where the split took 6.4). A step
# pads every row to one prompt chunk's length only where that pads fewer tokens than the split plus this.
SPLIT_COST_TOKENS = 256


@dataclass
class HostBatch:
    """One step's inputs as host lists, before anything touches the device."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    placeholders: list[tuple[int, Owner]] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    sampling: list[tuple[ScheduledRequest, int]] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    # Input positions of each sampling request's drafts (may be left empty when none has drafts).
    draft_pos: list[range] = field(default_factory=list)
    offsets: dict[str, int] = field(default_factory=dict)
    # A step no single graph fits, replayed as two that do (split_for_graphs): (rows of the first part,
    # its query length, the second part's); None: one forward.
    split: tuple[int, int, int] | None = None


class StagePlan(NamedTuple):
    """The sections of a step's one staged copy (Staging.stage(longs, ints)) and their shapes.

    longs: [ids + [SENTINEL_ID], positions, slots, placeholder positions, placeholder sources,
    logit rows (empty when dense), draft index [S * kmax], row index [S * (kmax + 1)]];
    ints: [query_start_loc, seq_lens, block tables padded to `width`]."""

    longs: list[list[int]]
    ints: list[list[int]]
    num_tokens: int
    kmax: int  # the most drafts of any sampling request (0: no draft index)
    width: int  # block-table columns
    dense: bool  # every token is a logit row, in order


def decode_only(scheduled: list[ScheduledRequest]) -> bool:
    """True when every chunk of the step is one known token without drafts (a decode row)."""
    for s in scheduled:  # (no generator: this runs for every request in every step)
        if s.num_new_tokens != 1 or s.num_draft_tokens:
            return False
    return True


def padded_query_len(scheduled: list[ScheduledRequest], graph_fit: GraphFit | None) -> int:
    """The query length every chunk of this step is padded to so that it replays a verify graph;
    0 for no padding (no graphs, a decode-only step, a chunk longer than any graph's query length
    or more sequences than the largest graph)."""
    if graph_fit is None or not scheduled:
        return 0
    longest = max(s.num_new_tokens for s in scheduled)
    if longest == 1:
        return 0  # uniform already: the decode graph
    return graph_fit(len(scheduled), longest) or 0


def split_for_graphs(scheduled: list[ScheduledRequest], graph_fit: GraphFit) -> tuple[int, int, int] | None:
    """Where a step that no single graph fits (an admission step whose prompt chunk, padded with every
    decode row to its length, is past the prefill graphs' token budget) splits into two replays that
    do: the rows before the first prompt chunk (more than one known token: decode and verify rows,
    which the scheduler puts first) and the rest. (rows of the first part, its query length, the
    second's), or None where either part fits no graph."""
    j = next((i for i, s in enumerate(scheduled) if s.num_new_tokens - s.num_draft_tokens > 1), 0)
    if j == 0:
        return None
    q_a = graph_fit(j, max(s.num_new_tokens for s in scheduled[:j]))
    q_b = graph_fit(len(scheduled) - j, max(s.num_new_tokens for s in scheduled[j:]))
    return (j, q_a, q_b) if q_a and q_b else None


def build_host_batch(sched: SchedulerOutput, block_size: int, graph_fit: GraphFit | None = None,
                     split: bool = False) -> HostBatch:
    """Host lists for a step: ids (PLACEHOLDER where only the device knows the value), their
    owners, positions, cache slots, attention lengths, logit rows and draft positions. Chunks of a
    step that a verify graph can replay are padded to its query length (pad_before); with split, a
    step no graph fits whole but two do (split_for_graphs), or that one graph fits only with far more
    padding than the two (split_is_cheaper), is padded part by part (HostBatch.split).
    Records each sampling request's output_base (its output length now) on its ScheduledRequest."""
    if decode_only(sched.scheduled):
        return assemble_decode(sched.scheduled, block_size)
    q_pad = padded_query_len(sched.scheduled, graph_fit)
    if split and graph_fit is not None:
        parts = split_for_graphs(sched.scheduled, graph_fit)
        if parts is not None and (q_pad == 0 or split_is_cheaper(len(sched.scheduled), q_pad, parts)):
            hb = assemble_chunks(sched.scheduled, block_size, parts[1], tail=(parts[0], parts[2]))
            hb.split = parts
            return hb
    return assemble_chunks(sched.scheduled, block_size, q_pad)


def split_is_cheaper(num_seqs: int, q_pad: int, parts: tuple[int, int, int]) -> bool:
    """Whether a step of num_seqs rows that one graph replays with every row padded to q_pad queries is
    cheaper as the two replays of split_for_graphs (parts): its padded tokens are more than the split's
    plus SPLIT_COST_TOKENS (rows counted unpadded: the graphs' batch padding adds alike to both)."""
    n_a, q_a, q_b = parts
    return num_seqs * q_pad > n_a * q_a + (num_seqs - n_a) * q_b + SPLIT_COST_TOKENS


def assemble_chunks(scheduled: list[ScheduledRequest], block_size: int, q_pad: int = 0,
                    tail: tuple[int, int] | None = None) -> HostBatch:
    """build_host_batch for any step (prefill chunks, drafts, padding), request by request; every
    chunk shorter than q_pad gets padding queries in front of it (tail = (row, q): from that row on,
    shorter than q)."""
    hb = HostBatch()
    for i, s in enumerate(scheduled):
        req = s.request
        rid = req.request_id
        k, n = s.num_draft_tokens, s.num_new_tokens
        n_known = n - k
        if tail is not None and i == tail[0]:
            q_pad = tail[1]
        if q_pad > n:
            pad_before(hb, s.start, q_pad - n)
        offset = len(hb.ids)
        hb.offsets[rid] = offset
        known = req.token_slice(s.start, s.start + n_known)
        if PLACEHOLDER in known:
            first = s.start - req.num_prompt_tokens
            hb.placeholders += [(offset + j, (rid, "out", first + j)) for j, t in enumerate(known) if t == PLACEHOLDER]
        hb.ids += known
        if k:
            drafts = req.spec_token_ids[:k]
            if PLACEHOLDER in drafts:
                hb.placeholders += [(offset + n_known + j, (rid, "draft", j)) for j, t in enumerate(drafts) if t == PLACEHOLDER]
            hb.ids += drafts
        hb.positions.extend(range(s.start, s.start + n))
        extend_slots(hb.slots, req.block_ids, s.start, n, block_size)
        hb.query_lens.append(max(n, q_pad))
        hb.seq_lens.append(s.start + n)
        hb.tables.append(req.block_ids)
        if s.needs_sample:
            s.output_base = len(req.output_token_ids)
            hb.sampling.append((s, len(hb.logit_rows)))
            end = offset + n
            hb.logit_rows.extend(range(end - k - 1, end))
            hb.draft_pos.append(range(end - k, end))
    return hb


def assemble_decode(scheduled: list[ScheduledRequest], block_size: int) -> HostBatch:
    """build_host_batch for a step of decode rows only (one known token each, no drafts, so no
    padding either): the same lists, built a column at a time. This is every step of a steady
    decode batch, where the per-request loop of assemble_chunks dominates the host time."""
    bs = block_size
    reqs = [s.request for s in scheduled]
    starts = [s.start for s in scheduled]
    tables = [r.block_ids for r in reqs]
    ids = [r.token_at(p) for r, p in zip(reqs, starts, strict=True)]
    hb = HostBatch(
        ids=ids,
        positions=starts,
        slots=[t[p // bs] * bs + p % bs for t, p in zip(tables, starts, strict=True)],
        placeholders=[
            (i, (r.request_id, "out", p - len(r.prompt_token_ids)))
            for i, (t, r, p) in enumerate(zip(ids, reqs, starts, strict=True)) if t == PLACEHOLDER
        ],
        query_lens=[1] * len(scheduled),
        seq_lens=[p + 1 for p in starts],
        tables=tables,
        offsets={r.request_id: i for i, r in enumerate(reqs)},
    )
    sampling, logit_rows = hb.sampling, hb.logit_rows
    for i, s in enumerate(scheduled):
        out = s.request.output_token_ids
        n_out = len(out)
        # s.needs_sample (the chunk is the last known token), num_tokens inlined
        if s.start + 1 >= len(s.request.prompt_token_ids) + n_out:
            s.output_base = n_out
            sampling.append((s, len(logit_rows)))
            logit_rows.append(i)
    return hb


def pad_before(hb: HostBatch, start: int, num: int) -> None:
    """num padding queries placed BEFORE a chunk of n tokens at positions [start, start + n).

    The chunk's seq_len stays start + n while its query length becomes q = n + num, so the
    attention kernel (query i sees keys [0, seq_len - q + i]) shows real token j, now query
    num + j, exactly keys [0, start + j] as unpadded; pad query i sees [0, start - num + i],
    only keys already in the cache before this step (none when negative: zeros). Pads write
    no K/V (slot -1) and are never a logit or draft row. Their positions only feed rotary."""
    extend_padding(hb.ids, hb.positions, hb.slots, start, num)


def draft_index(draft_pos: list[range], kmax: int, sentinel: int) -> list[int]:
    """[S, kmax] input positions of each sampling request's drafts, padded with the sentinel
    position (whose id is SENTINEL_ID: never a token, so a padded draft never matches)."""
    if kmax == 0:
        return []  # no drafts in the step
    idx: list[int] = []
    for p in draft_pos:
        idx += p
        idx += [sentinel] * (kmax - len(p))
    return idx


def row_index(sampling: list[tuple[ScheduledRequest, int]], kmax: int) -> list[int]:
    """[S, kmax + 1] logit row of each verified position (clamped to the request's last row)."""
    if kmax == 0:
        return []  # one row per request, in order
    idx: list[int] = []
    for s, r0 in sampling:
        k = s.num_draft_tokens
        idx += range(r0, r0 + k + 1)
        idx += [r0 + k] * (kmax - k)
    return idx


def stage_plan(hb: HostBatch, ids: list[int], ph_pos: list[int], ph_src: list[int]) -> StagePlan:
    """The sections of the step's one staged copy. ids: the step's input ids as staged (hb.ids,
    or a variant of it); ph_pos / ph_src: where each placeholder sits and its index into the flat
    device sources (token_state.gather_plan)."""
    num_tokens = len(ids)
    dense = len(hb.logit_rows) == num_tokens  # every token is a logit row, in order
    kmax = max(map(len, hb.draft_pos), default=0)
    width = max(map(len, hb.tables))
    longs = [ids + [SENTINEL_ID], hb.positions, hb.slots, ph_pos, ph_src, [] if dense else hb.logit_rows,
             draft_index(hb.draft_pos, kmax, num_tokens), row_index(hb.sampling, kmax)]
    ints = [list(itertools.accumulate(hb.query_lens, initial=0)), hb.seq_lens, padded_tables(hb.tables, width)]
    return StagePlan(longs, ints, num_tokens, kmax, width, dense)
