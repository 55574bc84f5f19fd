"""The grammar mask at verification, on a hand-made 5-token vocabulary (no model): a draft the grammar
forbids is rejected at its own position (greedy and rejection sampling), the matcher walk through the
drafts leaves the matcher where it was, and the unmasked_verify fault lets the forbidden draft through.
Also: without xgrammar installed, unconstrained generation still imports and a constrained request is
a ValueError saying what to install."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from verispec.core.faults import Faults
from verispec.core.request import Request
from verispec.core.scheduler_output import ScheduledRequest
from verispec.sampling_params import SamplingParams, StructuredOutputsParams

pytest.importorskip("xgrammar")

from verispec.worker.grammar import GrammarBackend, bitmask_rows  # noqa: E402
from verispec.worker.verifier import Verifier  # noqa: E402

A, B, C, EOS, X = 0, 1, 2, 3, 4  # X: an id past the tokenizer's vocabulary (the model has 5 logits)
VOCAB = ["a", "b", "c", ""]
REGEX = "ab+c"


def constrained_request(temperature: float) -> Request:
    so = StructuredOutputsParams(regex=REGEX)
    req = Request("r", [A], SamplingParams(temperature=temperature, max_tokens=8, structured_outputs=so),
                  frozenset([EOS]))
    req.grammar = GrammarBackend(VOCAB, 5, [EOS]).request_grammar(so)
    return req


def target_logits(k: int) -> torch.Tensor:
    """Rows where the unmasked argmax is A, then C (forbidden after "a"), then X, B second best."""
    rows = torch.full((k + 1, 5), -4.0)
    rows[:, B] = 1.0
    rows[0, A], rows[1, C], rows[2, X] = 5.0, 5.0, 5.0
    return rows


def verify_once(req: Request, drafts: list[int], verifier: Verifier) -> list[int]:
    k = len(drafts)
    req.spec_token_ids = list(drafts)
    sampling = [(ScheduledRequest(req, 0, k + 1, k), 0)]
    verdict = verifier.run(target_logits(k), sampling, torch.tensor([drafts]), torch.arange(k + 1), {})
    n = int(verdict.packed[-1])
    return verdict.packed[:n].tolist()


def test_walk_leaves_the_matcher_unchanged():
    req = constrained_request(0.0)
    mask = req.grammar.backend.new_bitmask(3)
    bitmask_rows(req.grammar.matcher, [A, B], mask)
    allowed = [[t for t in range(5) if (int(mask[j, 0]) >> t) & 1] for j in range(3)]
    assert allowed == [[A], [B], [B, C]]  # after "", "a", "ab"; never EOS early, never the id past the vocab
    assert req.grammar.matcher.accept_token(A)  # still at the start


def test_forbidden_draft_rejected_at_its_position_greedy():
    req = constrained_request(0.0)
    assert verify_once(req, [A, C], Verifier(torch.device("cpu"))) == [A, B]


def test_forbidden_draft_never_accepted_by_rejection_sampling():
    req = constrained_request(1.0)
    verifier = Verifier(torch.device("cpu"), seed=3)
    seen = set()
    for i in range(200):
        req.request_id = f"r{i}"  # a fresh generator each time
        out = verify_once(req, [A, C], verifier)
        assert out[0] == A and out[1] == B, out  # A is the only token allowed first; C is masked after it
        seen.add(tuple(out))
    assert seen == {(A, B)}


def test_unmasked_verify_fault_accepts_the_forbidden_draft():
    req = constrained_request(0.0)
    out = verify_once(req, [A, C], Verifier(torch.device("cpu"), faults=Faults(frozenset(["unmasked_verify"]))))
    assert out == [A, C, X]


def test_without_xgrammar_plain_runs_and_constrained_says_what_to_install():
    code = (
        "import sys; sys.modules['xgrammar'] = None\n"
        "from verispec.sampling_params import SamplingParams, StructuredOutputsParams\n"
        "SamplingParams(max_tokens=4, logit_bias={1: 2.0})\n"
        "try:\n"
        "    StructuredOutputsParams(regex='a+')\n"
        "except ValueError as e:\n"
        "    print('ERR', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "ERR structured outputs need the xgrammar package" in r.stdout and "pip install xgrammar" in r.stdout
