"""The small-M tensor-core kernels (2..16 rows: a batch-1 verify) against torch float32 references, on
random odd sizes: K and N not multiples of the tiles (interpreter on CPU in float32, compiled bf16 on CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verispec.attention.reference import write_kv
from verispec.core.options import KernelOptions
from verispec.kernels import linear as lin
from verispec.kernels import small_m as sm
from verispec.kernels import small_m_qkv as smq
from verispec.kernels.fused import rms_norm_ref
from verispec.models.layers.rotary import RotaryEmbedding

CPU = pytest.param("cpu", torch.float32, id="cpu-fp32")
GPU = pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu)
# Small tiles on the CPU keep the interpreter quick; on CUDA the defaults (small_m_config) run too.
TILES = dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=2)


def tol(dtype: torch.dtype) -> dict:
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def rand(*shape, seed: int, device: str, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Made on the CPU, then copied (a PDL kernel reads weights before its wait: kernels/pdl.py)."""
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(device, dtype)


def ref_linear(x, w, b=None, silu_mul=False):
    """float32 F.linear (then SiLU-and-mul), rounded once to x's dtype."""
    y = F.linear(x.float(), w.float(), None if b is None else b.float())
    if silu_mul:
        y = F.silu(y[:, : w.shape[0] // 2]) * y[:, w.shape[0] // 2:]
    return y.to(x.dtype)


def cfg_for(device: str, split: int = 1) -> dict | None:
    return dict(TILES, SPLIT_K=split) if device == "cpu" else (None if split == 1 else dict(
        BLOCK_N=16, BLOCK_K=256, SPLIT_K=split, num_warps=4, num_stages=3))


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
@pytest.mark.parametrize("m,n,k", [(2, 37, 129), (5, 45, 77), (16, 70, 100), (11, 9, 530), (7, 203, 333)])
@pytest.mark.parametrize("bias", [False, True])
def test_small_m_linear(device, dtype, m, n, k, bias):
    x = rand(m, k, seed=m * 7 + n, device=device, dtype=dtype)
    w = rand(n, k, seed=k, device=device, dtype=dtype, scale=k**-0.5)
    b = rand(n, seed=n, device=device, dtype=dtype) if bias else None
    cfg = cfg_for(device)
    out = sm.small_m_linear(x, w, b, config=cfg)
    assert cfg is None or cfg == TILES  # the caller's config is not modified
    assert out.shape == (m, n) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref_linear(x, w, b).float(), **tol(dtype))


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
@pytest.mark.parametrize("m,n,k,split", [(3, 41, 333, 3), (16, 19, 200, 2), (9, 70, 1000, 4)])
def test_small_m_split_k(device, dtype, m, n, k, split):
    """K split across programs, the float32 partials added by the reduce kernel, bias in the reduce."""
    x = rand(m, k, seed=m + k, device=device, dtype=dtype)
    w = rand(n, k, seed=n + k, device=device, dtype=dtype, scale=k**-0.5)
    b = rand(n, seed=n + 1, device=device, dtype=dtype)
    out = sm.small_m_linear(x, w, b, config=cfg_for(device, split))
    torch.testing.assert_close(out.float(), ref_linear(x, w, b).float(), **tol(dtype))
    inter = n
    gu = rand(2 * inter, k, seed=inter + 3, device=device, dtype=dtype, scale=k**-0.5)
    got = sm.small_m_linear(x, gu, silu_mul=True, config=cfg_for(device, split))
    torch.testing.assert_close(got.float(), ref_linear(x, gu, silu_mul=True).float(), **tol(dtype))


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
@pytest.mark.parametrize("m,inter,k", [(2, 35, 129), (6, 19, 300), (16, 50, 97)])
def test_small_m_silu_mul_strided_rows(device, dtype, m, inter, k):
    base = rand(2 * m, k + 7, seed=inter, device=device, dtype=dtype)
    x = base[::2, :k]  # a row-strided view
    w = rand(2 * inter, k, seed=k, device=device, dtype=dtype, scale=k**-0.5)
    out = sm.small_m_linear(x, w, silu_mul=True, config=cfg_for(device))
    assert out.shape == (m, inter)
    torch.testing.assert_close(out.float(), ref_linear(x, w, silu_mul=True).float(), **tol(dtype))


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
@pytest.mark.parametrize("m,n,k,silu,residual", [(2, 37, 129, False, True), (5, 19, 300, True, True),
                                                  (16, 40, 77, True, False), (3, 33, 210, False, False)])
def test_small_m_norm_prologue(device, dtype, m, n, k, silu, residual):
    """RMSNorm(x + residual) in the K loop == rms_norm_ref then the product; the new residual is x +
    residual exactly (or x itself without one)."""
    x = rand(m, k, seed=m + k, device=device, dtype=dtype)
    r = rand(m, k, seed=m + k + 1, device=device, dtype=dtype) if residual else None
    nw = rand(k, seed=k + 2, device=device, dtype=dtype, scale=0.1) + 1
    w = rand(2 * n if silu else n, k, seed=k + 3, device=device, dtype=dtype, scale=k**-0.5)
    out, new_res = sm.small_m_linear(x, w, silu_mul=silu, norm=(nw, 1e-6), residual=r, config=cfg_for(device))
    normed = rms_norm_ref(x, nw, 1e-6, r)
    if residual:
        normed, want_res = normed
        assert torch.equal(new_res, want_res)
    else:
        assert new_res is x
    torch.testing.assert_close(out.float(), ref_linear(normed, w, silu_mul=silu).float(), **tol(dtype))


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
def test_small_m_float32_out_is_rounded_like_a_cast(device, dtype):
    """out_dtype float32 (the logits) stores the x-dtype result widened; out= fills a given buffer."""
    x = rand(4, 96, seed=41, device=device, dtype=dtype)
    w = rand(203, 96, seed=42, device=device, dtype=dtype, scale=96**-0.5)
    wide = sm.small_m_linear(x, w, out_dtype=torch.float32, config=cfg_for(device))
    assert wide.dtype == torch.float32
    assert torch.equal(wide, sm.small_m_linear(x, w, config=cfg_for(device)).float())
    buf = torch.full((4, 203), float("nan"), device=device)
    assert sm.small_m_linear(x, w, out=buf, config=cfg_for(device)) is buf and torch.equal(buf, wide)
    split = sm.small_m_linear(x, w, out_dtype=torch.float32, config=cfg_for(device, 2))
    assert torch.equal(split, split.to(dtype).float())  # rounded to x's dtype before the widening


def test_bad_input_is_a_value_error_before_any_launch():
    w = torch.zeros(8, 32)
    with pytest.raises(ValueError, match="at most 16 rows"):
        sm.small_m_linear(torch.zeros(17, 32), w)
    with pytest.raises(ValueError, match="do not make"):
        sm.small_m_linear(torch.zeros(4, 31), w)
    with pytest.raises(ValueError, match="SPLIT_K 1"):
        sm.small_m_linear(torch.zeros(4, 32), w, norm=(torch.ones(32), 1e-6), config=dict(TILES, SPLIT_K=2))
    with pytest.raises(ValueError, match="contiguous last"):
        sm.small_m_linear(torch.zeros(32, 4).T, w)
    with pytest.raises(ValueError, match="head_dim 8"):
        smq.small_m_qkv_rope_write_kv(torch.zeros(2, 32), torch.zeros(32, 32), None, torch.zeros(2, dtype=torch.long),
                                     torch.zeros(8, 4), torch.zeros(8, 4), torch.zeros(2, 4, 1, 8),
                                     torch.zeros(2, dtype=torch.long), 2, 1, 8)
    with pytest.raises(ValueError, match="no bias with silu_mul"):
        sm.small_m_linear(torch.zeros(4, 32), w, torch.zeros(8), silu_mul=True)
    with pytest.raises(ValueError, match="small_m_max_rows"):
        KernelOptions(small_m_max_rows=17)


def test_small_m_config_covers_every_layer_of_the_15b():
    """K tiles no wider than the padded K, 16 or more weight rows a program (tl.dot's N); only down_proj
    (K >= 4096) splits K, into DOWN_KS columns each; a norm never splits."""
    for n, k, silu in [(2048, 1536, False), (1536, 1536, False), (8960, 1536, True), (1536, 8960, False),
                       (151936, 1536, False), (7, 20, False), (896, 4864, False)]:
        c = sm.small_m_config(n, k, silu)
        assert c["BLOCK_K"] <= max(16, 2 * k) and c["BLOCK_N"] >= 16
        assert c["SPLIT_K"] == (1 if k < 4096 else -(-k // sm.DOWN_KS))
        assert sm.small_m_config(n, k, silu, norm=True)["SPLIT_K"] == 1
    down = sm.small_m_config(1536, 8960)
    assert down["SPLIT_K"] == 9 and lin.splitk_split(8960, down["BLOCK_K"], 9) == (sm.DOWN_KS, 9)
    with pytest.raises(ValueError, match="non-empty weight"):
        sm.small_m_config(0, 10)


def test_default_config_is_not_consumed_by_a_launch():
    """small_m_config is cached per shape; a launch with the default tiles must leave the cached dict whole."""
    x = rand(3, 40, seed=1, device="cpu", dtype=torch.float32)
    w = rand(24, 40, seed=2, device="cpu", dtype=torch.float32)
    first = sm.small_m_linear(x, w)
    assert "SPLIT_K" in sm.small_m_config(24, 40)
    assert torch.equal(sm.small_m_linear(x, w), first)
    torch.testing.assert_close(first, ref_linear(x, w), **tol(torch.float32))


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
@pytest.mark.parametrize("m,heads,kv_heads,head_dim,k,bias,norm,residual", [
    (2, 3, 1, 32, 77, True, False, False), (5, 4, 2, 64, 150, False, True, True), (3, 4, 2, 16, 70, True, True, True),
    (16, 2, 1, 32, 100, True, True, False), (7, 12, 2, 128, 130, True, True, True),
])
def test_small_m_qkv_rope_write_kv(device, dtype, m, heads, kv_heads, head_dim, k, bias, norm, residual):
    """Norm + qkv + bias + rotary + K/V write == rms_norm_ref, F.linear, RotaryEmbedding and write_kv;
    padding rows (slot -1) write nothing and the rest of the cache is untouched."""
    g = torch.Generator().manual_seed(m * 100 + heads)
    n = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(m, k, generator=g).to(device, dtype)
    r = torch.randn(m, k, generator=g).to(device, dtype) if residual else None
    nw = (torch.randn(k, generator=g) * 0.1 + 1).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    rot = RotaryEmbedding(head_dim, 300, 1e6).to(device)
    pos = torch.randint(0, 300, (m,), generator=g).to(device)
    slots = torch.randperm(41, generator=g)[:m].to(device)
    slots[1] = -1  # a padding row: nothing written
    cache = torch.randn(2, 41, kv_heads, head_dim, generator=g).to(device, dtype)

    xin = x
    if norm:
        xin = rms_norm_ref(x, nw, 1e-6, r)
        if residual:
            xin, want_res = xin
    qkv = ref_linear(xin, w, b)
    q, kk, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    ref_q, ref_k = rot(pos, q.reshape(m, heads, head_dim), kk.reshape(m, kv_heads, head_dim))
    want = cache.clone()
    ok = slots >= 0
    write_kv(want, ref_k[ok], v.reshape(m, kv_heads, head_dim)[ok], slots[ok])

    got = cache.clone()
    res = smq.small_m_qkv_rope_write_kv(x, w, b, pos, rot.cos, rot.sin, got, slots, heads, kv_heads, head_dim,
                                       norm=(nw, 1e-6) if norm else None, residual=r,
                                       block_k=32 if device == "cpu" else None)
    out = res[0] if norm else res
    if norm:
        assert torch.equal(res[1], want_res) if residual else res[1] is x
    torch.testing.assert_close(out, ref_q, **tol(dtype))
    torch.testing.assert_close(got, want, **tol(dtype))
    untouched = torch.ones(41, dtype=torch.bool, device=device)
    untouched[slots[ok]] = False
    assert torch.equal(got[:, untouched], cache[:, untouched])


def test_routing_by_row_count():
    """small_m_max_rows routes 2..that many rows of a CUDA x (down_proj and the LM head too) to the
    small-M kernel; 1 row (the GEMV's), more rows, CPU tensors and 0 (the default) keep linear.py's path."""
    on = KernelOptions(small_m_max_rows=16)

    class FakeCuda(torch.Tensor):  # is_cuda without a GPU: only the routing predicate reads it
        is_cuda = True

    for rows in (1, 2, 4, 8, 16, 17, 33):
        x = torch.zeros(rows, 64).as_subclass(FakeCuda)
        assert sm.takes_small_m(x, on) == (2 <= rows <= 16)
        assert not sm.takes_small_m(x, KernelOptions())
        assert not sm.takes_small_m(torch.zeros(rows, 64), on)
        assert sm.takes_small_m(x, KernelOptions(small_m_max_rows=8)) == (2 <= rows <= 8)
        assert sm.takes_small_m(x, KernelOptions(small_m_max_rows=16, gemv_max_rows=4)) == (5 <= rows <= 16)
    assert not sm.takes_small_m(torch.zeros(32, 4).T.as_subclass(FakeCuda), on)  # a strided last dim
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    torch.testing.assert_close(sm.linear(x, w, options=on), F.linear(x, w))  # CPU: linear.py's torch path
    gu = torch.randn(10, 8)
    torch.testing.assert_close(sm.gate_up_silu(x, gu, options=on), F.silu(x @ gu[:5].T) * (x @ gu[5:].T))


def test_small_m_routes_the_plain_linears_too():
    """With small-M on, the model's Kernels hand o / down / the LM head (linear, gate_up_silu) to small_m;
    with it off, to linear.py."""
    from verispec.models.kernel_path import Kernels

    on, off = Kernels(KernelOptions(small_m_max_rows=16)), Kernels()
    assert (on.linear, on.gate_up_silu) == (sm.linear, sm.gate_up_silu)
    assert (off.linear, off.gate_up_silu) == (lin.linear, lin.gate_up_silu)
    assert on.small_m_max_rows == 16 and on.small_m_linear is sm.small_m_linear


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_routed_layers_on_cuda_15b_shapes():
    """Through the routing entry points with the 1.5B's down_proj (split K) and LM head (float32 logits)."""
    on = KernelOptions(small_m_max_rows=16)
    down = rand(1536, 8960, seed=5, device="cuda", dtype=torch.bfloat16, scale=8960**-0.5)
    head = rand(151936, 1536, seed=6, device="cuda", dtype=torch.bfloat16, scale=1536**-0.5)
    gu = rand(2 * 8960, 1536, seed=9, device="cuda", dtype=torch.bfloat16, scale=1536**-0.5)
    for rows in (2, 4, 8, 16):
        x = rand(rows, 8960, seed=7 + rows, device="cuda", dtype=torch.bfloat16)
        assert sm.takes_small_m(x, on)
        torch.testing.assert_close(sm.linear(x, down, options=on).float(), ref_linear(x, down).float(),
                                   **tol(torch.bfloat16))
        h = rand(rows, 1536, seed=8 + rows, device="cuda", dtype=torch.bfloat16)
        logits = sm.linear(h, head, out_dtype=torch.float32, options=on)
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, ref_linear(h, head).float(), **tol(torch.bfloat16))
        torch.testing.assert_close(sm.gate_up_silu(h, gu, options=on).float(),
                                   ref_linear(h, gu, silu_mul=True).float(), **tol(torch.bfloat16))


@pytest.mark.parametrize("path", ["small-m", "fused-qkv"])
def test_fused_layer_path_on_the_small_m_kernels_matches_the_torch_path(path):
    """The 2..16-row layer paths on a tiny float32 Qwen2 in the interpreter: DecoderLayer._forward_fused with
    the small-M kernels (norms in the prologues, rotary + K/V write in the qkv kernel), and
    _forward_fused_qkv (KernelOptions.fused_qkv_max_rows: only norm + qkv + rotary + K/V write fused, in the
    one-row family's kernel): the logits of a 5-query verify chunk and of a 3-sequence decode step after a
    prefill, and the cache they wrote, equal the torch path's. (On the CPU the layer's own dispatch keeps
    torch; the test calls the fused path itself, with o / down / the LM head left to torch.)"""
    from tiny import tiny_model

    from verispec.config import ModelConfig
    from verispec.models.kernel_path import Kernels
    from verispec.worker.inputs import SeqChunk, allocate_kv_cache, build_batch

    cfg = ModelConfig.for_arch("qwen2", vocab_size=300, hidden_size=96, intermediate_size=176, num_layers=2,
                               num_heads=3, num_kv_heads=1, head_dim=32, max_position_embeddings=512,
                               tie_word_embeddings=False)
    model = tiny_model(cfg, seed=3)
    kernels = Kernels(KernelOptions(small_m_max_rows=16))

    def fused(layer):
        def forward(x, residual, positions, rotary, meta, kv_cache, backend):
            if path == "fused-qkv":
                return layer._forward_fused_qkv(x, residual, positions, rotary, meta, kv_cache, backend, None)
            return layer._forward_fused(x, residual, positions, rotary, meta, kv_cache, backend, None,
                                        smq.small_m_qkv_rope_write_kv, sm.small_m_linear)
        return forward

    def run(chunks_per_step, fused_steps: set[int]):
        kv = allocate_kv_cache(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        logits = []
        for step, chunks in enumerate(chunks_per_step):
            ids, pos, meta = build_batch(chunks, 16, torch.device("cpu"))
            for layer in model.model.layers:
                layer.self_attn.kernels = layer.mlp.kernels = kernels if step in fused_steps else None
                if step in fused_steps:
                    layer.forward = fused(layer)
                else:
                    layer.__dict__.pop("forward", None)
            with torch.inference_mode():
                logits.append(model.compute_logits(model(ids, pos, meta, kv)[0]))
        for layer in model.model.layers:
            layer.__dict__.pop("forward", None)
            layer.self_attn.kernels = layer.mlp.kernels = None
        return logits, kv

    g = torch.Generator().manual_seed(5)
    p = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (21, 9, 14)]
    steps = [[SeqChunk(p[0], 0, [0, 1]), SeqChunk(p[1], 0, [2]), SeqChunk(p[2], 0, [3])],  # prefill
             [SeqChunk([7, 8, 9, 10, 11], 21, [0, 1])],  # a verify chunk of 5 queries
             [SeqChunk([12], 26, [0, 1]), SeqChunk([13], 9, [2]), SeqChunk([14], 14, [3])]]  # 3-sequence decode
    want, kv_want = run(steps, set())
    got, kv_got = run(steps, {1, 2})
    for w, g_ in zip(want, got, strict=True):
        torch.testing.assert_close(g_, w, atol=1e-4, rtol=1e-4)
    for w, g_ in zip(kv_want, kv_got, strict=True):
        torch.testing.assert_close(g_, w, atol=1e-5, rtol=1e-5)


def test_fused_qkv_rows_are_validated_and_off_under_batch_invariance():
    """fused_qkv_max_rows: 0..16 (a ValueError otherwise, when the options are built); batch_invariant=True
    turns it off with the other shape-dependent paths."""
    from verispec.models.kernel_path import Kernels

    with pytest.raises(ValueError, match="fused_qkv_max_rows"):
        KernelOptions(fused_qkv_max_rows=17)
    assert Kernels(KernelOptions(fused_qkv_max_rows=4)).fused_qkv_max_rows == 4
    assert Kernels(KernelOptions(fused_qkv_max_rows=4, batch_invariant=True)).fused_qkv_max_rows == 0


def test_batch_invariant_mode_never_takes_the_small_m_path():
    """Issue 18: the small-M kernels' tiles differ from the invariant kernels', so batch_invariant=True
    keeps its one split-K config for every row count even with small_m_max_rows set."""
    from verispec.kernels import invariant
    from verispec.models.kernel_path import Kernels

    k = Kernels(KernelOptions(batch_invariant=True, small_m_max_rows=16))
    assert k.small_m_max_rows == 0 and k.gemv_max_rows == 0
    assert k.linear is invariant.linear and k.gate_up_silu is invariant.gate_up_silu
    on = Kernels(KernelOptions(small_m_max_rows=16))
    assert on.linear is sm.linear and on.gate_up_silu is sm.gate_up_silu and on.small_m_max_rows == 16
    off = Kernels(KernelOptions())  # the default path is linear.py's, untouched
    assert off.linear is lin.linear and off.gate_up_silu is lin.gate_up_silu and off.small_m_max_rows == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch,qlen,max_batch", [(1, 5, 1), (1, 16, 1), (3, 4, 3), (3, 4, 4), (4, 1, 4)])
def test_graph_replay_of_small_m_steps(batch, qlen, max_batch):
    """A 2-layer random model in the 0.5B's shapes on the small-M layer path: the CUDA-graph replay of a
    verify step (or a 4-sequence decode) equals its eager forward bit for bit (same kernels; PDL and the
    split-K workspace inside a graph); replayed in a graph padded to max_batch sequences (padding rows:
    no cache writes) it agrees within bf16 rounding (attention may split differently), and every run
    agrees with the default kernel path within bf16 rounding."""
    from verispec.bench.models import random_model, shapes_for
    from verispec.bench.profile import _step_inputs
    from verispec.models.kernel_path import enable_triton
    from verispec.worker.graphs import CudaGraphRunner

    model = random_model(shapes_for("qwen2.5-coder-0.5b-instruct", {"num_layers": 2}), torch.device("cuda"),
                         torch.bfloat16)
    kv, ids, pos, meta = _step_inputs(model, batch, qlen, 100, 16, torch.device("cuda"))
    rows = batch * qlen
    try:
        with torch.inference_mode():
            enable_triton(model, options=KernelOptions())
            base = model.compute_logits(model(ids, pos, meta, kv)[0]).float()
            enable_triton(model, options=KernelOptions(small_m_max_rows=16))
            eager = model.compute_logits(model(ids, pos, meta, kv)[0]).float()
            g = CudaGraphRunner(model, kv, max_batch=max_batch, query_lens=(qlen,), block_size=16,
                                max_blocks_per_seq=meta.block_tables.shape[1], with_logits=True, progress=False,
                                lazy=True)
            out = g.run(ids, pos, meta, batch, qlen)
            assert out is not None
            graph = out.logits[:rows].float().clone()
    finally:
        enable_triton(model, on=False)
    if max_batch == batch:
        assert torch.equal(graph, eager), f"graph vs eager: max |diff| {(graph - eager).abs().max().item():.3g}"
    for got in (eager, graph):
        rel = (got - base).norm(dim=-1) / base.norm(dim=-1)
        assert rel.max() < 3e-2, rel
