"""The acceptance-counter gate: a scripted proposer drafts [right, right, wrong] from the known greedy
continuation, and the engine's counters (global, per position, per request) must equal a hand count.

Shared by tests/test_spec_decode.py (the gate passes) and tests/test_faults.py (the miscount_rejected
fault makes it fail, and exactly how)."""

from __future__ import annotations

from dataclasses import dataclass

from tiny import run_all, tiny_engine

from verispec import SamplingParams
from verispec.spec_decode.proposer import Proposal, Proposer

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
K = 3  # drafts per step
WRONG = 0  # the third draft: a token the tiny model never picks


class ScriptedProposer(Proposer):
    """Drafts [right, right, wrong] from a known greedy continuation."""

    def __init__(self, continuation: dict[str, list[int]]):
        super().__init__(K)
        self.cont = continuation

    def propose(self, requests, sources=None):
        out = Proposal()
        for r in requests:
            k = self.num_drafts_for(r)
            n = len(r.output_token_ids)
            right = self.cont[r.request_id][n : n + 2]
            out.token_ids[r.request_id] = (right + [WRONG])[:k]
        return out


@dataclass
class HandCount:
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: tuple[int, ...] = (0,) * K
    rejected_drafts: int = 0  # drafts whose last position was rejected (the wrong third token)


def hand_count(ref: list[list[int]]) -> HandCount:
    """Per request: after the first token each step drafts min(3, left - 1) tokens, of which the first two
    are right (so all of them when fewer than 3 are drafted); the step then emits the accepted ones plus one."""
    c = HandCount()
    per_pos = [0] * K
    for toks in ref:
        n = 1
        while n < len(toks):
            k = min(K, len(toks) - n - 1)
            if k == 0:
                n += 1
                continue
            a = min(k, 2)
            c.drafts += 1
            c.draft_tokens += k
            c.accepted += a
            c.rejected_drafts += a < k
            for i in range(a):
                per_pos[i] += 1
            n += a + 1
    c.per_pos = tuple(per_pos)
    return c


@dataclass
class CounterCheck:
    problems: list[str]  # empty: the gate passes
    metrics: dict
    want: HandCount


def check_counters(model, prompts: list[list[int]], ref: list[list[int]]) -> CounterCheck:
    """Run `prompts` greedily with the scripted proposer; `ref` is plain decoding's output for them.
    Problems name what differs: "tokens", or the counter with the engine's and the hand count's values."""
    assert WRONG not in [t for r in ref for t in r], "the scripted wrong draft must never be the right token"
    eng = tiny_engine(model)
    eng.proposer = ScriptedProposer({f"r{i}": ref[i] for i in range(len(prompts))})
    eng.proposer.bind(eng.blocks.num_blocks, eng.blocks.block_size, eng.max_model_len)
    outs = run_all(eng, prompts, GREEDY)
    problems = [] if [o.outputs[0].token_ids for o in outs] == ref else ["tokens: differ from plain decoding"]
    m, want = eng.get_metrics(), hand_count(ref)
    got = {
        "spec_decode_num_drafts": m["spec_decode_num_drafts"],
        "spec_decode_num_draft_tokens": m["spec_decode_num_draft_tokens"],
        "spec_decode_num_accepted_tokens": m["spec_decode_num_accepted_tokens"],
        "spec_decode_num_accepted_tokens_per_pos": tuple(m["spec_decode_num_accepted_tokens_per_pos"]),
        "per_request_spec_num_accepted_tokens": sum(c.spec_num_accepted_tokens for o in outs for c in o.outputs),
    }
    expected = dict(zip(got, (want.drafts, want.draft_tokens, want.accepted, want.per_pos, want.accepted),
                        strict=True))
    problems += [f"{k}: engine {got[k]} hand count {expected[k]}" for k in got if got[k] != expected[k]]
    return CounterCheck(problems, m, want)
