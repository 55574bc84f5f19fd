"""Structured outputs (xgrammar): every output follows its constraint, the grammar mask applies when
drafts are verified (outputs token-identical to constrained plain decoding for every speculative method,
sync and async, with equal acceptance counters), and a planted unmasked verification is caught.

Tiny random-weight models over the real Qwen2.5 tokenizer's whole vocabulary (151936 logits, more than
the tokenizer's ids: the extra ids are masked); a random model stops only where its grammar makes it, so
the constraints bound every string and number."""

from __future__ import annotations

import json
import re

import pytest
import torch
from structured_cases import CHOICES, EBNF, REGEXES, SCHEMAS, json_problem, parses_ebnf
from tiny import (
    greedy_continuation,
    real_tokenizer,
    run_all,
    text_model,
    tiny_config,
    tiny_engine,
    tiny_model,
    trained_tiny_drafter,
)

from verispec.core.faults import Faults
from verispec.sampling_params import SamplingParams, StructuredOutputsParams

pytest.importorskip("xgrammar")
pytest.importorskip("jsonschema")

VOCAB = 151936


def constraints() -> list[tuple[StructuredOutputsParams, object]]:
    """(constraint, check) pairs: check(text) -> None when text satisfies it, else a message."""
    out: list[tuple[StructuredOutputsParams, object]] = []
    for s in SCHEMAS:
        out.append((StructuredOutputsParams(json=s, disable_any_whitespace=True), lambda t, s=s: json_problem(t, s)))
    for r in REGEXES:
        out.append((StructuredOutputsParams(regex=r), lambda t, r=r: None if re.fullmatch(r, t) else f"{t!r} !~ {r}"))
    for c in CHOICES:
        out.append((StructuredOutputsParams(choice=c), lambda t, c=c: None if t in c else f"{t!r} not in {c}"))
    out.append((StructuredOutputsParams(grammar=EBNF), lambda t: None if parses_ebnf(t) else f"{t!r} not in EBNF"))
    return out


@pytest.fixture(scope="module")
def tok():
    return real_tokenizer()


@pytest.fixture(scope="module")
def target():
    return text_model()


def test_params_are_checked_at_construction():
    """Exactly one kind; a bad schema, regex, grammar or choice list is a ValueError naming the problem."""
    bad = [
        (dict(), "exactly one"),
        (dict(json={"type": "object"}, regex="a"), "exactly one"),
        (dict(json={"type": "strin"}), "StructuredOutputsParams.json"),
        (dict(json={"type": "integer", "minimum": "zero"}), "minimum"),
        (dict(json={"type": "integer", "minimum": 5, "maximum": 1}), "minimum greater than maximum"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(json={"properties": {"a": {"$ref": "#/$defs/missing"}}}), "missing"),
        (dict(regex="(ab"), "parenthesis"),
        (dict(grammar='root ::= item\n'), 'Rule "item" is not defined'),
        (dict(grammar="root ::= ("), "StructuredOutputsParams.grammar"),
        (dict(choice=[]), "StructuredOutputsParams.choice"),
        (dict(choice=["a", 3]), "StructuredOutputsParams.choice"),
    ]
    for kw, needle in bad:
        with pytest.raises(ValueError, match=re.escape(needle)):
            StructuredOutputsParams(**kw)
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
    for lb in ({"1": 2.0}, {1: 101.0}, {-1: 1.0}, {1: "x"}, [1]):
        with pytest.raises(ValueError, match="SamplingParams.logit_bias"):
            SamplingParams(logit_bias=lb)
    assert SamplingParams(logit_bias={5: -100, 7: 2.5}).logit_bias == {5: -100, 7: 2.5}


def test_logit_bias_out_of_vocab_is_refused(target):
    eng = tiny_engine(target)
    with pytest.raises(ValueError, match="logit_bias"):
        eng.add_request("r", None, SamplingParams(logit_bias={VOCAB: 1.0}), [1, 2, 3])
    assert not eng.has_unfinished_requests()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_follows_its_constraint(tok, target, temperature):
    """23 JSON schemas (nested objects, arrays, enums, bounded integers, string patterns, optional
    fields, anyOf, const, prefixItems), 4 regexes, 2 choice lists and an EBNF grammar, batched in one
    engine, greedy and sampled: every output satisfies its constraint and ends with "stop"."""
    cases = constraints()
    assert len(SCHEMAS) >= 20
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=120, structured_outputs=c)
              for i, (c, _) in enumerate(cases)]
    eng = tiny_engine(target)
    outs = run_all(eng, [tok.encode(f"Answer {i}:") for i in range(len(cases))], params)
    problems = []
    for (_, check), o in zip(cases, outs, strict=True):
        c = o.outputs[0]
        if c.finish_reason != "stop" or c.token_ids[-1] not in tok.eos_token_ids:
            problems.append(f"finished with {c.finish_reason}: {c.text!r}")
        elif (p := check(c.text)) is not None:
            problems.append(p)
    assert problems == []
    assert eng.get_metrics()["structured_output_refused_tokens"] == 0


