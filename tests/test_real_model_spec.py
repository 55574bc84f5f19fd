"""Speculative decoding and sync/async parity on the real qwen2.5-coder-0.5b-instruct, float32, on two
targets (tests/gates.py): the CPU (the torch path) and CUDA with CUDA graphs and the Triton kernels
(marked gpu; there the -m slow cells are fast and run with -m gpu).

The engines here share the target's loaded model (no reload) and differ only in their options."""

from __future__ import annotations

import pytest
from gates import CUDA_ONLY, TARGETS
from parity import STRESS, run_scenario, scenario_params
from tiny import CheapDrafts, tiny_engine

from verispec import SamplingParams

# The parity matrix (the project's core gate) runs by default (~2 min on 2 cores); the
# lossless/oracle checks on the real model are -m slow.

CODE_PROMPTS = [
    "def binary_search(arr, target):\n",
    "<|im_start|>user\nWrite a Python function that checks if a string is a palindrome.<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\n\ndef normalize(v):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
]


@pytest.fixture(scope="module", params=TARGETS)
def target(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def real(target, request):
    """(model, tokenizer): the session's CPU LLM's model, or the real 0.5B on CUDA (conftest.qwen05_gate)."""
    if target == "cpu":
        llm = request.getfixturevalue("llm05")
        return llm.engine.parts.model, llm.tokenizer
    tok, _, model = request.getfixturevalue("qwen05_gate")
    return model, tok


@pytest.fixture(scope="module")
def prompts(real):
    _, tok = real
    return [tok.encode(p) for p in CODE_PROMPTS]


def build(real, spec, async_scheduling, **kw):
    model, _ = real
    override = model if spec and spec["method"] == "draft_model" else None
    return tiny_engine(model, spec=spec, draft_override=override, async_scheduling=async_scheduling,
                       max_model_len=1024, **kw)


def generate(eng, prompts, params):
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", None, params, p)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]


GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def baseline(real, prompts):
    return generate(build(real, None, False), prompts, GREEDY)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "self"])
def test_real_lossless_and_oracle(real, prompts, baseline, method):
    spec = {"method": method, "num_speculative_tokens": 4, "adaptive": False,  # drafts every step
            **({"prompt_lookup_max": 3} if method == "ngram" else {})}
    eng = build(real, spec, False, num_gpu_blocks=10, block_size=16, max_num_batched_tokens=48)
    assert generate(eng, prompts, GREEDY) == baseline
    m = eng.get_metrics()
    assert m["spec_decode_num_drafts"] > 0 and m["num_preemptions"] > 0
    if method == "self":
        # float32 (CPU, and CUDA as measured on the H200): the target drafting for itself accepts every
        # draft (0.99 in bf16 without batch invariance).
        assert m["spec_decode_num_accepted_tokens"] == m["spec_decode_num_draft_tokens"], m


