"""kernels/cpu_ops.py's C ops (and cpu_gguf.StackedLinear) against the plain-torch modules they stand in for on
a quantized CPU model: RMSNorm (+ residual), SiLU-and-mul, rotary + the K/V write, paged attention (against the
reference backend on every step shape, GQA, windows, kv_start, not causal), and the switch that installs them."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from test_cpu_gguf import T, _weight, needs_cc, needs_int8
from test_reference_attention import naive

from verispec.attention.reference import (
    ReferenceBackend,
    build_reference_indices,
    reference_attention,
    write_kv,
)
from verispec.core.attention_metadata import AttentionMetadata
from verispec.kernels import cpu_gguf, cpu_ops
from verispec.models.layers.norm import RMSNorm
from verispec.models.layers.quant import GGUFSegment, QuantLinear
from verispec.models.layers.rotary import RotaryEmbedding

pytestmark = needs_cc


@pytest.mark.parametrize("dim", [7, 64, 896])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_matches_the_module(dim, residual):
    g = torch.Generator().manual_seed(dim)
    norm = RMSNorm(dim, 1e-6)
    norm.weight.copy_(torch.randn(dim, generator=g))
    x = torch.randn(3, dim, generator=g) * 4
    r = torch.randn(3, dim, generator=g) if residual else None
    ref = norm(x, r)
    got = cpu_ops.rms_norm(x, norm.weight, norm.eps, r)
    if residual:
        torch.testing.assert_close(got[0], ref[0], rtol=2e-6, atol=2e-6)
        assert torch.equal(got[1], x + r)  # the sum itself rounds once, as torch's
    else:
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6)
    # [T, heads, D] (Qwen3's q / k norm): per head
    q = torch.randn(2, 3, dim, generator=g)
    torch.testing.assert_close(cpu_ops.rms_norm(q, norm.weight, norm.eps), norm(q), rtol=2e-6, atol=2e-6)


def test_rms_norm_refuses_other_dtypes_and_shapes():
    with pytest.raises(ValueError, match="float32"):
        cpu_ops.rms_norm(torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        cpu_ops.rms_norm(torch.ones(2, 4), torch.ones(5), 1e-6)


def test_rope_write_kv_is_the_modules_bit_for_bit():
    """Rotary rounds as torch's (two products, one sum, each in float32); the cache gets the rotated k and v at
    the slots, nothing where the slot is negative."""
    h, kh, d, t = 6, 2, 16, 5
    rot = RotaryEmbedding(d, 64, 10000.0)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(t, (h + 2 * kh) * d, generator=g)  # q, k, v as column slices of one output (strided)
    q, k, v = qkv.split([h * d, kh * d, kh * d], dim=-1)
    q, k, v = q.view(t, h, d), k.view(t, kh, d), v.view(t, kh, d)
    positions = torch.tensor([0, 9, 10, 33, 63])
    slots = torch.tensor([3, -1, 7, 0, 12])
    cache, ref_cache = torch.zeros(2, 16, kh, d), torch.zeros(2, 16, kh, d)
    got = cpu_ops.rope_write_kv(rot.cos, rot.sin, positions, q, k, v, cache, slots)
    want = ReferenceBackend().rotary_write_kv(rot, positions, q, k, v, ref_cache, slots)
    assert torch.equal(got, want)
    assert torch.equal(cache, ref_cache)
    assert cache[:, 1].abs().sum() == 0  # slot 1 is nobody's: untouched
    with pytest.raises(ValueError, match="outside"):
        cpu_ops.rope_write_kv(rot.cos, rot.sin, torch.tensor([0, 1, 2, 3, 64]), q, k, v, cache, slots)
    with pytest.raises(ValueError, match="outside"):
        cpu_ops.rope_write_kv(rot.cos, rot.sin, positions, q, k, v, cache, torch.tensor([0, 1, 2, 3, 16]))


CASES = {
    "decode one sequence": [(1, 37)],
    "decode, unequal lengths": [(1, 5), (1, 33), (1, 17)],
    "verify, unequal": [(3, 9), (5, 30)],
    "verify of 16 at the start": [(16, 16)],
    "prefill and decode": [(11, 11), (1, 29)],
}


def _step(shapes, bs, kv_heads, d, seed, causal=True, kv_starts=None):
    rng = random.Random(seed)
    need = sum(math.ceil(sl / bs) for _, sl in shapes)
    perm = list(range(need + 2))
    rng.shuffle(perm)
    tables = [[perm.pop() for _ in range(math.ceil(sl / bs))] for _, sl in shapes]
    width = max(len(tb) for tb in tables)
    qsl = [0]
    for ql, _ in shapes:
        qsl.append(qsl[-1] + ql)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.long), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([sl for _, sl in shapes], dtype=torch.int32),
        block_tables=torch.tensor([tb + [0] * (width - len(tb)) for tb in tables], dtype=torch.int32),
        max_query_len=max(ql for ql, _ in shapes), max_seq_len=max(sl for _, sl in shapes), block_size=bs,
        causal=causal, kv_start=None if kv_starts is None else torch.tensor(kv_starts, dtype=torch.int32))
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, (need + 2) * bs, kv_heads, d, generator=g)
    return meta, tables, kv


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (14, 2)])
def test_paged_attention_matches_the_reference(name, heads, kv_heads):
    shapes, bs, d = CASES[name], 8, 16
    meta, tables, kv = _step(shapes, bs, kv_heads, d, seed=len(name) + heads)
    q = torch.randn(sum(ql for ql, _ in shapes), heads, d, generator=torch.Generator().manual_seed(heads))
    got = cpu_ops.paged_attention(q, kv, meta, 0.3)
    torch.testing.assert_close(got, naive(q, kv, shapes, tables, bs, 0.3), atol=1e-5, rtol=1e-5)
    ref = build_reference_indices([ql for ql, _ in shapes], [sl for _, sl in shapes], tables, bs, "cpu")
    torch.testing.assert_close(got, reference_attention(q, kv, SimpleNamespace(**ref), 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 4, 100])
def test_paged_attention_sliding_window(window):
    shapes, bs, kh, d = [(3, 20), (1, 9)], 4, 2, 8
    meta, tables, kv = _step(shapes, bs, kh, d, seed=window)
    q = torch.randn(4, 4, d, generator=torch.Generator().manual_seed(7))
    ref = build_reference_indices([3, 1], [20, 9], tables, bs, "cpu")
    want = reference_attention(q, kv, SimpleNamespace(**ref), 0.5, window=window)
    torch.testing.assert_close(cpu_ops.paged_attention(q, kv, meta, 0.5, window=window), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_starts", [None, [0, 3], [12, 5]])
def test_paged_attention_bidirectional_blocks_and_kv_start(kv_starts):
    """Not causal (DFlash's drafter blocks), keys from kv_start on; every key hidden: zeros (the contract)."""
    shapes, bs = [(4, 12), (4, 12)], 4
    meta, tables, kv = _step(shapes, bs, 2, 8, seed=3, causal=False, kv_starts=kv_starts)
    q = torch.randn(8, 4, 8, generator=torch.Generator().manual_seed(3))
    got = cpu_ops.paged_attention(q, kv, meta, 0.5)
    if kv_starts == [12, 5]:
        assert got[:4].abs().sum() == 0
        torch.testing.assert_close(got[4:], naive(q, kv, shapes, tables, bs, 0.5, causal=False,
                                                  kv_starts=kv_starts)[4:], atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(got, naive(q, kv, shapes, tables, bs, 0.5, causal=False, kv_starts=kv_starts),
                               atol=1e-5, rtol=1e-5)


def test_paged_attention_refuses_a_bad_block_table():
    meta, _, kv = _step([(1, 9)], 4, 2, 8, seed=0)
    meta.block_tables = torch.tensor([[0, 1, 99]], dtype=torch.int32)  # block 99 is past the cache
    with pytest.raises(ValueError, match="out of range"):
        cpu_ops.paged_attention(torch.randn(1, 4, 8), kv, meta, 0.5)
    meta.seq_lens = torch.tensor([13], dtype=torch.int32)  # longer than its three blocks
    with pytest.raises(ValueError, match="out of range"):
        cpu_ops.paged_attention(torch.randn(1, 4, 8), kv, meta, 0.5)


@pytest.mark.parametrize("m", [1, 3, 16])
def test_stacked_linear_is_the_segments_kernels_bit_for_bit(m):
    """One output written by each segment's kernel in its columns: the same numbers as linear() per segment and a
    concatenation."""
    parts = [_weight(T.Q5_0, 24, 256, 1)[0], _weight(T.Q8_0, 8, 256, 2)[0], _weight(T.Q4_K, 16, 256, 3)[0]]
    int8 = [True, False, True] if cpu_gguf.int8_available() else [False] * 3
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
    got = cpu_gguf.StackedLinear(parts, int8)(x)
    want = torch.cat([cpu_gguf.linear(x, w, int8=i8) for w, i8 in zip(parts, int8, strict=True)], dim=1)
    assert torch.equal(got, want)
    # through a QuantLinear, with a bias, and SiLU-and-mul (gate, up halves)
    bias = torch.randn(48)
    ql = QuantLinear([GGUFSegment(w, cpu_gguf.linear) for w in parts], bias, torch.float32)
    ql.cpu_linear = cpu_gguf.StackedLinear(parts, int8)
    assert torch.equal(ql(x), want + bias)
    ql.bias = None
    gate, up = want.chunk(2, dim=-1)
    torch.testing.assert_close(ql.silu_mul(x), F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="float32"):
        ql.cpu_linear(torch.randn(17, 256))


def test_the_loader_switches_only_the_quantized_cpu_model_and_the_engine_agrees(qwen05_path, monkeypatch):
    """The real 0.5B: quantization gguf on the CPU gets the C ops (the reference model keeps torch), and a greedy
    continuation with them is the one without them (VERISPEC_CPU_OPS=0) on a prompt's first 24 tokens, and the
    prefill's logits with them are as close to the float32 reference's as the quantized path's are documented to
    be (README: 0.2-1.5% of the largest; the bound here 3%). Not bit for bit against torch's ops: the integer dot
    rounds x to int8, where a last-bit difference upstream moves a value by a whole step."""
    from verispec.attention.cpu import CPUBackend
    from verispec.loader.model_loader import load_model

    cpu = torch.device("cpu")
    tok, _, on = load_model(qwen05_path, cpu, torch.float32, progress=False, quantization="gguf")
    assert isinstance(on.attn_backend, CPUBackend)
    assert on.model.norm.cpu_ops is cpu_ops and on.model.layers[0].mlp.down_proj.cpu_linear is not None
    monkeypatch.setenv("VERISPEC_CPU_OPS", "0")
    _, _, off = load_model(qwen05_path, cpu, torch.float32, progress=False, quantization="gguf")
    assert type(off.attn_backend) is ReferenceBackend and off.model.norm.cpu_ops is None
    assert off.model.layers[0].mlp.down_proj.cpu_linear is None
    _, _, ref = load_model(qwen05_path, cpu, torch.float32, progress=False, quantization="none")
    assert type(ref.attn_backend) is ReferenceBackend and ref.model.norm.cpu_ops is None
    ids = tok.encode("def quicksort(xs):")
    (t_on, l_on), (t_off, _) = _greedy(on, ids, 24), _greedy(off, ids, 24)
    assert t_on == t_off
    _, l_ref = _greedy(ref, ids, 1)
    rel = float((l_on - l_ref).abs().max() / l_ref.abs().max())
    assert rel <= 0.03, rel


def _greedy(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens through the model's own forward over a paged cache of one sequence (block size 16), the
    prefill's last logits."""
    cfg = model.config
    bs, blocks = 16, math.ceil((len(ids) + n) / 16)
    caches = [torch.zeros(2, blocks * bs, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    first = _step_logits(model, caches, ids, 0, bs, blocks, last=True)[0]
    out = [int(first.argmax())]
    while len(out) < n:
        logits = _step_logits(model, caches, out[-1:], len(ids) + len(out) - 1, bs, blocks, last=True)
        out.append(int(logits[0].argmax()))
    return out, first


def test_write_kv_reference_still_used_off_the_c_path():
    """A non-float32 cache keeps the reference's rotary and write (the C ops take float32 only)."""
    from verispec.attention.cpu import CPUBackend

    rot = RotaryEmbedding(8, 16, 10000.0)
    q, k, v = (torch.randn(2, n, 8, dtype=torch.bfloat16) for n in (4, 2, 2))
    cache, ref_cache = torch.zeros(2, 4, 2, 8, dtype=torch.bfloat16), torch.zeros(2, 4, 2, 8, dtype=torch.bfloat16)
    slots = torch.tensor([1, 2])
    got = CPUBackend().rotary_write_kv(rot, torch.tensor([3, 4]), q, k, v, cache, slots)
    qr, kr = rot(torch.tensor([3, 4]), q, k)
    write_kv(ref_cache, kr, v, slots)
    assert torch.equal(got, qr) and torch.equal(cache, ref_cache)


@pytest.fixture(scope="module")
def gguf05(qwen05_path):
    """(model, tokenizer): the real 0.5B kept quantized on the CPU, with the C ops (the default CPU path)."""
    from verispec.attention.cpu import CPUBackend
    from verispec.loader.model_loader import load_model

    tok, _, model = load_model(qwen05_path, torch.device("cpu"), torch.float32, progress=False, quantization="gguf")
    assert isinstance(model.attn_backend, CPUBackend)
    return model, tok


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_sync_async_parity_on_the_quantized_cpu_path(gguf05, method):
    """The parity matrix cell (forced preemption, chunked prefill, prefix-cache hits, mixed temperatures) on the
    quantized 0.5B with the C ops: verify steps of 4 queries, prefill chunks and decode steps all through
    CPUBackend; the synchronous and overlapped loops give the same tokens and the same acceptance counters."""
    from parity import SPECS
    from test_real_model_spec import CODE_PROMPTS, parity_cell

    _, tok = gguf05
    parity_cell(gguf05, [tok.encode(p) for p in CODE_PROMPTS], SPECS[method])


@needs_int8  # the row-count independence is the integer dot's (the int4 planes' torch kernel makes no such promise)
@pytest.mark.parametrize("method", ["self", "ngram"])
def test_speculation_on_the_quantized_cpu_path_is_lossless_and_self_drafts_are_all_accepted(gguf05, method):
    """With the integer dot at every row count (a row's bits do not depend on how many rows a step has) and the C
    ops per row, a verify row computes what a decode row does: greedy speculation gives plain decoding's tokens,
    and the target drafting for itself (self) has every draft accepted, one request at a time and four at a time
    (4 x (3 + 1) = 16 rows, the integer dot's most). (Greedy tokens rarely see a last-bit difference: the bit-level
    check is test_a_verify_row_is_a_decode_row_bit_for_bit.)"""
    from test_real_model_spec import CODE_PROMPTS, GREEDY, build, generate

    _, tok = gguf05
    prompts = [tok.encode(p) for p in CODE_PROMPTS][:4]
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    for seqs in (1, 4):
        base = generate(build(gguf05, None, False, max_num_seqs=seqs), prompts, GREEDY)
        eng = build(gguf05, spec, False, max_num_seqs=seqs)
        assert generate(eng, prompts, GREEDY) == base, (method, seqs)
        m = eng.get_metrics()
        assert m["spec_decode_num_drafts"] > 0
        if method == "self":
            assert m["spec_decode_num_accepted_tokens"] == m["spec_decode_num_draft_tokens"], (seqs, m)


def _step_logits(model, caches, ids: list[int], start: int, bs: int, blocks: int, last: bool = False) -> torch.Tensor:
    """Logits of one step feeding `ids` at positions start.. of a one-sequence paged cache (all rows; last: the
    last row's only)."""
    ql, sl = len(ids), start + len(ids)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(start, sl), query_start_loc=torch.tensor([0, ql], dtype=torch.int32),
        seq_lens=torch.tensor([sl], dtype=torch.int32), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        max_query_len=ql, max_seq_len=sl, block_size=bs)
    for k, v in model.attn_backend.prepare_metadata([ql], [sl], [list(range(blocks))], bs, "cpu").items():
        setattr(meta, k, v)
    with torch.no_grad():
        h, _ = model(torch.tensor(ids), torch.arange(start, sl), meta, caches)
        return model.compute_logits(h[-1:] if last else h)


@needs_int8
@pytest.mark.parametrize("rows", [4, 16])
def test_a_verify_row_is_a_decode_row_bit_for_bit(gguf05, rows):
    """The real 0.5B on the quantized CPU path: after one prefill, feeding `rows` tokens one step each (decode)
    and all in one step (a verify of rows - 1 drafts) give the same logits bit for bit, row by row: the integer
    dot's row does not depend on the step's row count, nor do the C ops' (the float GEMV of 2+ rows, session 26's
    rule for the 32-element types, fails this)."""
    model, tok = gguf05
    cfg = model.config
    prompt = tok.encode("def fibonacci(n):")
    follow = tok.encode("\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n")
    assert len(follow) >= rows
    follow = follow[:rows]
    bs, blocks = 16, 4
    outs = []
    for one_step in (False, True):
        caches = [torch.zeros(2, blocks * bs, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
        _step_logits(model, caches, prompt, 0, bs, blocks)
        if one_step:
            outs.append(_step_logits(model, caches, follow, len(prompt), bs, blocks))
        else:
            outs.append(torch.cat([_step_logits(model, caches, [t], len(prompt) + i, bs, blocks)
                                   for i, t in enumerate(follow)]))
    assert torch.equal(outs[0], outs[1]), float((outs[0] - outs[1]).abs().max())


@needs_int8
def test_a_prompt_is_the_same_bits_in_any_chunking(gguf05):
    """The real 0.5B on the quantized CPU path: a 40-token prompt prefilled in one chunk, in chunks of 7, and one
    token at a time leaves the same K/V cache and the same last-token logits bit for bit (the integer dot at every
    row count and the C attention for prompt chunks too: prefill chunking, a drafter's catch-up, a preempted
    request's recompute and a prefix hit compute what one whole prefill does). With torch's SDPA for the long
    chunk (cpu_ops.MAX_QUERY_LEN = 16, the rule before session 30) the bits differ."""
    from verispec.kernels import cpu_ops

    model, tok = gguf05
    cfg = model.config
    prompt = (tok.encode("def quicksort(a):\n    if len(a) <= 1:\n        return a\n    pivot = a[0]\n") * 3)[:40]
    assert len(prompt) == 40
    bs, blocks = 16, 3

    def run(chunk: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        caches = [torch.zeros(2, blocks * bs, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
        for s in range(0, len(prompt), chunk):
            logits = _step_logits(model, caches, prompt[s : s + chunk], s, bs, blocks, last=True)
        return logits, caches

    whole, whole_kv = run(40)
    for chunk in (7, 1):
        logits, kv = run(chunk)
        assert torch.equal(logits, whole), (chunk, float((logits - whole).abs().max()))
        assert all(torch.equal(a, b) for a, b in zip(kv, whole_kv, strict=True)), chunk
    before = cpu_ops.MAX_QUERY_LEN
    try:
        cpu_ops.MAX_QUERY_LEN = 16
        sdpa, _ = run(40)
    finally:
        cpu_ops.MAX_QUERY_LEN = before
    assert not torch.equal(sdpa, whole)  # (the test can tell the two attention paths apart)
