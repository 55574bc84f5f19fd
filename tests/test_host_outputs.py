"""Host-side output mechanics: FINAL_ONLY outputs (what LLM.generate asks for), text detokenized
once at the end for them, the detokenizer's context memo, and placeholder-free streamed tokens."""

from __future__ import annotations

import itertools
import random

import pytest
from tiny import real_tokenizer, text_model, tiny_config, tiny_engine, tiny_model

from verispec import SamplingParams
from verispec.core.placeholder import PLACEHOLDER
from verispec.engine import detokenizer
from verispec.engine.detokenizer import IncrementalDetokenizer
from verispec.entrypoints.llm import LLM
from verispec.sampling_params import RequestOutputKind

FINAL = RequestOutputKind.FINAL_ONLY
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def model():
    return tiny_model(tiny_config(vocab=512))


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(10, vocab - 10) for _ in range(rng.randrange(2, 6))]
        out.append((motif * 12)[: rng.randrange(8, 40)])
    return out


def drive(engine, ps: list[list[int]], params: list[SamplingParams]) -> tuple[dict, list]:
    """Step to completion; returns the final output of each request and every output returned."""
    for i, (p, sp) in enumerate(zip(ps, params, strict=True)):
        engine.add_request(f"r{i}", None, sp, p)
    final, seen = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(out)
            if out.finished:
                final[out.request_id] = out
    return final, seen


def summary(out) -> list[tuple]:
    return [(c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.spec_num_draft_tokens,
             c.spec_num_accepted_tokens, c.spec_accepted_per_pos) for c in out.outputs]


def mixed_params(kind: RequestOutputKind) -> list[SamplingParams]:
    """Greedy and sampled, n > 1, stop strings and ids, logprobs: every output path."""
    return [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, output_kind=kind),
        SamplingParams(temperature=0.9, seed=3, max_tokens=25, n=2, output_kind=kind),
        SamplingParams(temperature=0.0, max_tokens=40, stop=["e", "ab"], output_kind=kind),
        SamplingParams(temperature=0.7, seed=5, max_tokens=20, stop_token_ids=[300], logprobs=2, output_kind=kind),
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=5, skip_special_tokens=False, output_kind=kind),
    ]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("spec", [None, NGRAM])
def test_final_only_returns_the_same_final_outputs_once(model, async_scheduling: bool, spec) -> None:
    ps = prompts(5, 512)
    runs = {}
    for kind in RequestOutputKind:
        eng = tiny_engine(model, spec=spec, async_scheduling=async_scheduling)
        runs[kind] = drive(eng, ps, mixed_params(kind)), eng.get_metrics()
    (cum, cum_seen), cum_metrics = runs[RequestOutputKind.CUMULATIVE]
    (fin, fin_seen), fin_metrics = runs[FINAL]
    assert {r: summary(o) for r, o in fin.items()} == {r: summary(o) for r, o in cum.items()}
    assert fin_metrics == cum_metrics
    assert all(o.finished for o in fin_seen) and len(fin_seen) == len(ps)
    assert len(cum_seen) > 3 * len(ps)  # the streaming run did return intermediate outputs


@pytest.mark.parametrize("skip", [True, False])
def test_deferred_text_equals_streamed_text(skip: bool) -> None:
    """FINAL_ONLY without stop strings detokenizes each sequence once, at the end: the text is the
    one the step-by-step detokenizer streams (random tokens over the whole vocabulary, with
    characters split across tokens and special tokens)."""
    m = text_model()
    ps = prompts(6, 151_000, seed=1)
    texts = {}
    for kind in RequestOutputKind:
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, ignore_eos=True, skip_special_tokens=skip,
                                 output_kind=kind) for s in range(len(ps))]
        final, _ = drive(tiny_engine(m), ps, params)
        texts[kind] = {r: (o.outputs[0].text, o.outputs[0].token_ids) for r, o in final.items()}
    assert texts[FINAL] == texts[RequestOutputKind.CUMULATIVE]
    assert any(t for t, _ in texts[FINAL].values())


def test_final_only_detokenizes_once_per_sequence(model, monkeypatch) -> None:
    calls = []
    add = IncrementalDetokenizer.add_tokens
    monkeypatch.setattr(IncrementalDetokenizer, "add_tokens", lambda self, ids: calls.append(len(ids)) or add(self, ids))
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, output_kind=FINAL)
    drive(tiny_engine(model), prompts(3, 512), [params] * 3)
    assert calls == [20, 20, 20]
    calls.clear()
    drive(tiny_engine(model), prompts(1, 512), [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                                               stop=["never!"], output_kind=FINAL)])
    assert len(calls) == 20  # stop strings are looked for as the text grows


def test_generate_asks_for_final_only_without_touching_params(model) -> None:
    llm = LLM.__new__(LLM)  # an LLM around a tiny engine (no model load)
    llm.engine, llm._ids = tiny_engine(model), itertools.count()
    seen = []
    add = llm.engine.add_request
    llm.engine.add_request = lambda rid, text, sp, ids: seen.append(sp) or add(rid, text, sp, ids)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts(3, 512), sampling_params=sp)
    assert sp.output_kind is RequestOutputKind.CUMULATIVE
    assert [p.output_kind for p in seen] == [FINAL] * 3 and len({id(p) for p in seen}) == 1
    assert len(outs) == 3 and all(o.finished and len(o.outputs[0].token_ids) == 8 for o in outs)


def test_output_kind_is_validated() -> None:
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="final")


@pytest.mark.parametrize("spec", [None, NGRAM])
def test_streamed_token_ids_hold_no_placeholders(model, spec) -> None:
    """The overlapped loop's outputs carry the tokens known on the host, never its placeholders."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=1)
    _, seen = drive(tiny_engine(model, spec=spec, async_scheduling=True), prompts(4, 512), [params] * 4)
    for out in seen:
        c = out.outputs[0]
        assert PLACEHOLDER not in c.token_ids
        assert len(c.logprobs) == len(c.token_ids)


def test_context_memo_saves_a_decode_per_token() -> None:
    """After the first pass over a text, each new token costs one decode (its window), not two."""
    tok = real_tokenizer()
    calls = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    counting = Counting()
    ids = tok.encode("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n")
    texts, counts = [], []
    for _ in range(2):
        calls.clear()
        det = IncrementalDetokenizer(counting, [1, 2, 3])
        texts.append("".join(det.add_tokens([t]) for t in ids) + det.flush())
        counts.append(len(calls))
    assert texts[0] == texts[1] == tok.decode(ids)
    assert counts[1] == len(ids) + 2  # one window decode per token, plus the prompt context and the flush
    assert counts[0] > counts[1]  # the first pass fills the memo: context decodes too
    assert detokenizer._ContextLengths.of(counting) is detokenizer._ContextLengths.of(counting)


@pytest.mark.parametrize("bad", [{"max_tokens": 2}, "greedy", [SamplingParams(), {"max_tokens": 2}]])
def test_generate_refuses_params_that_are_not_sampling_params(model, bad) -> None:
    """vLLM takes a SamplingParams or a list of them; anything else is a TypeError saying so, and nothing
    is left queued in the engine."""
    llm = LLM.__new__(LLM)
    llm.engine, llm._ids = tiny_engine(model), itertools.count()
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of SamplingParams"):
        llm.generate(["x", "y"], bad, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
