"""Sync and async scheduling give identical tokens AND identical acceptance counters (tiny model;
the real-model matrix is in test_async_parity_real.py)."""

from __future__ import annotations

import pytest
from parity import STRESS, run_scenario, scenario_params, scenario_prompts
from tiny import tiny_config, tiny_engine, tiny_model


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
