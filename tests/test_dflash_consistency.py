"""DFlash train/inference consistency: the block logits the engine's proposer computes for a request
that has accepted exactly the tokens up to position p equal the logits that training computes for an
anchor at p (same target features, float32), through chunked prefill, prefix-cache reuse and many
steps of partial acceptance (the context cache after every rollback equals a fresh computation)."""

from __future__ import annotations

import random

import pytest
import torch
from tiny import greedy_continuation, run_all, tiny_config, tiny_engine, tiny_model, trained_tiny_drafter

from verispec import SamplingParams
from verispec.spec_decode.dflash import save_drafter
from verispec.spec_decode.dflash_model import DFlashDrafter, new_config
from verispec.train import data as dflash_data
from verispec.train import evaluate, objective

VOCAB = tiny_config().vocab_size
MASK_ID = VOCAB - 1
BLOCK = 6  # drafter block: anchor + 5 drafts
GREEDY = SamplingParams(temperature=0.0, max_tokens=22, ignore_eos=True)


def shared_prefix_prompts(n: int = 3, seed: int = 5) -> list[list[int]]:
    """A shared 19-token prefix (two full KV blocks of 8: prefix-cache hits) + own tails."""
    rng = random.Random(seed)
    base = [rng.randrange(100, 3000) for _ in range(19)]
    return [base + [rng.randrange(100, 3000) for _ in range(rng.randrange(2, 12))] for _ in range(n)]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def drafter_dir(model, tmp_path_factory):
    cfg = new_config(model, "tiny", MASK_ID, block_size=BLOCK, num_layers=2)
    d = DFlashDrafter(cfg)
    d.init_weights(seed=3, std=0.2)  # large weights: logits depend strongly on context and positions
    path = tmp_path_factory.mktemp("dflash_consistency")
    save_drafter(d, path, torch.float32)
    return path


def training_logits(model, drafter: DFlashDrafter, prompt: list[int], response: list[int],
                    anchors: list[int]) -> torch.Tensor:
    """Block logits [A, B, V] computed exactly as training does: teacher-forced target features
    (dflash_data.extract_features), blocks packed by objective.pack_blocks."""
    layers = tuple(drafter.config.target_layers)
    [sample] = dflash_data.extract_features(model, [(prompt, response)], layers, torch.float32, 4096)
    batch = objective.pack_blocks([sample], torch.tensor([anchors]), drafter.config)
    with torch.no_grad():
        hidden = objective.block_hidden(drafter, model, batch)
    return model.compute_logits(hidden).view(len(anchors), BLOCK, -1)


