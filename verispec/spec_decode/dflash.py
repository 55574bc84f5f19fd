"""DFlash proposer: one drafter forward per step drafts a whole block for every ready request.

Context cache. Each drafter layer keeps the K/V of the context (target features of committed
tokens) in a paged cache that mirrors the target's: slot = block_id * block_size + offset, so the
target's block tables address it. Per request the proposer keeps `consumed`: positions below it hold
drafter K/V. observe() takes note of the captured target rows of positions < num_computed_tokens
it has not seen yet, and the next propose() writes their K/V (inside the drafting step, see
spec_decode/dflash_step.py); rejected drafts sit at positions >= num_computed_tokens, so they are never
consumed and rollback needs nothing (positions past `consumed` are overwritten later).

Prefix caching. A position's context K/V depend only on the tokens up to it, so a full block the
drafter wrote is valid for any request whose prefix (chain hash of token ids) is the same. The
proposer remembers the chain hash of every block it wrote completely; a request that starts with a
prefix-cache hit reuses those K/V when all its hit blocks are known, and otherwise drafts from the
context it computes itself (positions below its first computed token are masked out). In the
overlapped loop, blocks holding not-yet-collected tokens (placeholders) are not remembered, so reuse
covers prompt blocks there.

Checkpoints (the published DFlashDraftModel layout; save_drafter / load_drafter) and the checks that
a drafter fits its target live in spec_decode/dflash_format.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.core.placeholder import PLACEHOLDER
from verispec.core.request import Request
from verispec.core.scheduler_output import SchedulerOutput
from verispec.models.qwen2 import CausalLM
from verispec.spec_decode.dflash_format import check_target, load_drafter
from verispec.spec_decode.dflash_format import save_drafter as save_drafter
from verispec.spec_decode.dflash_model import DFlashDrafter
from verispec.spec_decode.dflash_step import DFlashStepRunner, DraftRow
from verispec.spec_decode.proposer import Proposal, Proposer
from verispec.worker.inputs import to_device
from verispec.worker.sampler import probs_from_logits, row_params
from verispec.worker.sampling_keys import RequestGenerators
from verispec.worker.token_state import DeviceTokens


@dataclass
class _ReqState:
    consumed: int  # positions < consumed hold drafter context K/V (or are masked: < ctx_start)
    ctx_start: int  # first position whose context K/V may be attended to
    written_from: int  # first position this request wrote itself
    next_block: int = 0  # first block whose chain hash is not computed yet
    chain: int | None = None  # chain hash of blocks < next_block
    poisoned: bool = False  # the chain covers a placeholder (async loop): never record it


def build_dflash_proposer(sc, target: CausalLM, device, dtype, config) -> tuple[DFlashProposer, int]:
    """Load the drafter named by sc.model, check it belongs to `target`, and build the proposer.
    Returns (proposer, bytes of drafter context K/V per KV block)."""
    drafter = load_drafter(sc.model, device, dtype)
    cfg = drafter.config
    check_target(cfg, target, sc.model)
    graphs = 0 if config.enforce_eager else min(config.max_num_seqs, 64)
    prop = DFlashProposer(drafter, target, sc.num_speculative_tokens, device, dtype, config.seed,
                          max_rows=config.max_num_seqs, graph_max_batch=graphs)
    elem = torch.tensor([], dtype=dtype).element_size()
    per_block = 2 * cfg.num_layers * config.block_size * cfg.num_kv_heads * cfg.head_dim * elem
    return prop, per_block


OWED_MAX_ROWS = 4096  # deferred context rows (DFlashProposer._owed) past which they are written at once

# A request's context rows of one step: (that step's captured features, first captured row, positions
# lo..hi, the ids of the blocks holding them: block lo // block_size first). The features are the step's
# private copies (the graph runner's clones, the eager forward's own tensors), so a span may outlive its
# step: nothing is gathered until a context forward writes it.
_Span = tuple[list[torch.Tensor], int, int, int, list[int]]


def _joined(captured: list[torch.Tensor]) -> torch.Tensor | None:
    """The [t, sum of widths] tensor whose column blocks the captured layers are, in order, if they are
    (worker/graphs.py private_rows: one copy for all layers), else None."""
    base = captured[0]._base
    if base is None or base.dim() != 2 or base.shape[0] != captured[0].shape[0]:
        return None
    col = 0
    for c in captured:
        if c._base is not base or c.data_ptr() != base.data_ptr() + col * base.element_size():
            return None
        col += c.shape[-1]
    return base if col == base.shape[1] else None


class DFlashProposer(Proposer):
    """Drafts min(k, B-1) tokens per request from one block-parallel drafter forward. Drafts stay
    on the device (Proposal.device); the block's first token is read from the device when the host
    only holds a placeholder, so the overlapped loop never waits for values."""

    needs_host_tokens = False

    def __init__(self, drafter: DFlashDrafter, target: CausalLM, num_speculative_tokens: int, device, dtype,
                 seed: int = 0, max_rows: int = 256, graph_max_batch: int = 0) -> None:
        """max_rows: most requests drafting in one step (the engine's max_num_seqs);
        graph_max_batch > 0: capture CUDA graphs of the drafting step up to that batch (CUDA only)."""
        cfg = drafter.config
        super().__init__(min(num_speculative_tokens, cfg.block_size - 1))
        self.drafter, self.target = drafter, target
        self.device, self.dtype, self.seed = torch.device(device), dtype, seed
        self.capture_layers = tuple(cfg.target_layers)
        self.kv: list[torch.Tensor] = []  # per layer [2, slots, KH, D]
        self.state: dict[str, _ReqState] = {}
        self.block_hash: dict[int, int] = {}  # block id -> chain hash of the tokens its K/V were written for
        self.generators = RequestGenerators(self.device, seed, salt=1)  # keyed like the draft model's
        self.max_rows, self.graph_max_batch = max_rows, graph_max_batch
        self.step: DFlashStepRunner | None = None
        # From observe() to the next propose(): per request the span (_Span) of committed positions whose
        # context K/V are not written yet, and the step's captured features.
        self._pending: dict[str, _Span] = {}
        self._captured: list[torch.Tensor] = []
        # Context K/V deferred from steps that draft nothing (the policy's k = 0): per request its spans, host
        # bookkeeping only (a step planned at 0 runs no device op here, whatever the batch). Written in one
        # forward before the next step that drafts (for every request: a prefix hit may read another
        # request's blocks) or once OWED_MAX_ROWS pile up. A freed request's spans leave (its blocks may go
        # to another request, whose rows would land in the same slots): those of its complete blocks (a
        # prefix hit may count on them) stay owed, by block (_freed), and are written first in the next
        # flush (before any drafting step, which is what reads them), unless their block gets another
        # owner first: that owner's observe() drops them (the block's drafter K/V are its now, and the block
        # leaves block_hash). Those of its last, incomplete block are dropped at once (no request can read
        # them). So a step in which requests finish runs no device op either.
        self._owed: dict[str, list[_Span]] = {}
        self._owed_rows = 0  # rows of _owed and _freed
        self._freed: dict[int, list[_Span]] = {}  # block id -> a freed request's owed spans in it
        self.context_forwards = 0  # drafter context forwards run outside drafting steps (_write_spans)
        self.context_rows = 0  # ... and the rows they wrote
        self.dropped_rows = 0  # freed requests' owed rows no one may read, never written

    def bind(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        super().bind(num_blocks, block_size, max_model_len)
        self.step = DFlashStepRunner(self.drafter, self.target, self.k, num_blocks, block_size, max_model_len,
                                     self.max_rows, self.graph_max_batch, self.device, self.dtype)
        self.kv = self.step.kv  # per layer [2, slots, KH, D]: the engine's blocks, then scratch

    def free_request(self, request_id: str) -> None:
        st = self.state.pop(request_id, None)
        self.generators.free(request_id)
        # Its context K/V not written yet of its complete blocks (a prefix hit may read those) stay owed until
        # the next flush or another owner of the block; the rest are dropped (_take_request).
        self._take_request(request_id, st)

    def consumed(self, request_id: str) -> int | None:
        """Positions of the request whose context the drafter holds (None: unknown request)."""
        st = self.state.get(request_id)
        return None if st is None else st.consumed

    # ---- context ---------------------------------------------------------------------------
    def _block_chain(self, req: Request, i: int, parent: int | None) -> int:
        bs = self.block_size
        return hash((parent, tuple(req.all_token_ids[i * bs : (i + 1) * bs])))

    def _new_state(self, req: Request, start: int) -> _ReqState:
        """First sight of a request whose first computed position is `start` (> 0 after a prefix hit)."""
        st = _ReqState(consumed=start, ctx_start=0, written_from=start)
        bs = self.block_size
        if start % bs:
            st.ctx_start = start
            return st
        for i in range(start // bs):
            st.chain = self._block_chain(req, i, st.chain)
            if self.block_hash.get(req.block_ids[i]) != st.chain:
                st.ctx_start = start  # some hit block lacks drafter K/V: draft from own context only
        st.next_block = start // bs
        return st

    @torch.inference_mode()
    def observe(self, sched: SchedulerOutput, result) -> None:
        """Note the captured target features of newly committed positions (a span per request, no device
        work). Their context K/V are written by the next propose(): inside the drafting step for requests
        that draft now and committed at most 1 + k positions (the usual verify step), in one forward
        before it for the rest, or later (_defer_context) when nothing drafts."""
        self._pending = {}
        captured = self._captured = result.captured
        if not captured:
            return
        bs, state, pending, offsets = self.block_size, self.state, self._pending, result.token_offsets
        block_hash, freed = self.block_hash, self._freed
        for s in sched.scheduled:
            req = s.request
            rid, bids = req.request_id, req.block_ids
            off = offsets.get(rid)
            if not bids or off is None:
                continue  # finished this step (its blocks are gone) or not in the batch
            st = state.get(rid)
            if st is None:
                st = state[rid] = self._new_state(req, s.start)
            if s.start > st.consumed:  # a gap we cannot fill: restart the context here
                st = state[rid] = _ReqState(consumed=s.start, ctx_start=s.start, written_from=s.start)
            lo, hi = st.consumed, min(req.num_computed_tokens, s.start + s.num_new_tokens)
            if hi <= lo:
                continue
            for i in range(lo // bs, (hi - 1) // bs + 1):
                block_hash.pop(bids[i], None)  # its K/V change now
                if freed and bids[i] in freed:  # a freed request's block, ours now: its old rows go
                    n = sum(sp[3] - sp[2] for sp in freed.pop(bids[i]))
                    self._owed_rows -= n
                    self.dropped_rows += n
            pending[rid] = (captured, off - s.start + lo, lo, hi, bids[lo // bs : (hi - 1) // bs + 1])
            st.consumed = hi
            while (st.next_block + 1) * bs <= hi:  # blocks now complete: remember what they hold
                i = st.next_block
                st.chain = self._block_chain(req, i, st.chain)
                st.poisoned = st.poisoned or PLACEHOLDER in req.all_token_ids[i * bs : (i + 1) * bs]
                if not st.poisoned and (i * bs >= st.written_from or st.ctx_start == 0):
                    block_hash[bids[i]] = st.chain
                st.next_block += 1

    def _flush_context(self, keep: set[str]) -> None:
        """Write the deferred context K/V (freed requests' first) and the pending context K/V of every
        request not in `keep` now (one batched forward)."""
        spans = [sp for rows in self._freed.values() for sp in rows]
        spans += [sp for rows in self._owed.values() for sp in rows]
        spans += [sp for rid, sp in self._pending.items() if rid not in keep]
        self._owed, self._freed, self._owed_rows = {}, {}, 0
        self._write_spans(spans)

    def _take_request(self, request_id: str, st: _ReqState | None) -> None:
        """Take one request's deferred and pending context rows out: those of its complete blocks (only
        those can be in block_hash, so a prefix hit may read them) go to the freed rows (_freed, by block),
        written by the next flush; those of its last, incomplete block are dropped: no request can read them.
        (Complete, not recorded in block_hash: that differs between the loops, where an output token was
        collected later, and what a context forward writes must not, as its rows' values may depend on
        the other rows of the forward on the GPU.)"""
        spans = self._owed.pop(request_id, [])
        self._owed_rows -= sum(hi - lo for _, _, lo, hi, _ in spans)
        pend = self._pending.pop(request_id, None)
        if pend is not None:
            spans.append(pend)
        bs = self.block_size
        for cap, row, lo, hi, blocks in spans:
            p = lo
            while p < hi:  # per block of the span
                i = p // bs
                end, block = min(hi, (i + 1) * bs), blocks[i - lo // bs]
                if st is not None and (i + 1) * bs <= st.consumed:
                    self._freed.setdefault(block, []).append((cap, row + p - lo, p, end, [block]))
                    self._owed_rows += end - p
                else:
                    self.dropped_rows += end - p
                p = end

    def _write_spans(self, spans: list[_Span]) -> None:
        """One drafter context forward over the rows of these spans: the features of every step they come
        from, concatenated per captured layer, one index (and position, slot) upload, one gather."""
        if not spans:
            return
        bs = self.block_size
        base: dict[int, int] = {}  # id(captured list) -> its first row in the concatenation
        steps: list[list[torch.Tensor]] = []
        rows: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        n = 0
        for cap, row, lo, hi, blocks in spans:
            b0 = base.get(id(cap))
            if b0 is None:
                b0 = base[id(cap)] = n
                steps.append(cap)
                n += cap[0].shape[0]
            r0 = b0 + row - lo
            rows += range(r0 + lo, r0 + hi)
            positions += range(lo, hi)
            first = lo // bs
            slots += [blocks[p // bs - first] * bs + p % bs for p in range(lo, hi)]
        m = len(rows)
        flat = [_joined(c) for c in steps]
        if len(steps) == 1:
            layers = flat if flat[0] is not None else steps[0]
        elif all(f is not None for f in flat):
            layers = [torch.cat(flat)]
        else:
            layers = [torch.cat([c[j] for c in steps]) for j in range(len(steps[0]))]
        ints = to_device(rows + positions + slots, torch.long, self.device)
        if rows != list(range(n)):  # (all rows of the steps, in order: no gather)
            layers = [x.index_select(0, ints[:m]) for x in layers]
        feats = torch.cat(layers, dim=-1) if len(layers) > 1 else layers[0]
        self.context_forwards += 1
        self.context_rows += m
        self.drafter.write_context(feats.to(self.dtype), ints[m : 2 * m], ints[2 * m :], self.kv)

    def _defer_context(self) -> None:
        """A step that drafts nothing: keep its pending spans for the next drafting step (no device work;
        the features stay in the step's captured tensors)."""
        owed, n = self._owed, 0
        for rid, sp in self._pending.items():
            rows = owed.get(rid)
            if rows is None:
                owed[rid] = [sp]
            else:
                rows.append(sp)
            n += sp[3] - sp[2]
        self._pending = {}
        self._owed_rows += n
        if self._owed_rows > OWED_MAX_ROWS:
            self._flush_context(set())

    # ---- drafting --------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: list[Request], sources: dict | None = None) -> Proposal:
        out = Proposal()
        todo = []
        for r in requests:
            k, st = self.num_drafts_for(r), self.state.get(r.request_id)
            if k > 0 and st is not None and st.consumed == r.num_tokens - 1:
                todo.append((r, k, st))
        if not todo:
            self._defer_context()
            return out
        logits = self._draft_logits(todo, sources or {})
        self._pending = {}
        drafts = logits.argmax(-1)  # [R, k] on the device
        sampled = [(i, r, k) for i, (r, k, _) in enumerate(todo) if not r.params.greedy]
        if sampled:
            self._sample(logits, sampled, drafts, out)
        out.device = DeviceTokens(drafts, {r.request_id: i for i, (r, _, _) in enumerate(todo)},
                                  {r.request_id: 0 for r, _, _ in todo})
        out.token_ids = {r.request_id: [PLACEHOLDER] * k for r, k, _ in todo}
        return out

    def _draft_logits(self, todo: list[tuple[Request, int, _ReqState]], sources: dict) -> torch.Tensor:
        """Write pending context K/V, then one drafting step: logits [R, k, V] float32 (a view of
        a graph's output: read before the next step)."""
        w = self.step.w
        pending = self._pending
        inline = {r.request_id for r, _, _ in todo
                  if r.request_id not in pending or pending[r.request_id][3] - pending[r.request_id][2] <= w}
        self._flush_context(inline)
        bs = self.block_size
        rows = []
        for r, _, st in todo:
            ctx_rows, ctx_pos, ctx_slots = [], [], []
            sp = pending.get(r.request_id)
            if sp is not None and r.request_id in inline:
                _, row, lo, hi, blocks = sp
                ctx_rows, ctx_pos = list(range(row, row + hi - lo)), list(range(lo, hi))
                ctx_slots = [blocks[p // bs - lo // bs] * bs + p % bs for p in ctx_pos]
            anchor = r.num_tokens - 1
            self.block_hash.pop(r.block_ids[anchor // bs], None)  # the block's K/V land there
            owner = (r.request_id, "out", r.num_tokens - 1 - r.num_prompt_tokens)
            rows.append(DraftRow(ctx_rows, ctx_pos, ctx_slots, r.all_token_ids[-1], owner, anchor, st.ctx_start,
                                 r.block_ids))
        return self.step.run(rows, self._captured, sources)

    def _sample(self, logits: torch.Tensor, sampled: list[tuple[int, Request, int]], drafts: torch.Tensor,
                out: Proposal) -> None:
        """Each draft j drawn from the drafter's distribution q_j under the request's sampling
        parameters; q is returned for rejection sampling (any q keeps verification lossless).
        The draw for output index i is keyed by (request, i) like the draft model's (salt 1), so
        drafting a position again (another batch, the overlapped loop, after preemption) draws
        the same token from the same q."""
        rows = torch.cat([logits[i, :k] for i, _, k in sampled])
        rp = row_params([r.params for _, r, _ in sampled], [k for _, _, k in sampled], rows.shape[-1], rows.device)
        probs = probs_from_logits(rows, rp)
        r0 = 0
        for i, r, k in sampled:
            q = probs[r0 : r0 + k]
            base = len(r.output_token_ids)  # draft j predicts output index base + j
            for j in range(k):
                drafts[i, j] = torch.multinomial(q[j], 1, generator=self.generators.at(r, base + j))[0]
            out.probs[r.request_id] = q
            r0 += k
