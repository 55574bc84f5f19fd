"""The skinny linear kernels vs torch, on random odd sizes (interpreter on CPU, compiled bf16 on CUDA)."""

from __future__ import annotations

import pytest
import torch

from verispec.kernels import linear as lin

CPU = pytest.param("cpu", torch.float32, id="cpu-fp32")
GPU = pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu)


def tol(dtype: torch.dtype) -> dict:
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def rand(*shape, seed: int, device: str, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Random values made (and scaled) on the CPU, then copied: a weight must not be written by the
    kernel launched right before a PDL kernel that reads it before its wait (kernels/pdl.py)."""
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(device, dtype)


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
@pytest.mark.parametrize("m,n,k", [(1, 37, 129), (1, 300, 1000), (3, 45, 77), (5, 33, 260), (16, 70, 48), (13, 9, 530)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear(device, dtype, m, n, k, bias):
    x = rand(m, k, seed=m * 7 + n, device=device, dtype=dtype)
    w = rand(n, k, seed=k, device=device, dtype=dtype, scale=k**-0.5)
    b = rand(n, seed=n, device=device, dtype=dtype) if bias else None
    out = lin.skinny_linear(x, w, b)
    assert out.shape == (m, n) and not out.isnan().any()
    torch.testing.assert_close(out.float(), lin.skinny_linear_ref(x, w, b).float(), **tol(dtype))


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
@pytest.mark.parametrize("m,inter,k", [(1, 35, 129), (2, 64, 100), (7, 19, 300)])
def test_gate_up_silu(device, dtype, m, inter, k):
    x = rand(m, k, seed=m, device=device, dtype=dtype)
    w = rand(2 * inter, k, seed=inter, device=device, dtype=dtype, scale=k**-0.5)
    out = lin.skinny_linear(x, w, silu_mul=True)
    assert out.shape == (m, inter)
    torch.testing.assert_close(out.float(), lin.skinny_linear_ref(x, w, silu_mul=True).float(), **tol(dtype))


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
def test_strided_rows_and_wide_output(device, dtype):
    """x may be a row-strided view (e.g. gathered hidden rows); a wide N uses the bigger column tile."""
    base = rand(4, 300, seed=1, device=device, dtype=dtype)
    x = base[::2, :260]
    w = rand(5000, 260, seed=2, device=device, dtype=dtype, scale=260**-0.5)
    torch.testing.assert_close(lin.skinny_linear(x, w).float(), lin.skinny_linear_ref(x, w).float(), **tol(dtype))


def test_dispatch_falls_back_to_torch_on_cpu():
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    torch.testing.assert_close(lin.linear(x, w), torch.nn.functional.linear(x, w))
    gu = torch.randn(10, 8)
    want = torch.nn.functional.silu(x @ gu[:5].T) * (x @ gu[5:].T)
    torch.testing.assert_close(lin.gate_up_silu(x, gu), want)


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
@pytest.mark.parametrize("m,n,k", [(1, 37, 129), (1, 301, 1000), (3, 45, 77), (4, 33, 2600), (2, 9, 530), (1, 20, 1024)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv(device, dtype, m, n, k, bias):
    """The weight-resident GEMV (odd N and K: masked rows and a padded K) against the reference."""
    x = rand(m, k, seed=m * 5 + n, device=device, dtype=dtype)
    w = rand(n, k, seed=k + 1, device=device, dtype=dtype, scale=k**-0.5)
    b = rand(n, seed=n + 2, device=device, dtype=dtype) if bias else None
    out = lin.gemv(x, w, b)
    assert out.shape == (m, n) and not out.isnan().any()
    torch.testing.assert_close(out.float(), lin.skinny_linear_ref(x, w, b).float(), **tol(dtype))


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
@pytest.mark.parametrize("m,inter,k", [(1, 35, 129), (3, 19, 300), (2, 50, 2100)])
def test_gemv_silu_mul_and_strided_rows(device, dtype, m, inter, k):
    base = rand(2 * m, k + 7, seed=inter, device=device, dtype=dtype)
    x = base[::2, :k]  # row-strided view
    w = rand(2 * inter, k, seed=k, device=device, dtype=dtype, scale=k**-0.5)
    out = lin.gemv(x, w, silu_mul=True)
    assert out.shape == (m, inter)
    torch.testing.assert_close(out.float(), lin.skinny_linear_ref(x, w, silu_mul=True).float(), **tol(dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dispatch_on_cuda_picks_gemv_for_one_row():
    x1 = torch.zeros(1, 1536, device="cuda", dtype=torch.bfloat16)
    x8 = torch.zeros(8, 1536, device="cuda", dtype=torch.bfloat16)
    assert lin._pick(x1, torch.zeros(2048, 1536, device="cuda")) == "gemv"
    assert lin._pick(x1, torch.zeros(151936, 1536, device="cuda")) == "gemv"
    assert lin._pick(x8, torch.zeros(2048, 1536, device="cuda")) == "skinny"
    x8k = torch.zeros(8, 8960, device="cuda", dtype=torch.bfloat16)
    assert lin._pick(x8k, torch.zeros(1536, 8960, device="cuda")) == "torch"  # K >> N: cuBLAS splits K


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
@pytest.mark.parametrize("m,n,k,silu,residual", [(1, 37, 129, False, True), (2, 19, 300, True, True),
                                                  (1, 40, 77, True, False), (3, 33, 2100, False, True)])
def test_gemv_norm_prologue(device, dtype, m, n, k, silu, residual):
    """RMSNorm(x + residual) fed to the GEMV inside the kernel == fused.rms_norm_ref, then the GEMV
    reference; the new residual is x + residual exactly (or x itself without one)."""
    from verispec.kernels.fused import rms_norm_ref

    x = rand(m, k, seed=m + k, device=device, dtype=dtype)
    r = rand(m, k, seed=m + k + 1, device=device, dtype=dtype) if residual else None
    nw = rand(k, seed=k + 2, device=device, dtype=dtype, scale=0.1) + 1
    w = rand(2 * n if silu else n, k, seed=k + 3, device=device, dtype=dtype, scale=k**-0.5)
    out, new_res = lin.gemv(x, w, silu_mul=silu, norm=(nw, 1e-6), residual=r)
    normed = rms_norm_ref(x, nw, 1e-6, r)
    if residual:
        normed, want_res = normed
        assert torch.equal(new_res, want_res)
    else:
        assert new_res is x
    torch.testing.assert_close(out.float(), lin.skinny_linear_ref(normed, w, silu_mul=silu).float(), **tol(dtype))


# Split-K (batched decode): small tiles forced on the CPU keep the interpreter quick; SPLIT_K 3 over K = 333
# and BLOCK_K 64 gives three splits of 128 (two BLOCK_K iterations each), the last one cut at K.
def splitk_cfg(split: int) -> dict:
    return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, SPLIT_K=split, num_warps=4, num_stages=2)


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
@pytest.mark.parametrize("m,n,k", [(17, 51, 96), (37, 203, 333), (64, 51, 333)])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_splitk_linear(device, dtype, m, n, k, split, bias):
    x = rand(m, k, seed=m * 3 + n, device=device, dtype=dtype)
    w = rand(n, k, seed=k + 5, device=device, dtype=dtype, scale=k**-0.5)
    b = rand(n, seed=n + 6, device=device, dtype=dtype) if bias else None
    cfg = splitk_cfg(split)
    out = lin.splitk_linear(x, w, b, config=cfg)
    assert cfg == splitk_cfg(split)  # the caller's config is not modified
    assert out.shape == (m, n) and not out.isnan().any()
    torch.testing.assert_close(out.float(), lin.skinny_linear_ref(x, w, b).float(), **tol(dtype))


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
@pytest.mark.parametrize("m,inter,k,split", [(17, 26, 96, 1), (37, 101, 333, 3), (64, 19, 333, 3), (40, 70, 300, None)])
def test_splitk_silu_mul_and_strided_rows(device, dtype, m, inter, k, split):
    """SiLU-and-mul over [gate; up] on a row-strided x; split None takes splitk_config's tiles."""
    base = rand(2 * m, k + 3, seed=inter + k, device=device, dtype=dtype)
    x = base[::2, :k]
    w = rand(2 * inter, k, seed=inter, device=device, dtype=dtype, scale=k**-0.5)
    out = lin.splitk_linear(x, w, silu_mul=True, config=None if split is None else splitk_cfg(split))
    assert out.shape == (m, inter)
    torch.testing.assert_close(out.float(), lin.skinny_linear_ref(x, w, silu_mul=True).float(), **tol(dtype))


def test_splitk_empty_rows():
    x, w = torch.zeros(0, 40), torch.zeros(30, 40)
    assert lin.splitk_linear(x, w).shape == (0, 30)


# The best tiles of `verispec bench linear --rows 64 --sweep` on the H200 (1.5B shapes, docs/BENCHMARKS.md,
# "Split-K GEMM for batched decode"): (BLOCK_N, BLOCK_K, SPLIT_K, stages) per layer. For down the table
# encodes 4 stages where the sweep's best had 3 (splitk_config's docstring says so).
SWEEP_BEST_M64 = {
    "qkv": ((2048, 1536, False), (32, 128, 2, 4)),
    "o": ((1536, 1536, False), (32, 128, 4, 3)),
    "gate_up": ((8960, 1536, True), (32, 64, 1, 4)),
    "down": ((1536, 8960, False), (32, 128, 8, 4)),
}


@pytest.mark.parametrize("layer", SWEEP_BEST_M64)
def test_splitk_config_is_the_sweeps_best_tile_at_64_rows(layer):
    (n, k, silu), (bn, bk, split, stages) = SWEEP_BEST_M64[layer]
    c = lin.splitk_config(64, n, k, silu)
    assert (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"], c["num_stages"]) == (64, bn, bk, split, stages)


@pytest.mark.parametrize("m", [17, 32, 64, 128, 256])
def test_splitk_config(m):
    """The table's invariants on the 1.5B shapes: BLOCK_M the smallest power of two >= m within 16..64;
    power-of-two splits, each >= 2 BLOCK_K iterations, the fewest that reach SPLITK_TARGET_PROGRAMS
    programs and SPLITK_MAX_KS columns per split; None for the LM head."""
    for n, k, silu in [(2048, 1536, False), (1536, 1536, False), (8960, 1536, True), (1536, 8960, False)]:
        c = lin.splitk_config(m, n, k, silu)
        bm = c["BLOCK_M"]
        assert bm & (bm - 1) == 0 and 16 <= bm <= 64
        assert (bm >= m or bm == 64) and (bm == 16 or bm // 2 < m)  # the smallest that covers m (or the cap)
        split = c["SPLIT_K"]
        assert split & (split - 1) == 0 and (split == 1 or k >= 2 * split * c["BLOCK_K"])
        ks, splits = lin.splitk_split(k, c["BLOCK_K"], split)
        assert ks % c["BLOCK_K"] == 0 and (splits - 1) * ks < k <= splits * ks
        tiles = -(-m // bm) * -(-n // c["BLOCK_N"])
        half = split // 2
        assert split == 1 or tiles * half < lin.SPLITK_TARGET_PROGRAMS or -(-k // half) > lin.SPLITK_MAX_KS
    assert lin.splitk_config(m, 151936, 1536) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dispatch_on_cuda_splitk_rows():
    """Rows above SKINNY_MAX_ROWS take the split-K kernel from KernelOptions.splitk_min_rows to
    splitk_max_rows (not the LM head); a max of 0 turns it off."""
    from verispec.core.options import KernelOptions

    w = rand(2048, 1536, seed=1, device="cuda", dtype=torch.bfloat16, scale=1536**-0.5)
    gu = rand(2 * 8960, 1536, seed=2, device="cuda", dtype=torch.bfloat16, scale=1536**-0.5)
    x64 = rand(64, 1536, seed=3, device="cuda", dtype=torch.bfloat16)
    assert lin._pick(x64, w, options=KernelOptions(splitk_max_rows=0)) == "torch"
    assert lin._pick(x64, w) == "splitk"  # the default range, 33..64
    wide = KernelOptions(splitk_max_rows=128)
    assert lin._pick(x64, gu, silu_mul=True, options=wide) == "splitk"
    assert lin._pick(x64, torch.zeros(151936, 1536, device="cuda"), options=wide) == "torch"  # LM head: cuBLAS
    assert lin._pick(torch.zeros(129, 1536, device="cuda", dtype=torch.bfloat16), w, options=wide) == "torch"
    assert lin._pick(torch.zeros(100, 1536, device="cuda", dtype=torch.bfloat16), w, options=wide) == "splitk"
    assert lin._pick(torch.zeros(100, 1536, device="cuda", dtype=torch.bfloat16), w) == "torch"
    assert lin._pick(torch.zeros(8, 1536, device="cuda", dtype=torch.bfloat16), w) == "skinny"
    assert lin._pick(torch.zeros(32, 1536, device="cuda", dtype=torch.bfloat16), w) == "torch"
    assert lin._pick(torch.zeros(32, 1536, device="cuda", dtype=torch.bfloat16), w,
                     options=KernelOptions(splitk_min_rows=17)) == "splitk"
    down = rand(1536, 8960, seed=5, device="cuda", dtype=torch.bfloat16, scale=8960**-0.5)
    x4 = rand(4, 8960, seed=6, device="cuda", dtype=torch.bfloat16)
    assert lin._pick(x4, down) == "torch"  # K >= 4N: the skinny kernel does not split K
    assert lin._pick(x4, down, options=KernelOptions(small_splitk=True)) == "splitk"
    assert lin._pick(x4, down, options=KernelOptions(gemv_max_rows=4)) == "gemv"
    assert lin._pick(x4, down, options=KernelOptions(gemv_max_rows=3)) == "torch"
    torch.testing.assert_close(lin.linear(x4, down, options=KernelOptions(small_splitk=True)).float(),
                               lin.skinny_linear_ref(x4, down).float(), **tol(torch.bfloat16))
    torch.testing.assert_close(lin.linear(x4, down, options=KernelOptions(gemv_max_rows=4)).float(),
                               lin.skinny_linear_ref(x4, down).float(), **tol(torch.bfloat16))
    b = rand(2048, seed=4, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(lin.linear(x64, w, b).float(), lin.skinny_linear_ref(x64, w, b).float(),
                               **tol(torch.bfloat16))
    torch.testing.assert_close(lin.gate_up_silu(x64, gu).float(),
                               lin.skinny_linear_ref(x64, gu, silu_mul=True).float(), **tol(torch.bfloat16))


@pytest.mark.parametrize("device,dtype", [CPU, GPU])
def test_gemv_float32_out_is_rounded_like_a_cast(device, dtype):
    """out_dtype=float32 (the batch-1 logits) stores exactly F.linear's rounding, widened: what a
    separate .float() of the x-dtype result gives."""
    x = rand(1, 96, seed=41, device=device, dtype=dtype)
    w = rand(203, 96, seed=42, device=device, dtype=dtype, scale=96**-0.5)
    wide = lin.gemv(x, w, out_dtype=torch.float32)
    assert wide.dtype == torch.float32
    assert torch.equal(wide, lin.gemv(x, w).float())
    assert torch.equal(lin.linear(x.cpu().float(), w.cpu().float(), out_dtype=torch.float64),
                       torch.nn.functional.linear(x.cpu().float(), w.cpu().float()).double())