def training_context(model, drafter: DFlashDrafter, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per drafter layer, the context K/V [T, KH, D] of every position, from training's features."""
    layers = tuple(drafter.config.target_layers)
    [sample] = dflash_data.extract_features(model, [(tokens[:1], tokens[1:])], layers, torch.float32, 4096)
    with torch.no_grad():
        return drafter.context_kv(sample.feats, torch.arange(len(tokens)))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_block_logits_equal_training(model, drafter_dir, async_scheduling):
    ps = shared_prefix_prompts()
    ref = [o.outputs[0].token_ids for o in run_all(tiny_engine(model), ps, GREEDY)]
    # Fixed k: every step drafts a full block, so each request has enough anchors to compare.
    eng = tiny_engine(model, spec={"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": BLOCK - 1,
                                   "adaptive": False},
                      block_size=8, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    prop = eng.proposer
    real_logits, real_propose = prop._draft_logits, prop.propose
    seen: list[tuple[str, int, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = []
    script = iter(range(10**6))
    first: dict[str, tuple[int, int]] = {}  # request -> (ctx_start, written_from) at its first draft

    def recording_logits(todo, sources):
        logits = real_logits(todo, sources)
        for i, (r, k, st) in enumerate(todo):
            assert st.consumed == r.num_tokens - 1  # context: every position before the anchor
            slots = [r.block_ids[p // 8] * 8 + p % 8 for p in range(st.consumed)]
            cache = [(c[0][slots].clone(), c[1][slots].clone()) for c in prop.kv]
            seen.append((r.request_id, r.num_tokens - 1, logits[i, :k].clone(), cache))
            first.setdefault(r.request_id, (st.ctx_start, st.written_from))
        return logits

    def scripted(reqs, sources=None):
        """The real drafts are replaced by `a` correct then wrong tokens, a = 0, 1, 2, ... cyclic."""
        out = real_propose(reqs, sources)
        for r in reqs:
            row = None if out.device is None else out.device.rows_by_id.get(r.request_id)
            if row is None:
                continue
            k, n = len(out.token_ids[r.request_id]), len(r.output_token_ids)
            truth = ref[int(r.request_id[1:])][n : n + k]
            a = next(script) % (k + 1)
            want = truth[:a] + [(t + 1) % VOCAB for t in truth[a:]]
            with torch.inference_mode():
                out.device.values[row, :k] = torch.tensor(want)
        return out

    prop._draft_logits, prop.propose = recording_logits, scripted
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", None, GREEDY, p)
        if i == 0:
            for _ in range(4):  # r0 writes (and publishes) the shared prefix blocks first
                eng.step()
    done = {}
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(len(ps))] == ref
    m = eng.get_metrics()
    assert 0 < m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]  # partial acceptance
    assert all(prop.state.get(f"r{i}") is None for i in range(len(ps)))
    assert eng.num_steps and len(seen) > 15

    drafter = prop.drafter
    for i, p in enumerate(ps):
        mine = [(pos, lg, cache) for rid, pos, lg, cache in seen if rid == f"r{i}"]
        assert len(mine) > 4
        want = training_logits(model, drafter, p, ref[i], [pos for pos, _, _ in mine])
        ctx = training_context(model, drafter, p + ref[i])
        for (pos, got, cache), w in zip(mine, want, strict=True):
            k = got.shape[0]
            torch.testing.assert_close(got, w[1 : 1 + k], atol=1e-4, rtol=1e-4,
                                       msg=lambda m, i=i, pos=pos: f"r{i} anchor {pos}: {m}")
            for (ck, cv), (tk, tv) in zip(cache, ctx, strict=True):  # the cache after rollbacks
                torch.testing.assert_close(ck, tk[:pos], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(cv, tv[:pos], atol=1e-4, rtol=1e-4)
    # r1 and r2 started with a prefix-cache hit and drafted from r0's context K/V there.
    assert all(first[f"r{i}"][1] >= 16 and first[f"r{i}"][0] == 0 for i in (1, 2)), first



def test_acceptance_walk_equals_engine_counters(model, tmp_path):
    """Training's held-out acceptance estimate (acceptance_walk) counts exactly what the engine counts
    when it decodes the same responses greedily: same drafts, same accepted tokens per position."""
    rng = random.Random(1)
    ps = [[rng.randrange(100, 3000) for _ in range(rng.randrange(5, 15))] for _ in range(4)]
    seqs = list(zip(ps, greedy_continuation(model, ps, 32), strict=True))
    d, samples = trained_tiny_drafter(model, seqs, BLOCK, MASK_ID, steps=40, lr=2e-2, anchors=16)
    walk = evaluate.acceptance_walk(d, model, samples)
    save_drafter(d, tmp_path, torch.float32)

    # Fixed k: the walk verifies a full block at every step, as the engine does without adaptive speculation.
    eng = tiny_engine(model, spec={"method": "dflash", "model": str(tmp_path), "num_speculative_tokens": BLOCK - 1,
                                   "adaptive": False})
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in run_all(eng, ps, sp)] == [r for _, r in seqs]
    m = eng.get_metrics()
    per_pos = [round(a / m["spec_decode_num_drafts"], 4) for a in m["spec_decode_num_accepted_tokens_per_pos"]]
    assert 0 < m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]
    assert sum(a > 0 for a in m["spec_decode_num_accepted_tokens_per_pos"]) >= 2  # runs of >= 2 accepted
    assert (walk["num_drafts"], walk["num_draft_tokens"], walk["num_accepted_tokens"], walk["accepted_per_pos"]) == (
        m["spec_decode_num_drafts"], m["spec_decode_num_draft_tokens"], m["spec_decode_num_accepted_tokens"], per_pos)
    assert evaluate.engine_walk(eng, seqs) == walk  # the eval script's check, with the engine's own drafter