def test_unconstrained_output_breaks_the_constraints(tok, target):
    """The gate has teeth: the same prompts without the grammar give outputs that fail the checks."""
    cases = constraints()[:6]
    eng = tiny_engine(target)
    outs = run_all(eng, [tok.encode(f"Answer {i}:") for i in range(len(cases))],
                   SamplingParams(temperature=0.0, max_tokens=20))
    assert all(check(o.outputs[0].text) is not None for (_, check), o in zip(cases, outs, strict=True))


def test_logit_bias_applies_in_sampling_and_verification(tok, target):
    """+100 on one token makes it every greedy pick; with ngram drafts (which the bias makes right)
    the output is the same and the drafts are accepted."""
    forced = tok.encode(" hello")[0]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias={forced: 100.0})
    prompt = tok.encode("say hello hello hello")
    plain = run_all(tiny_engine(target), [prompt], sp)[0].outputs[0].token_ids
    assert plain == [forced] * 12
    eng = tiny_engine(target, spec={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                    "adaptive": False})
    assert run_all(eng, [prompt], sp)[0].outputs[0].token_ids == plain
    assert eng.get_metrics()["spec_decode_num_accepted_tokens"] > 0
    # A -100 bias on the unbiased argmax moves the pick off it.
    free = run_all(tiny_engine(target), [prompt], SamplingParams(temperature=0.0, max_tokens=1))[0].outputs[0].token_ids
    banned = run_all(tiny_engine(target), [prompt], SamplingParams(temperature=0.0, max_tokens=1,
                                                                  logit_bias={free[0]: -100.0}))[0].outputs[0].token_ids
    assert banned != free


# ---- speculation ------------------------------------------------------------------------------------
SPEC = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "self": {"method": "self", "num_speculative_tokens": 3},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "model": "draft"},
    "dflash": {"method": "dflash", "num_speculative_tokens": 3},
}
NUM_PARITY = 8


@pytest.fixture(scope="module")
def draft():
    return tiny_model(tiny_config(vocab=VOCAB, layers=1), seed=1)


@pytest.fixture(scope="module")
def parity_inputs(tok):
    """Prompts that spell their constraint (so ngram finds drafts), greedy and seeded sampled params."""
    cases = constraints()
    picked = [cases[i] for i in (0, 4, 9, 13, 19, len(SCHEMAS), len(SCHEMAS) + 4, len(cases) - 1)]
    assert len(picked) == NUM_PARITY
    prompts, params = [], []
    for i, (c, _) in enumerate(picked):
        spelled = json.dumps(c.json) if c.json is not None else str(c.regex or c.choice or c.grammar)
        prompts.append(tok.encode(f"Follow {spelled} exactly: {spelled}"))
        temp = 0.0 if i % 3 != 2 else 0.9
        params.append(SamplingParams(temperature=temp, seed=100 + i, max_tokens=80, structured_outputs=c))
    prompts.append(tok.encode("free text next to constrained requests"))  # unconstrained neighbour
    params.append(SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    return prompts, params, [check for _, check in picked]


@pytest.fixture(scope="module")
def dflash_dir(target, parity_inputs, tmp_path_factory):
    from verispec.spec_decode.dflash import save_drafter

    prompts = parity_inputs[0][:4]
    seqs = list(zip(prompts, greedy_continuation(target, prompts, 16), strict=True))
    drafter, _ = trained_tiny_drafter(target, seqs, block_size=4, mask_id=VOCAB - 1, steps=20, lr=2e-2)
    path = tmp_path_factory.mktemp("structured_dflash")
    save_drafter(drafter, path, torch.float32)
    return path


def _run(target, draft, spec, async_scheduling, prompts, params, faults=None, drafter_dir=None):
    if spec is not None:
        spec = {**spec, "adaptive": False}
        if spec["method"] == "dflash":
            spec["model"] = str(drafter_dir)
    kw = {"faults": faults} if faults is not None else {}
    eng = _engine(target, spec, draft if spec and spec["method"] == "draft_model" else None, async_scheduling, **kw)
    outs = run_all(eng, prompts, params)
    m = eng.get_metrics()
    counters = {k: m[k] for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                  "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos")}
    return [o.outputs[0] for o in outs], counters, m


