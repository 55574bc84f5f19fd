"""Batch invariance (KernelOptions.batch_invariant, EngineConfig.batch_invariant): a row's result does not
depend on the other rows of the step.

Kernels, on random odd sizes (Triton's interpreter in float32 on the CPU; compiled in bf16 on CUDA): the
invariant linear layer against torch, and each row's result bit for bit the same at every row count; the
invariant attention against the torch reference, and one query's result bit for bit the same whether it
is decoded alone, among other sequences, verified with drafts after it, prefilled in a chunk, or read
through a wider block table. The checks can fail: the default kernels' split choice moves the bits.
Engine (CUDA, the real 0.5B in bf16): with batch_invariant=True, batch 1 and batch 16 give the same
tokens, speculation gives plain decoding's tokens, and the self oracle accepts every draft."""

from __future__ import annotations

import pytest
import torch

from verispec.attention.reference import reference_attention
from verispec.core.options import KernelOptions
from verispec.kernels import invariant as inv
from verispec.kernels import paged_attention as pa
from verispec.worker.inputs import SeqChunk, build_batch

CPU = pytest.param("cpu", torch.float32, id="cpu-fp32")
GPU = pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu)
INVARIANT = KernelOptions(batch_invariant=True)


def tol(dtype: torch.dtype) -> dict:
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def rand(*shape, seed: int, device: str, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(device, dtype)


def linear_ref(x, w, b=None, silu_mul=False):
    y = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    if silu_mul:
        y = torch.nn.functional.silu(y[:, : w.shape[0] // 2]) * y[:, w.shape[0] // 2 :]
    return y


# ---- linear ------------------------------------------------------------------------------------------

def test_invariant_config_for_the_05b_shapes():
    """One config per weight (no row count in it): the 0.5B's layers and the splits they get."""
    want = {(1152, 896, False): 2, (896, 896, False): 2, (4864, 896, True): 1, (896, 4864, False): 8,
            (151936, 896, False): 1}
    for (n, k, silu), split in want.items():
        c = inv.invariant_config(n, k, silu)
        assert (c["BLOCK_M"], c["BLOCK_N"], c["SPLIT_K"]) == (32, 32, split), (n, k, silu)
    with pytest.raises(ValueError, match="non-empty"):
        inv.invariant_config(0, 896)


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
@pytest.mark.parametrize("m,n,k", [(1, 37, 129), (5, 203, 333), (37, 51, 600), (70, 45, 1100)])
@pytest.mark.parametrize("bias", [False, True])
def test_invariant_linear_matches_torch(device, dtype, m, n, k, bias):
    x = rand(m, k, seed=m + n, device=device, dtype=dtype)
    w = rand(n, k, seed=k, device=device, dtype=dtype, scale=k**-0.5)
    b = rand(n, seed=n, device=device, dtype=dtype) if bias else None
    out = inv.linear(x, w, b, options=INVARIANT)
    assert out.shape == (m, n) and out.dtype == dtype
    torch.testing.assert_close(out.float(), linear_ref(x, w, b).to(dtype).float(), **tol(dtype))
    wide = inv.linear(x, w, b, out_dtype=torch.float32, options=INVARIANT)
    assert wide.dtype == torch.float32 and torch.equal(wide, out.float())  # rounded to x's dtype, then widened


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
@pytest.mark.parametrize("inter,k", [(26, 96), (101, 600)])
def test_invariant_gate_up_silu_matches_torch(device, dtype, inter, k):
    base = rand(74, k + 3, seed=inter, device=device, dtype=dtype)
    x = base[::2, :k]  # strided rows
    w = rand(2 * inter, k, seed=k, device=device, dtype=dtype, scale=k**-0.5)
    out = inv.gate_up_silu(x, w, INVARIANT)
    assert out.shape == (37, inter)
    torch.testing.assert_close(out.float(), linear_ref(x, w, silu_mul=True).to(dtype).float(), **tol(dtype))


def rows_problems(fn, x: torch.Tensor, counts: tuple[int, ...]) -> list[str]:
    """Row counts m (and single rows) whose results differ bit for bit from the same rows computed with
    all of x's rows in one call."""
    full = fn(x)
    problems = [f"first {m} rows" for m in counts if not torch.equal(fn(x[:m]), full[:m])]
    for i in (0, x.shape[0] // 2, x.shape[0] - 1):
        if not torch.equal(fn(x[i : i + 1]), full[i : i + 1]):
            problems.append(f"row {i} alone")
    return problems


@pytest.mark.parametrize("n,k,silu", [(51, 96, False), (45, 1100, False), (30, 600, True)],
                         ids=["one-split", "split-k", "silu-split-k"])
def test_invariant_linear_rows_bitwise_across_row_counts(n, k, silu):
    """Interpreter, float32: row i's result at M = 1, 2, 5, 33, 37, 70 is the same bits (70 rows: three
    M tiles). Bias on the plain layers."""
    x = rand(70, k, seed=k, device="cpu", dtype=torch.float32)
    w = rand(2 * n if silu else n, k, seed=n, device="cpu", dtype=torch.float32, scale=k**-0.5)
    b = None if silu else rand(n, seed=3, device="cpu", dtype=torch.float32)
    fn = (lambda t: inv.gate_up_silu(t, w, INVARIANT)) if silu else (lambda t: inv.linear(t, w, b, options=INVARIANT))
    assert rows_problems(fn, x, (1, 2, 5, 33, 37)) == []


LAYERS_05B = {"qkv": (1152, 896, False, True), "o": (896, 896, False, False), "gate_up": (4864, 896, True, False),
              "down": (896, 4864, False, False), "lm_head": (151936, 896, False, False)}


@pytest.mark.gpu
@pytest.mark.parametrize("layer", LAYERS_05B)
def test_invariant_linear_rows_bitwise_on_cuda(layer):
    """bf16 on CUDA, the 0.5B's shapes: each row's result at M = 1 equals its row at M = 37 and 256 bit
    for bit (and in between); the default kernels (GEMV at 1 row, skinny / cuBLAS / split-K by rows) do
    not promise it."""
    n, k, silu, bias = LAYERS_05B[layer]
    x = rand(256, k, seed=1, device="cuda", dtype=torch.bfloat16)
    w = rand(2 * n if silu else n, k, seed=2, device="cuda", dtype=torch.bfloat16, scale=k**-0.5)
    b = rand(n, seed=3, device="cuda", dtype=torch.bfloat16) if bias else None
    if silu:
        def fn(t):
            return inv.gate_up_silu(t, w, INVARIANT)
    else:
        def fn(t):
            return inv.linear(t, w, b, out_dtype=torch.float32 if layer == "lm_head" else None, options=INVARIANT)
    assert rows_problems(fn, x, (1, 2, 5, 16, 17, 37, 64, 100)) == []
    torch.testing.assert_close(fn(x).float(), linear_ref(x, w, b, silu).to(torch.bfloat16).float(),
                               **tol(torch.bfloat16))


# ---- attention ---------------------------------------------------------------------------------------

HEADS, KV_HEADS, HEAD_DIM, PAGE = 14, 2, 64, 16


def attention_case(kv: torch.Tensor, target_q: torch.Tensor, ctx: int, case: str, options: KernelOptions,
                   spare: list[int], num_splits: int | None = None) -> torch.Tensor:
    """The output row of the target query (position ctx - 1 of a sequence whose keys live in blocks
    0..) in one kind of step; its keys and its query vector are the same in every case."""
    dev, dtype = kv.device, kv.dtype
    blocks = list(range(-(-(ctx + 3) // PAGE)))
    others = [SeqChunk([0] * 4, 37, spare[:3]), SeqChunk([0], 20, spare[3:5])]  # other sequences, other blocks
    if case == "decode":
        chunks, at = [SeqChunk([0], ctx - 1, blocks)], 0
    elif case == "decode-batch":
        chunks, at = [others[0], SeqChunk([0], ctx - 1, blocks), others[1]], 4
    elif case == "verify":  # the target query first, 3 drafts after it
        chunks, at = [others[1], SeqChunk([0] * 4, ctx - 1, blocks)], 1
    elif case == "prefill":  # the whole sequence in one chunk: the target query is its last
        chunks, at = [SeqChunk([0] * ctx, 0, blocks)], ctx - 1
    elif case == "wide-table":  # a block table with 20 more columns than the target's (more, empty, splits)
        chunks, at = [SeqChunk([0], ctx - 1, blocks), SeqChunk([0], 3, spare[:20] + blocks)], 0
    else:
        raise ValueError(case)
    _, _, meta = build_batch(chunks, PAGE, dev)
    t = meta.slot_mapping.shape[0]
    q = rand(t, HEADS, HEAD_DIM, seed=t, device=str(dev), dtype=dtype)
    q[at] = target_q
    out = pa.triton_attention(q, kv, meta, HEAD_DIM**-0.5, num_splits=num_splits, options=options)
    ref = reference_attention(q.float(), kv.float(), meta, HEAD_DIM**-0.5)
    torch.testing.assert_close(out.float(), ref, **tol(dtype))
    return out[at]


CASES = ("decode", "decode-batch", "verify", "prefill", "wide-table")


def _kv_and_query(device, dtype, ctx):
    blocks = -(-(ctx + 3) // PAGE) + 20
    kv = rand(2, blocks * PAGE, KV_HEADS, HEAD_DIM, seed=ctx, device=device, dtype=dtype)
    spare = list(range(blocks - 20, blocks))
    return kv, rand(HEADS, HEAD_DIM, seed=7, device=device, dtype=dtype), spare


@pytest.mark.parametrize("device,dtype,ctx,split", [
    pytest.param("cpu", torch.float32, 150, 64, id="cpu-fp32"),
    pytest.param("cuda", torch.bfloat16, 700, 256, id="cuda-bf16", marks=pytest.mark.gpu)])
def test_invariant_attention_query_is_the_same_in_every_step(device, dtype, ctx, split):
    """One query, its keys fixed: decoded alone, decoded among other sequences, verified with 3 drafts
    after it, the last query of a prefill chunk, read through a wider block table: the same bits."""
    options = KernelOptions(batch_invariant=True, invariant_kv_split=split)
    kv, target_q, spare = _kv_and_query(device, dtype, ctx)
    outs = {c: attention_case(kv, target_q, ctx, c, options, spare) for c in CASES}
    differ = [c for c in CASES if not torch.equal(outs[c], outs["decode"])]
    assert differ == []


def test_default_attention_is_not_invariant_so_the_check_can_fail():
    """The same comparison with the default kernel and two split factors finds differing bits: what
    test_invariant_attention_query_is_the_same_in_every_step would see if invariance broke."""
    kv, target_q, spare = _kv_and_query("cpu", torch.float32, 150)
    a = attention_case(kv, target_q, 150, "decode", KernelOptions(), spare, num_splits=1)
    b = attention_case(kv, target_q, 150, "decode", KernelOptions(), spare, num_splits=3)
    assert not torch.equal(a, b)


def test_invariant_kv_split_must_be_a_multiple_of_the_key_tile():
    kv, target_q, spare = _kv_and_query("cpu", torch.float32, 40)
    with pytest.raises(ValueError, match="invariant_kv_split"):
        attention_case(kv, target_q, 40, "decode", KernelOptions(batch_invariant=True, invariant_kv_split=100), spare)


# ---- model (CUDA, a tiny random model in bf16) -------------------------------------------------------

@pytest.mark.gpu
def test_invariant_model_rows_do_not_depend_on_the_batch():
    """A whole model's forward (linear layers, norms, attention) with the invariant kernels, bf16 on CUDA:
    each sequence's hidden states are the same bits whether its prefill chunk and its decode step run
    alone or next to other sequences."""
    from tiny import tiny_config, tiny_model

    from verispec.models.kernel_path import enable_triton
    from verispec.models.qwen2 import build_model
    from verispec.worker.inputs import allocate_kv_cache

    cpu_model = tiny_model(tiny_config(vocab=512))
    cfg = cpu_model.config
    model = build_model(cfg, dict(cpu_model.named_parameters()), torch.device("cuda"), torch.bfloat16)
    enable_triton(model, options=INVARIANT)
    seqs = [list(range(5, 5 + 37)), [7, 8, 9], list(range(100, 180))]
    tables = [[0, 1, 2], [3], [4, 5, 6, 7, 8, 9]]

    def run(which: list[int]) -> list[torch.Tensor]:
        kv = allocate_kv_cache(cfg.num_layers, 10, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda")
        ids, pos, meta = build_batch([SeqChunk(seqs[i], 0, tables[i]) for i in which], 16, torch.device("cuda"),
                                     with_reference=False)
        h1, _ = model(ids, pos, meta, kv)
        ids, pos, meta = build_batch([SeqChunk([11], len(seqs[i]), tables[i]) for i in which], 16,
                                     torch.device("cuda"), with_reference=False)
        h2, _ = model(ids, pos, meta, kv)
        ends = torch.tensor([len(seqs[i]) for i in which]).cumsum(0).tolist()
        return [torch.cat([h1[e - len(seqs[i]) : e], h2[j : j + 1]]) for j, (i, e) in enumerate(zip(which, ends,
                                                                                                    strict=True))]

    together = run([0, 1, 2])
    for i in range(3):
        assert torch.equal(run([i])[0], together[i]), i


# ---- engine (CUDA, the real 0.5B in bf16) ------------------------------------------------------------

ENGINE_PROMPTS = 16
ENGINE_TOKENS = 64


@pytest.fixture(scope="module")
def bf16_model(qwen05_path):
    """(tokenizer, model): the real 0.5B in bf16 on CUDA."""
    from verispec.loader.model_loader import load_model

    tok, _, model = load_model(str(qwen05_path), torch.device("cuda"), torch.bfloat16, progress=False)
    return tok, model


@pytest.fixture(scope="module")
def heldout_ids(bf16_model) -> list[list[int]]:
    """The first ENGINE_PROMPTS held-out requests (prompts/heldout_requests.jsonl), chat-rendered."""
    from pathlib import Path

    from verispec.bench.prompts import dataset_prompts
    from verispec.train.data import render_prompts

    tok, _ = bf16_model
    path = Path(__file__).resolve().parents[1] / "prompts" / "heldout_requests.jsonl"
    texts = [p.text for p in dataset_prompts(str(path), ENGINE_PROMPTS, ENGINE_TOKENS)]
    return [tok.encode(t) for t in render_prompts(tok, texts)]


def invariant_run(model, prompts, spec=None, **kw) -> tuple[list[list[int]], dict]:
    from tiny import run_all

    from verispec import SamplingParams

    eng = engine_for(model, spec, **kw)
    outs = run_all(eng, prompts, SamplingParams(temperature=0.0, max_tokens=ENGINE_TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], eng.get_metrics()


def engine_for(model, spec=None, **kw):
    from tiny import tiny_engine

    return tiny_engine(model, spec=spec, **{"batch_invariant": True, "max_model_len": 1024, **kw})


@pytest.fixture(scope="module")
def invariant_baseline(bf16_model, heldout_ids):
    """Plain decoding, one request at a time (batch 1: the one-row shapes)."""
    return invariant_run(bf16_model[1], heldout_ids, max_num_seqs=1)[0]


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_invariant_engine_batch_16_equals_batch_1(bf16_model, heldout_ids, invariant_baseline, async_scheduling):
    """bf16, batch_invariant=True: all 16 requests in one batch (CUDA graphs), and eagerly, give the tokens
    of decoding each alone."""
    model = bf16_model[1]
    for kw in ({}, {"enforce_eager": True}):
        toks, _ = invariant_run(model, heldout_ids, async_scheduling=async_scheduling, **kw)
        differ = [i for i, (a, b) in enumerate(zip(toks, invariant_baseline, strict=True)) if a != b]
        assert differ == [], (kw, differ)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["ngram", "self"])
def test_invariant_engine_speculation_equals_plain(bf16_model, heldout_ids, invariant_baseline, method):
    """bf16, batch_invariant=True, batch 16, k = 3 drafts every step: the tokens of plain decoding at batch 1;
    the self oracle accepts every one of its drafts (its draft forwards and the verify forward round alike)."""
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    toks, m = invariant_run(bf16_model[1], heldout_ids, spec)
    differ = [i for i, (a, b) in enumerate(zip(toks, invariant_baseline, strict=True)) if a != b]
    assert differ == []
    assert m["spec_decode_num_draft_tokens"] > 0
    if method == "self":
        assert m["spec_decode_num_accepted_tokens"] == m["spec_decode_num_draft_tokens"], m


@pytest.mark.gpu
def test_invariant_engine_chunked_prefill_and_prefix_hits(bf16_model, heldout_ids, invariant_baseline):
    """Small prefill chunks and prefix-cache hits (each prompt submitted twice) change nothing either."""
    prompts = heldout_ids[:8] + heldout_ids[:8]
    toks, m = invariant_run(bf16_model[1], prompts, max_num_batched_tokens=24)
    assert m["prefix_cache_hits"] > 0
    assert toks == invariant_baseline[:8] * 2


@pytest.mark.gpu
def test_invariant_engine_runs_the_invariant_kernels(bf16_model):
    """batch_invariant=True switches the model onto the invariant kernels (no one-row path); False back."""
    from verispec.kernels import invariant
    from verispec.models.kernel_path import options_of

    model = bf16_model[1]
    engine_for(model)
    assert options_of(model).batch_invariant and model.kernels.linear is invariant.linear
    assert model.kernels.gemv_max_rows == 0 and model.kernels.small_m_max_rows == 0
    engine_for(model, batch_invariant=False)
    assert not options_of(model).batch_invariant and model.kernels.linear is not invariant.linear
