"""The sync-vs-async parity scenario shared by the parity and fault-injection tests."""

from __future__ import annotations

import random

from verispec import SamplingParams

# k pinned (adaptive off): these drive the mechanics (drafts every step); tests of the policy set
# "adaptive": True themselves.
SPECS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
              "adaptive": False},
    "self": {"method": "self", "num_speculative_tokens": 3, "adaptive": False},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "model": "draft", "adaptive": False},
    "dflash": {"method": "dflash", "num_speculative_tokens": 3, "model": "drafter",  # tests fill in the path
               "adaptive": False},
}


def scenario_prompts(seed: int = 0, n: int = 6, vocab_lo: int = 100, vocab_hi: int = 3000) -> list[list[int]]:
    """Mixed lengths, a shared 40-token prefix (prefix-cache hits), self-repetition (ngram)."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab_lo, vocab_hi) for _ in range(40)]
    out = []
    for i in range(n):
        own = [rng.randrange(vocab_lo, vocab_hi) for _ in range(rng.randrange(3, 25))]
        p = (shared + own) if i % 2 == 0 else own * (1 + i % 3)
        out.append(p)
    return out


def scenario_params(max_tokens: int = 24) -> list[SamplingParams]:
    """Different lengths (requests finish mid-batch, rows reorder) and mixed temperatures/seeds."""
    return [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=max_tokens // 3, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=max_tokens // 2, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=12, max_tokens=max_tokens - 5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    ]


STRESS = dict(num_gpu_blocks=17, block_size=8, max_num_batched_tokens=13)


def run_scenario(make_engine, method: str | dict | None, async_scheduling: bool, prompts, params):
    """(token ids per request, acceptance counters, metrics, engine) for one cell of the matrix. method: a
    SPECS name, or the speculative_config itself (a dict, or None for none)."""
    eng = make_engine(SPECS[method] if isinstance(method, str) else method, async_scheduling)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"r{i}", None, sp, p)
        if i == 0:
            # Let the first request publish its prefix blocks before the others arrive.
            for _ in range(6):
                eng.step()
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    m = eng.get_metrics()
    counters = {k: m[k] for k in (
        "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens_per_pos",
    )}
    toks = [done[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]
    return toks, counters, m, eng


def parity_problems(make_engine, method: str, prompts=None, params=None) -> list[str]:
    """Run the scenario sync and async; list every difference in tokens or counters."""
    prompts = prompts or scenario_prompts()
    params = params or scenario_params()
    s_toks, s_c, _, _ = run_scenario(make_engine, method, False, prompts, params)
    a_toks, a_c, _, eng = run_scenario(make_engine, method, True, prompts, params)
    problems = [f"request {i}: tokens differ" for i, (x, y) in enumerate(zip(s_toks, a_toks, strict=True)) if x != y]
    problems += [f"{k}: sync {s_c[k]} async {a_c[k]}" for k in s_c if s_c[k] != a_c[k]]
    if eng.blocks.num_free_blocks != eng.blocks.num_blocks:
        problems.append("blocks leaked")
    return problems