@pytest.mark.slow
@pytest.mark.parametrize("method", ["none", "ngram", "self"])
def test_real_batch_one_equals_batch_n(real, prompts, baseline, method):
    """Plain decoding one request at a time (max_num_seqs=1) gives the batched baseline's tokens, and so
    does each method at batch 4 and at batch 1: a request's tokens do not depend on the batch (float32)."""
    spec = None if method == "none" else {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    for max_num_seqs in (1, len(prompts)):
        eng = build(real, spec, True, max_num_seqs=max_num_seqs)
        assert generate(eng, prompts, GREEDY) == baseline, (method, max_num_seqs)
        if spec:
            assert eng.get_metrics()["spec_decode_num_drafts"] > 0


def parity_cell(real, prompts, spec) -> None:
    """The parity matrix cell with real weights: forced preemption, small chunked prefill,
    prefix-cache hits, requests finishing mid-batch, mixed temperatures with seeds; the synchronous and
    the overlapped loop give the same tokens and the same acceptance counters (per position too)."""
    shared = prompts[1][:40]
    # r0 runs alone first and publishes the shared prefix that r1 and r3 then hit.
    ps = [prompts[1], shared + prompts[2], prompts[3], shared + prompts[0][:5], prompts[2], prompts[0]]
    params = scenario_params(max_tokens=18)
    cells = {}
    # The adaptive policy under a cost where accepted drafts pay (tiny.CheapDrafts, as test_async_parity), so
    # that it drafts whatever this machine's measured step costs are.
    cost = {"step_cost": CheapDrafts()} if spec and spec.get("adaptive") else {}
    for mode in (False, True):
        def make(spec_, a):
            return build(real, spec_, a, **{**STRESS, "num_gpu_blocks": 11, **cost})
        cells[mode] = run_scenario(make, spec, mode, ps, params)
    (s_toks, s_c, s_m, _), (a_toks, a_c, _, eng) = cells[False], cells[True]
    assert a_toks == s_toks
    assert a_c == s_c
    assert s_m["num_preemptions"] > 0
    assert s_m["prefix_cache_hits"] > 0
    if spec:
        assert s_c["spec_decode_num_drafts"] > 0
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


@pytest.mark.parametrize("method", ["none", "ngram", "self"])
def test_real_sync_async_parity(real, prompts, method):
    """parity_cell for each method, k pinned. draft_model is a CUDA cell (test_real_sync_async_parity_more):
    its draft here is the target itself (build()), so on the CPU it runs self's proposer on the same model
    (DraftModelProposer(target), the same k and seed) and its cell repeated the self cell at ~1 minute; the
    draft_model plumbing with a draft of its own is test_async_parity's and test_faults' (tiny models)."""
    from parity import SPECS

    parity_cell(real, prompts, SPECS[method])


@pytest.fixture(scope="module")
def real_drafter(real, tmp_path_factory) -> str:
    """An untrained DFlash drafter (float32) for the real 0.5B, saved in the published layout."""
    import torch

    from verispec.spec_decode.dflash import save_drafter
    from verispec.spec_decode.dflash_model import DFlashDrafter, new_config
    from verispec.train.data import pick_mask_token

    model, tok = real
    cfg = new_config(model, "qwen2.5-coder-0.5b-instruct", pick_mask_token(tok, model.config.vocab_size))
    drafter = DFlashDrafter(cfg)
    drafter.init_weights(seed=1)
    path = tmp_path_factory.mktemp("real_dflash")
    save_drafter(drafter, path, torch.float32)
    return str(path)


CUDA_CELLS = [("draft_model", False), ("dflash", False), ("ngram", True), ("self", True), ("draft_model", True),
              ("dflash", True)]


@pytest.mark.parametrize("target", CUDA_ONLY, scope="module")
@pytest.mark.parametrize("method, adaptive", CUDA_CELLS,
                         ids=["draft_model-pinned", "dflash-pinned", "ngram-adaptive", "self-adaptive",
                              "draft_model-adaptive", "dflash-adaptive"])
def test_real_sync_async_parity_more(real, prompts, method, adaptive, request):
    """The rest of the matrix where it is cheap (CUDA): draft_model and dflash, and the adaptive policy (same inputs in
    both loops, so same plans: exact tokens and counters). dflash-adaptive run on the CPU (--gate-device
    cpu, 11 blocks) preempts a request whose prefill chunk is in flight: the cell the two loops' shared
    publish and admission rules were made for (scheduler.py; it failed before, session 10)."""
    from parity import SPECS

    spec = {**SPECS[method], "adaptive": adaptive}
    if method == "dflash":
        spec["model"] = request.getfixturevalue("real_drafter")
    parity_cell(real, prompts, spec)


@pytest.mark.slow
def test_real_dflash_lossless(real, prompts, baseline, tmp_path):
    """DFlash on the real 0.5B (an untrained drafter in float32, the engine's paged drafting step):
    greedy output identical to no speculation under preemption and chunked prefill."""
    import torch

    from verispec.spec_decode.dflash import save_drafter
    from verispec.spec_decode.dflash_model import DFlashDrafter, new_config
    from verispec.train.data import pick_mask_token

    model, tok = real
    cfg = new_config(model, "qwen2.5-coder-0.5b-instruct", pick_mask_token(tok, model.config.vocab_size))
    drafter = DFlashDrafter(cfg)
    drafter.init_weights(seed=1)
    save_drafter(drafter, tmp_path, torch.float32)
    spec = {"method": "dflash", "model": str(tmp_path), "num_speculative_tokens": 15, "adaptive": False}
    eng = build(real, spec, False, num_gpu_blocks=12, block_size=16, max_num_batched_tokens=48)
    assert generate(eng, prompts, GREEDY) == baseline
    m = eng.get_metrics()
    assert m["spec_decode_num_drafts"] > 0 and m["num_preemptions"] > 0