def _engine(target, spec, draft_override, async_scheduling, faults=None):
    if faults is None:
        return tiny_engine(target, spec=spec, draft_override=draft_override, async_scheduling=async_scheduling)
    # A planted fault reaches the parts through assemble_parts (tests plant it there, never globally).
    from verispec.config import EngineConfig, SpeculativeConfig
    from verispec.engine.builder import assemble_parts
    from verispec.engine.engine import LLMEngine

    cfg = EngineConfig(model="tiny", device="cpu", dtype="float32", max_num_batched_tokens=256, num_gpu_blocks=256,
                       gc_freeze=False, async_scheduling=async_scheduling,
                       speculative_config=SpeculativeConfig.from_dict(spec))
    dm = None if draft_override is None else (real_tokenizer(), draft_override.config, draft_override)
    parts = assemble_parts(cfg, real_tokenizer(), target, torch.device("cpu"), torch.float32, draft_model=dm,
                           faults=faults)
    return LLMEngine(cfg, parts)


@pytest.fixture(scope="module")
def plain(target, draft, parity_inputs):
    prompts, params, _ = parity_inputs
    return _run(target, draft, None, False, prompts, params)


@pytest.mark.parametrize("method", list(SPEC))
def test_speculation_is_exact_under_grammars(target, draft, parity_inputs, plain, method, request):
    """With each method, sync and async: greedy constrained outputs are token-identical to constrained
    plain decoding, every output follows its constraint, and the acceptance counters (and the sampled
    requests' tokens) agree between the loops."""
    prompts, params, checks = parity_inputs
    drafter_dir = request.getfixturevalue("dflash_dir") if method == "dflash" else None
    plain_outs, _, _ = plain
    runs = {mode: _run(target, draft, SPEC[method], mode, prompts, params, drafter_dir=drafter_dir)
            for mode in (False, True)}
    for mode, (outs, counters, m) in runs.items():
        for i, (sp, o, p) in enumerate(zip(params, outs, plain_outs, strict=True)):
            if sp.greedy:
                assert o.token_ids == p.token_ids, (method, mode, i)
            if i < NUM_PARITY:
                assert o.finish_reason == "stop" and checks[i](o.text) is None, (method, mode, i, o.text)
        assert m["structured_output_refused_tokens"] == 0
        assert counters["spec_decode_num_drafts"] > 0
    (sync_outs, sync_c, _), (async_outs, async_c, _) = runs[False], runs[True]
    assert [o.token_ids for o in async_outs] == [o.token_ids for o in sync_outs]
    assert async_c == sync_c
    if method in ("self", "ngram"):
        assert sync_c["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_grammar_stop_ends_the_step_under_ignore_eos(qwen05_path, async_scheduling):
    """ignore_eos with a grammar, on the real 0.5B: the grammar's stop token (EOS) still ends the request,
    also when drafts past it are accepted in the same step (self-drafting: past the stop the rows are
    unmasked and the drafts are the target's own tokens, "\nI'm ..."). Found on the H200, where bench
    structured sets ignore_eos: draft_model emitted tokens the grammar refused and text after the JSON.
    Before the fix: "yes<|im_end|>\n<|endoftext|>I'm", 8 refused tokens."""
    from verispec import LLM

    spec = {"method": "self", "num_speculative_tokens": 4, "adaptive": False}
    llm = LLM(str(qwen05_path), device="cpu", dtype="float32", quantization="none", max_model_len=512,
              num_gpu_blocks=64, speculative_config=spec, async_scheduling=async_scheduling)  # 2 short chats
    qs = ["Is 7 a prime number? Answer yes or no.", "Is 9 a prime number? Answer yes or no."]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    outs = llm.chat([[{"role": "user", "content": q}] for q in qs], sp)
    eos = llm.tokenizer.eos_token_ids
    for o in outs:
        ids = o.outputs[0].token_ids
        assert o.outputs[0].text in ("yes", "no") and o.outputs[0].finish_reason == "stop", o.outputs[0].text
        assert ids[-1] in eos and not any(t in eos for t in ids[:-1])
    m = llm.engine.get_metrics()
    assert m["structured_output_refused_tokens"] == 0 and m["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_unmasked_verify_fault_is_caught(target, draft, parity_inputs, plain, async_scheduling):
    """With drafts verified without the grammar mask (the unmasked_verify fault), the "self" drafter's
    drafts (the target's own unmasked choices) get through: outputs differ from constrained plain
    decoding or fail their constraint, and the engine counts tokens the grammar refused."""
    prompts, params, checks = parity_inputs
    outs, _, m = _run(target, draft, SPEC["self"], async_scheduling, prompts, params,
                      faults=Faults(frozenset(["unmasked_verify"])))
    plain_outs = plain[0]
    caught = [i for i in range(NUM_PARITY)
              if checks[i](outs[i].text) is not None or (params[i].greedy and outs[i].token_ids != plain_outs[i].token_ids)]
    assert caught
    assert m["structured_output_refused_tokens"] > 0
