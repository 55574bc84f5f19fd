"""Sync and async scheduling give identical tokens AND identical acceptance counters (tiny model;
the real-model matrix is in test_async_parity_real.py)."""

from __future__ import annotations

import pytest
from parity import STRESS, run_scenario, scenario_params, scenario_prompts
from tiny import run_all, tiny_config, tiny_engine, tiny_model


@pytest.fixture(scope="module")
def models():
    return tiny_model(), tiny_model(tiny_config(layers=1), seed=1)


def make(models):
    target, draft = models

    def build(spec, async_scheduling):
        override = draft if spec and spec["method"] == "draft_model" else None
        return tiny_engine(target, spec=spec, draft_override=override, async_scheduling=async_scheduling, **STRESS)

    return build


@pytest.mark.parametrize("method", ["none", "ngram", "self", "draft_model"])
def test_sync_async_parity(models, method):
    prompts, params = scenario_prompts(), scenario_params()
    sync_toks, sync_c, sync_m, _ = run_scenario(make(models), method, False, prompts, params)
    async_toks, async_c, async_m, eng = run_scenario(make(models), method, True, prompts, params)
    assert async_toks == sync_toks
    assert async_c == sync_c
    assert sync_m["num_preemptions"] > 0 and sync_m["prefix_cache_hits"] > 0
    if method != "none":
        assert sync_c["spec_decode_num_drafts"] > 0
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_async_with_penalties_matches_sync(models):
    """Penalty requests read host token values, so the overlapped loop drains first; nothing is
    lost and the output equals the synchronous loop's."""
    from verispec import SamplingParams

    prompts = scenario_prompts()[:3]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3,
                             presence_penalty=0.5, frequency_penalty=0.3)] * 3
    out = {}
    for mode in (False, True):
        eng = tiny_engine(models[0], async_scheduling=mode)
        out[mode] = [o.outputs[0].token_ids for o in run_all(eng, prompts, params)]
    assert out[True] == out[False]
