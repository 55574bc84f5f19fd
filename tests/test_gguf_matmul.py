"""The GGUF-block kernels (kernels/gguf_matmul.py) against loader/dequant.py + float32 F.linear, on random
valid blocks of every type and odd shapes (Triton's interpreter on CPU, compiled bf16 at real shapes on
CUDA), and on real tensors of the 0.5B's GGUF file."""

from __future__ import annotations

import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from verispec.kernels import gguf_matmul as gm

TYPES = [pytest.param(t, id=gm.type_name(t)) for t in sorted(gm.KERNEL_TYPES)]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
rand_weight = gm.random_weight


def test_kernel_types_cover_the_registry_files_and_the_issue():
    """Q5_0 / Q8_0 / Q4_K / Q6_K: the 0.5B's and gemma-3-270m's quantized tensors; Q5_K: the issue."""
    assert {gm.type_name(t) for t in gm.KERNEL_TYPES} >= {"Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0"}
    assert set(gm.F16_FIELDS) == set(gm.KERNEL_TYPES) == set(gm.GROUP)


def block_elems(qtype: int) -> int:
    return GGML_QUANT_SIZES[T(qtype)][0]


def test_random_blocks_are_valid():
    for t in gm.KERNEL_TYPES:
        w = rand_weight(t, 3, 256, seed=t)
        v = w.dequantize()
        assert v.isfinite().all() and v.abs().max() < 100 and v.std() > 1e-3, gm.type_name(t)


def rand(*shape, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def close(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    """Every element within rel of the output's scale (max |ref|): the K-sums mix signs, so a plain rtol
    would fail on outputs that happen to be near 0."""
    assert out.shape == ref.shape and out.dtype == ref.dtype and not out.isnan().any()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= rel * ref.float().abs().max().item(), (err, ref.float().abs().max().item())


def small_k(qtype: int, tail: bool = False) -> int:
    """K of the interpreter tests: 2 K-quant blocks (3 with `tail`: a 512 tile leaves a tail) or 5 of 32."""
    return (768 if tail else 512) if block_elems(qtype) == 256 else 160


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("block_n,block_k", [(16, 256), (8, 512)])  # 512 does not divide 768 nor 160: a K tail
def test_dequant_tile_is_bit_exact(qtype, block_n, block_k):
    w = rand_weight(qtype, 37, small_k(qtype, tail=True), seed=qtype)
    out = gm.gguf_dequantize(w, block_n, block_k)
    assert torch.equal(out, w.dequantize())


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m,bias", [(1, False), (3, True), (16, True)])
def test_gemv(qtype, m, bias):
    n, k = 37, small_k(qtype)
    w = rand_weight(qtype, n, k, seed=m + qtype)
    x = rand(m, k, seed=m)
    b = rand(n, seed=n) if bias else None
    close(gm.gguf_gemv(x, w, b), gm.gguf_linear_ref(x, w, b), 1e-5)


@pytest.mark.parametrize("qtype", TYPES)
def test_gemv_tiles_and_strided_rows(qtype):
    """A tile that does not divide K, several rows per program, and x a row-strided view."""
    k = small_k(qtype, tail=True)
    w = rand_weight(qtype, 19, k, seed=3)
    x = rand(10, k + 32, seed=4)[::2, :k]
    cfg = dict(BLOCK_M=8, BLOCK_N=4, BLOCK_K=512, num_warps=4)
    close(gm.gguf_gemv(x, w, config=cfg), gm.gguf_linear_ref(x, w), 1e-5)
    one = dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=512, num_warps=4)  # the single-row variant
    close(gm.gguf_gemv(x[1:2], w, config=one), gm.gguf_linear_ref(x[1:2], w), 1e-5)


KQUANT = [pytest.param(int(t), id=t.name) for t in (T.Q4_K, T.Q6_K)]


@pytest.mark.parametrize("qtype", KQUANT)
def test_kquant_gemv_row_is_the_same_alone_and_in_a_batch(qtype):
    """The super-block GEMV (Q4_K / Q6_K): a row's output is bit-identical alone, inside a batch of 5 and
    through the single-row variant, so a request's logits do not depend on the rows beside it."""
    k = small_k(qtype, tail=True)
    w = rand_weight(qtype, 21, k, seed=11)
    x = rand(5, k, seed=12)
    cfg = dict(BLOCK_M=8, BLOCK_N=4, BLOCK_K=512, num_warps=4)
    batch = gm.gguf_gemv(x, w, config=cfg)
    for i in range(5):
        assert torch.equal(gm.gguf_gemv(x[i:i + 1], w, config=cfg)[0], batch[i])
    one = gm.gguf_gemv(x[2:3], w, config=dict(cfg, BLOCK_M=1))
    assert torch.equal(one[0], batch[2])
    assert gm.gemv_config(1, 21, k, qtype)["BLOCK_K"] % 256 == 0  # the default takes this kernel


def x_int8(x: torch.Tensor) -> torch.Tensor:
    """x as the integer-dot GEMV rounds it, written from its definition: each row's groups of 32 elements
    scaled by 127 / max |x|, rounded half up, times max |x| / 127 (a group of zeros stays zero)."""
    m, k = x.shape
    g = x.float().reshape(m, k // 32, 32)
    amax = g.abs().amax(-1, keepdim=True)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / safe, torch.zeros_like(amax))  # (127.0 / t: t's reciprocal times 127)
    return (torch.floor(g * inv + 0.5) * (amax / 127.0)).reshape(m, k)


def int8_ref(x: torch.Tensor, w: gm.GGUFWeight, bias: torch.Tensor | None = None,
             silu_mul: bool = False) -> torch.Tensor:
    """The float64 dot of x rounded to 8 bits (x_int8) with the dequantized weight (+ bias, SiLU-and-mul)."""
    y = x_int8(x).double() @ w.dequantize().double().T
    if bias is not None:
        y = y + bias.double()
    if silu_mul:
        y = torch.nn.functional.silu(y[:, : w.shape[0] // 2]) * y[:, w.shape[0] // 2 :]
    return y.to(x.dtype)


def i8_cfg(**kw) -> dict:
    return dict(dict(I8=1, BLOCK_M=4, BLOCK_N=4, BLOCK_K=512, num_warps=4), **kw)


@pytest.mark.parametrize("qtype", KQUANT)
@pytest.mark.parametrize("m,bias,silu,block_k", [  # the int8 GEMV is off by default: two cells in the CPU
    (1, False, False, 512), (3, True, False, 512),  # suite (the interpreter takes ~10 s a cell), all with -m slow
    pytest.param(2, False, True, 256, marks=pytest.mark.slow), pytest.param(4, True, False, 256, marks=pytest.mark.slow)])
def test_int8_gemv_is_the_dot_with_x_rounded_to_8_bits(qtype, m, bias, silu, block_k):
    """The integer-dot GEMV (Q4_K / Q6_K) equals x rounded to int8 per 32 elements (x_int8) dotted with the
    dequantized weight, to float32 summation error, over 3 super-blocks (a tail with 2 a step), several rows
    per program, a bias or SiLU-and-mul; against the float reference it is off by x's rounding only."""
    n, k = 38, 768
    w = rand_weight(qtype, n, k, seed=m + 5)
    x = rand(m, k, seed=m + 1)
    x[0, 32:64] = 0.0  # a group of zeros
    b = rand(n // 2 if silu else n, seed=9) if bias else None
    cfg = i8_cfg(BLOCK_M=1 if m == 1 else 4, BLOCK_K=block_k)
    out = gm.gguf_gemv(x, w, b, config=cfg, silu_mul=silu)
    close(out, int8_ref(x, w, b, silu), 1e-5)
    err = (out - gm.gguf_linear_ref(x, w, b, silu)).abs().max() / out.abs().max()
    assert 1e-5 < err < 3e-2  # x's 8-bit rounding, no more (and not the float kernel)


@pytest.mark.parametrize("qtype", KQUANT)
def test_int8_gemv_row_is_the_same_alone_and_in_a_batch(qtype):
    k = 768
    w = rand_weight(qtype, 21, k, seed=13)
    x = rand(5, k, seed=14)
    batch = gm.gguf_gemv(x, w, config=i8_cfg(BLOCK_M=8))
    for i in (0, 3):
        assert torch.equal(gm.gguf_gemv(x[i:i + 1], w, config=i8_cfg(BLOCK_M=8))[0], batch[i])
    assert torch.equal(gm.gguf_gemv(x[2:3], w, config=i8_cfg(BLOCK_M=1))[0], batch[2])


def test_int8_gemv_is_an_option_of_one_row_k_quants():
    """KernelOptions.gguf_int8_gemv routes one row of Q4_K / Q6_K to the integer-dot GEMV; off by default, and
    other types and more rows keep their kernels."""
    from verispec.core.options import KernelOptions

    on = KernelOptions(gguf_int8_gemv=True)
    assert gm.linear_plan(1, 2048, 1536, int(T.Q4_K))[1].get("I8", 0) == 0
    for qt in (T.Q4_K, T.Q6_K):
        kernel, cfg = gm.linear_plan(1, 151936, 1536, int(qt), on)
        assert kernel == "gemv" and cfg["I8"] == 1 and cfg["BLOCK_K"] == 512
        assert gm.linear_plan(1, 1536, 8960, int(qt), on)[1]["BLOCK_K"] == 256  # 35 super-blocks: one a step
        assert gm.linear_plan(2, 2048, 1536, int(qt), on)[0] == "mma"
    assert "I8" not in gm.linear_plan(1, 896, 896, int(T.Q5_0), on)[1]


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m,split", [(17, 1), (45, 2), (3, 3)])
def test_mma(qtype, m, split):
    """The tensor-core kernel (float32 tiles in the interpreter: exact products), with and without split K
    (3 splits of 160 or 512 leave uneven ranges), odd M and N, a bias."""
    n, k = 45, small_k(qtype)
    w = rand_weight(qtype, n, k, seed=m + split)
    x, b = rand(m, k, seed=m), rand(n, seed=7)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=split, num_warps=4, num_stages=2)
    close(gm.gguf_mma(x, w, b, config=cfg), gm.gguf_linear_ref(x, w, b), 1e-5)


SB_TYPES = [pytest.param(int(t), id=t.name) for t in (T.Q4_K, T.Q6_K)]


def sb_cfg(**kw) -> dict:
    """A super-block (_mma_sb_kernel) config with small tiles: few interpreted programs."""
    return dict(dict(SB=1, BLOCK_M=16, BLOCK_N=16, SPLIT_K=1, SWAP=1, PARTS=2, num_warps=4, num_stages=2), **kw)


@pytest.mark.parametrize("qtype", SB_TYPES)
@pytest.mark.parametrize("swap,parts", [(1, 2), (0, 2), (1, 1), (0, 1)])
@pytest.mark.parametrize("m,n,split", [(17, 45, 1), (3, 37, 2), (40, 19, 3)])
def test_mma_superblock(qtype, swap, parts, m, n, split):
    """The Q4_K / Q6_K super-block kernel, W as either MMA operand, a super-block in one part or two: odd
    M and N (partial tiles), a bias, 3 super-blocks of K split 2 (2 + 1: the last split's second step is
    past the row) or 3 ways."""
    k = 768
    w = rand_weight(qtype, n, k, seed=m + n)
    x, b = rand(m, k, seed=m), rand(n, seed=9)
    out = gm.gguf_mma(x, w, b, config=sb_cfg(SWAP=swap, PARTS=parts, SPLIT_K=split))
    close(out, gm.gguf_linear_ref(x, w, b), 1e-5)


@pytest.mark.parametrize("qtype", SB_TYPES)
@pytest.mark.parametrize("swap,parts", [(1, 2), (0, 1)])
def test_mma_superblock_reads_every_weight_exactly(qtype, swap, parts):
    """x = the identity: each output is one weight times 1 plus zeros, so the kernel's result is the
    dequantized weight itself, bit for bit (every element's place in the nibble / bit-plane K order)."""
    n, k = 21, 512
    w = rand_weight(qtype, n, k, seed=5)
    out = gm.gguf_mma(torch.eye(k), w, config=sb_cfg(BLOCK_M=64, SWAP=swap, PARTS=parts, SPLIT_K=2))
    assert torch.equal(out, w.dequantize().T)


def test_mma_config_split_does_not_depend_on_rows():
    """The K split (and so each row's float32 sums) is a function of the layer's shape alone."""
    for n, k in [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960), (151936, 1536), (45, 768)]:
        for qtype in (int(T.Q4_K), int(T.Q6_K), int(T.Q8_0)):
            splits = {gm.mma_config(m, n, k, qtype)["SPLIT_K"] for m in (1, 17, 37, 64, 100, 256, 4096)}
            assert len(splits) == 1, (n, k, gm.type_name(qtype), splits)
    assert gm.mma_config(64, 1536, 8960, int(T.Q4_K))["SB"] == 1 and "SB" not in gm.mma_config(64, 64, 64, 8)


_ROW_CHECK = """
import torch
from conftest import _interpreter_math_by_value
_interpreter_math_by_value()  # float32 dots by value, as in the test process (conftest.py)
from verispec.kernels import gguf_matmul as gm
for qtype, k in ((12, 768), (14, 512)):
    w = gm.random_weight(qtype, 45, k, seed=qtype)
    x = torch.randn(100, k, generator=torch.Generator().manual_seed(1))
    for split in (1, 2):
        for swap in (1, 0):
            cfg = lambda m: dict(gm.mma_config(m, 45, k, qtype), SPLIT_K=split, SWAP=swap)
            assert [cfg(m)["BLOCK_M"] for m in (1, 37, 100)] == [16, 64, 128]
            alone = gm.gguf_mma(x[:1], w, config=cfg(1))
            b37 = gm.gguf_mma(x[:37], w, config=cfg(37))
            b100 = gm.gguf_mma(x, w, config=cfg(100))
            assert torch.equal(alone[0], b37[0]) and torch.equal(alone[0], b100[0]), (qtype, split, swap)
            assert torch.equal(b37, b100[:37]), (qtype, split, swap)
print("rows ok")
"""


def test_mma_superblock_rows_do_not_depend_on_the_batch():
    """A row's result does not depend on the rows that come with it, bit for bit: the first row alone
    (BLOCK_M 16) and inside batches of 37 (BLOCK_M 64) and 100 (BLOCK_M 128); the 37 rows alone and as the
    first 37 of the 100. In a child process with single-threaded BLAS, and only at equal positions in the
    tile: the interpreter's tl.dot is numpy's matmul, and OpenBLAS sums a product's entries in an order
    that depends on its thread split and on the entry's place in its micro-kernel (the GPU test checks every
    row of a batch against the row alone)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, TRITON_INTERPRET="1", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([root, str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _ROW_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "rows ok" in r.stdout, r.stderr[-2000:]


SILU_TYPES = [pytest.param(int(t), id=t.name) for t in (T.Q4_K, T.Q6_K, T.Q5_0)]


@pytest.mark.parametrize("qtype", SILU_TYPES)
@pytest.mark.parametrize("kernel,m,cfg", [
    ("gemv", 1, dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=256, num_warps=4)),
    ("gemv", 5, None),
    ("mma", 19, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=2)),
    ("mma", 19, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=2)),
    ("sb", 19, sb_cfg()),
    ("sb", 19, sb_cfg(SPLIT_K=2, SWAP=0)),
])
def test_silu_mul(qtype, kernel, m, cfg):
    """gate_up stacked [gate; up]: silu(x @ gate^T) * (x @ up^T) in the epilogue (split K: in the reduce)."""
    if kernel == "sb" and qtype not in gm.SB_TYPES:
        pytest.skip("the super-block kernel is Q4_K / Q6_K only")
    inter, k = 21, small_k(qtype)
    w = rand_weight(qtype, 2 * inter, k, seed=m)
    x = rand(m, k, seed=m + 1) * 0.02  # gate sums of a few units: SiLU's curved part, no exp overflow
    run = gm.gguf_gemv if kernel == "gemv" else gm.gguf_mma
    out = run(x, w, config=cfg, silu_mul=True)
    ref = gm.gguf_linear_ref(x, w, silu_mul=True)
    assert ref.shape == (m, inter)
    close(out, ref, 1e-5)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("bias,silu", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("chunks", [True, False])
def test_dense_route_dequantizes_in_chunks(qtype, bias, silu, chunks):
    """gguf_dense: W's rows dequantized a chunk at a time (CHUNK small enough for 3 chunks of 16 rows and a
    partial one) or in one (the default CHUNK: the GEMM straight into the output, the bias in it) into x's dtype,
    then a dense GEMM: float32 here, so the reference's products exactly; also into a column slice of a wider
    output, whose other columns stay untouched."""
    n, k, m = 54, small_k(qtype), 7
    w = rand_weight(qtype, n, k, seed=qtype + 11)
    x = rand(m, k, seed=3) * (0.02 if silu else 1.0)
    b = rand(n, seed=4) if bias else None
    cfg = dict(CHUNK=16 * k) if chunks else None
    ref = gm.gguf_linear_ref(x, w, b, silu_mul=silu)
    close(gm.gguf_dense(x, w, b, config=cfg, silu_mul=silu), ref, 1e-5)
    out = torch.full((m, 2 * n), 7.0)
    width = n // 2 if silu else n
    gm.gguf_dense(x, w, b, config=cfg, out=out[:, 3:3 + width], silu_mul=silu)
    close(out[:, 3:3 + width], ref, 1e-5)
    assert (out[:, :3] == 7.0).all() and (out[:, 3 + width:] == 7.0).all()


def test_the_comparison_can_fail():
    """A weight one scale field off gives outputs the checks above reject."""
    w = rand_weight(int(T.Q4_K), 37, 768, seed=1)
    bad = w.blocks.clone()
    bad[5, 0:2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    x = rand(2, 768, seed=2)
    wrong = gm.GGUFWeight(bad, w.qtype, w.shape)
    assert not torch.equal(gm.gguf_dequantize(wrong), w.dequantize())
    with pytest.raises(AssertionError):
        close(gm.gguf_gemv(x, wrong), gm.gguf_linear_ref(x, w), 1e-5)


def test_linear_on_cpu_is_the_reference_and_empty_rows():
    w = rand_weight(int(T.Q8_0), 9, 64, seed=5)
    x = rand(3, 64, seed=6, dtype=torch.bfloat16)
    out = gm.gguf_linear(x, w)
    assert out.dtype == torch.bfloat16 and torch.equal(out, gm.gguf_linear_ref(x, w))
    assert gm.gguf_gemv(x[:0], w).shape == (0, 9) and gm.gguf_mma(x[:0], w).shape == (0, 9)


def test_bad_input_is_a_value_error():
    w = rand_weight(int(T.Q6_K), 4, 256, seed=0)
    with pytest.raises(ValueError, match="no kernel for ggml Q2_K"):
        gm.GGUFWeight.from_raw(torch.zeros(84, dtype=torch.uint8), int(T.Q2_K), (1, 256))
    with pytest.raises(ValueError, match="needs 840 uint8 bytes"):
        gm.GGUFWeight.from_raw(w.blocks.reshape(-1)[:-1], w.qtype, w.shape)
    with pytest.raises(ValueError, match="not a multiple"):
        gm.GGUFWeight(torch.zeros(4, 105, dtype=torch.uint8), w.qtype, (4, 128))
    with pytest.raises(ValueError, match="2-D"):
        gm.GGUFWeight.from_raw(w.blocks, w.qtype, (4, 256, 1))
    with pytest.raises(ValueError, match=r"floating \[M, 256\]"):
        gm.gguf_linear(torch.zeros(2, 255), w)
    with pytest.raises(ValueError, match=r"bias must be \[4\]"):
        gm.gguf_gemv(torch.zeros(2, 256), w, torch.zeros(5))
    with pytest.raises(ValueError, match="BLOCK_K=8 must be a power of two >= 16"):
        gm.gguf_mma(torch.zeros(2, 256), w, config=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=8))
    with pytest.raises(ValueError, match="exceed BLOCK_M"):
        gm.gguf_gemv(torch.zeros(3, 256), w, config=dict(BLOCK_M=2, BLOCK_N=2, BLOCK_K=256))
    with pytest.raises(ValueError, match="silu_mul needs"):
        gm.gguf_linear(torch.zeros(2, 256), rand_weight(int(T.Q6_K), 5, 256, seed=0), silu_mul=True)
    with pytest.raises(ValueError, match="one type, K and device"):
        gm.GGUFWeight.cat([w, rand_weight(int(T.Q4_K), 4, 256, seed=0)])


@pytest.mark.parametrize("kernel", ["gemv", "mma", "linear"])
def test_parts_of_different_types_write_one_output(kernel):
    """A fused projection whose parts differ in type (the 1.5B's q / k Q4_K, v Q6_K in half its layers):
    each part writes its columns of one [M, N] buffer through out=, and nothing else of it."""
    q, v = rand_weight(int(T.Q4_K), 24, 256, seed=1), rand_weight(int(T.Q6_K), 9, 256, seed=2)
    m = 3 if kernel == "gemv" else 20
    x = rand(m, 256, seed=3)
    out = torch.full((m, 40), 7.0)
    run = dict(gemv=gm.gguf_gemv, mma=gm.gguf_mma, linear=gm.gguf_linear)[kernel]
    assert run(x, q, out=out[:, :24]).data_ptr() == out.data_ptr()
    run(x, v, out=out[:, 24:33])
    close(out[:, :24], gm.gguf_linear_ref(x, q), 1e-5)
    close(out[:, 24:33], gm.gguf_linear_ref(x, v), 1e-5)
    assert (out[:, 33:] == 7.0).all()
    with pytest.raises(ValueError, match="out must be"):
        run(x, v, out=out[:, :8])


def test_cat_stacks_rows():
    a, b = rand_weight(int(T.Q5_0), 3, 64, seed=1), rand_weight(int(T.Q5_0), 5, 64, seed=2)
    both = gm.GGUFWeight.cat([a, b])
    assert both.shape == (8, 64) and torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


def test_real_tensors_of_the_05b(qwen05_path):
    """Layer 0's linear weights of the real 0.5B (Q5_0, Q8_0, Q6_K) and a Q4_K one (layer 11's down):
    the kernels' dequantization equals loader/dequant.py's bit for bit on the whole tensor, and both
    kernels match the reference on a slice of rows (the interpreter is slow on whole layers)."""
    from verispec.loader.gguf import GGUFFile

    f = GGUFFile(qwen05_path)
    names = [f"blk.0.{p}.weight" for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                            "ffn_down")] + ["blk.11.ffn_down.weight"]
    seen = set()
    for name in names:
        w = gm.GGUFWeight.from_gguf(f, name)
        seen.add(gm.type_name(w.qtype))
        assert w.shape == f.tensor(name).shape and w.nbytes == f.tensor(name).nbytes
        assert torch.equal(gm.gguf_dequantize(w, 256, 1024), w.dequantize()), name
        rows = gm.GGUFWeight(w.blocks[:21], w.qtype, (21, w.shape[1]))
        x = rand(17, w.shape[1], seed=len(name))
        gemv_cfg = dict(BLOCK_M=8, BLOCK_N=32, BLOCK_K=1024, num_warps=4)  # big tiles: few interpreted programs
        close(gm.gguf_gemv(x[:5], rows, config=gemv_cfg), gm.gguf_linear_ref(x[:5], rows), 1e-5)
        cfg = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=256, SPLIT_K=2, num_warps=4, num_stages=2)
        close(gm.gguf_mma(x, rows, config=cfg), gm.gguf_linear_ref(x, rows), 1e-5)
        if w.qtype in gm.KQUANT_GEMV_TYPES:  # the integer-dot GEMV: x rounded to int8, then the real weight
            i8 = gm.gguf_gemv(x[:2], rows, config=i8_cfg(BLOCK_N=32, BLOCK_K=256))
            close(i8, int8_ref(x[:2], rows), 1e-5)
            close(i8, gm.gguf_linear_ref(x[:2], rows), 3e-2)
    assert seen == {"Q5_0", "Q8_0", "Q6_K", "Q4_K"}


# Real layer shapes of the 1.5B: qkv and down (o, gate_up and the LM head: scripts/gguf_bench.py checks them).
GPU_SHAPES = [(2048, 1536), (1536, 8960)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_real_shapes(qtype, n, k):
    """bf16 activations at the 1.5B's shapes, both kernels through gguf_linear's dispatch: the GEMV's
    float32 products leave only the output's rounding; the tensor-core kernel also rounds W to bf16."""
    w = rand_weight(qtype, n, k, seed=n + k, device="cuda")
    b = rand(n, seed=1, device="cuda", dtype=torch.bfloat16)
    for m in (1, 5, 16, 17, 64, 256):  # the GEMV (one compile for all), partial and full tensor-core tiles
        x = rand(m, k, seed=m, device="cuda", dtype=torch.bfloat16)
        close(gm.gguf_linear(x, w, b), gm.gguf_linear_ref(x, w, b), 1e-2)
    assert torch.equal(gm.gguf_dequantize(w), w.dequantize())


@pytest.mark.gpu
@gpu
def test_gpu_gate_up_silu_mul():
    """The 1.5B's gate_up (Q4_K, [gate; up] 17920 x 1536) with SiLU-and-mul fused, both kernels."""
    w = rand_weight(int(T.Q4_K), 17920, 1536, seed=4, device="cuda")
    for m in (1, 7, 64):
        x = rand(m, 1536, seed=m, device="cuda", dtype=torch.bfloat16)
        close(gm.gguf_linear(x, w, silu_mul=True), gm.gguf_linear_ref(x, w, silu_mul=True), 1e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 8, 64, 256])
def test_gpu_cuda_graph_capture(m):
    """gguf_linear captured in a CUDA graph (split-K workspace and the dense route's scratch included) replays
    on new inputs."""
    w = rand_weight(int(T.Q4_K), 1536, 8960, seed=0, device="cuda")
    x = rand(m, 8960, seed=1, device="cuda", dtype=torch.bfloat16)
    gm.gguf_linear(x, w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gm.gguf_linear(x, w)
    for seed in (2, 3):
        x.copy_(rand(m, 8960, seed=seed, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        close(out, gm.gguf_linear_ref(x, w), 1e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qtype", KQUANT)
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_kquant_gemv_row_is_the_same_alone_and_in_a_batch(qtype, n, k):
    """Compiled for the GPU, the single-row variant (one row) and the multi-row one (up to 16) give a row
    bit-identical outputs, as the interpreter test above shows for the same code."""
    w = rand_weight(qtype, n, k, seed=7, device="cuda")
    x = rand(9, k, seed=8, device="cuda", dtype=torch.bfloat16)
    batch = gm.gguf_gemv(x, w)
    for i in (0, 4, 8):
        assert torch.equal(gm.gguf_gemv(x[i:i + 1], w)[0], batch[i])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qtype", KQUANT)
@pytest.mark.parametrize("n,k", GPU_SHAPES + [(151936, 1536)])
def test_gpu_int8_gemv(qtype, n, k):
    """Compiled (dp4a), the integer-dot GEMV's default tiles at the 1.5B's shapes: x rounded to int8 dotted
    with the weight (bf16 output rounding; x_int8's float32 rounding may differ by one quant where the GPU
    fuses x * 127 / max + 0.5), a row the same alone as in a batch, and a CUDA-graph replay."""
    from verispec.core.options import KernelOptions

    w = rand_weight(qtype, n, k, seed=n + 1, device="cuda")
    x = rand(1, k, seed=2, device="cuda", dtype=torch.bfloat16)
    opts = KernelOptions(gguf_int8_gemv=True)
    out = gm.gguf_linear(x, w, options=opts)
    close(out, int8_ref(x, w), 1e-2)
    xs = rand(5, k, seed=3, device="cuda", dtype=torch.bfloat16)
    cfg = gm.gemv_config(5, n, k, qtype, int8=True)
    batch = gm.gguf_gemv(xs, w, config=cfg)
    for i in (0, 4):
        assert torch.equal(gm.gguf_gemv(xs[i:i + 1], w, config=cfg)[0], batch[i])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gm.gguf_linear(x, w, options=opts)
    x.copy_(rand(1, k, seed=4, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    close(y, int8_ref(x, w), 1e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qtype", SB_TYPES)
@pytest.mark.parametrize("n,k", [(1536, 8960), (2048, 1536)])
def test_gpu_superblock_rows_do_not_depend_on_the_batch(qtype, n, k):
    """Compiled bf16, the default configs (split K on these shapes; BLOCK_M 16 / 64 / 128 with 4 / 4 / 8
    warps): every row of batches of 37 and 256 equals the row alone, bit for bit."""
    w = rand_weight(qtype, n, k, seed=3, device="cuda")
    x = rand(256, k, seed=4, device="cuda", dtype=torch.bfloat16)
    b256 = gm.gguf_mma(x, w)
    b37 = gm.gguf_mma(x[:37], w)
    assert torch.equal(b37, b256[:37])
    for r in range(37):
        assert torch.equal(gm.gguf_mma(x[r : r + 1], w)[0], b37[r]), r
    for r in (37, 100, 255):
        assert torch.equal(gm.gguf_mma(x[r : r + 1], w)[0], b256[r]), r


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qtype", SB_TYPES)
@pytest.mark.parametrize("swap,parts", [(1, 2), (0, 1)])
def test_gpu_superblock_reads_every_weight_exactly(qtype, swap, parts):
    """Compiled: x = the identity gives the weight rounded to bf16, bit for bit (the tile order on the GPU)."""
    n, k = 200, 1536
    w = rand_weight(qtype, n, k, seed=6, device="cuda")
    cfg = dict(gm.mma_config(k, n, k, qtype), SWAP=swap, PARTS=parts)
    out = gm.gguf_mma(torch.eye(k, device="cuda", dtype=torch.bfloat16), w, config=cfg)
    assert torch.equal(out, w.dequantize().to(torch.bfloat16).T)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qtype", KQUANT)
def test_gpu_batch_invariant_linear_is_one_kernel_for_every_row_count(qtype):
    """With KernelOptions(batch_invariant=True) gguf_linear takes the tensor-core kernel at every M, so a row
    alone (the GEMV's range without it) gives the bits it gets in a batch of 37 (the tensor-core range)."""
    from verispec.core.options import KernelOptions

    inv = KernelOptions(batch_invariant=True)
    w = rand_weight(qtype, 1536, 8960, seed=9, device="cuda")
    x = rand(37, 8960, seed=10, device="cuda", dtype=torch.bfloat16)
    batch = gm.gguf_linear(x, w, options=inv)
    for i in (0, 20, 36):
        assert torch.equal(gm.gguf_linear(x[i:i + 1], w, options=inv)[0], batch[i])


def test_linear_plan_follows_the_measured_crossovers():
    """gguf_linear's pick (session 14's H200 figures): Q4_K / Q6_K take the GEMV for one row, the super-block
    tensor-core kernel for 2..SB_MAX_ROWS rows, other types the GEMV up to GEMV_MAX_ROWS and the generic
    tensor-core kernel above; every type the dense route (gguf_dense) from DENSE_MIN_ROWS; with batch_invariant the tensor-core kernel of the type at every row count, with the
    same tiles whatever m where the tiles set a row's sums (split, SWAP, PARTS)."""
    from verispec.core.options import KernelOptions

    q4, q8 = int(T.Q4_K), int(T.Q8_0)
    assert gm.linear_plan(1, 2048, 1536, q4)[0] == "gemv"
    for m in (2, 16, gm.SB_MAX_ROWS):
        kernel, cfg = gm.linear_plan(m, 2048, 1536, q4)
        assert kernel == "mma" and cfg.get("SB") == 1, m
    assert gm.DENSE_MIN_ROWS == gm.SB_MAX_ROWS + 1
    assert [gm.linear_plan(m, 2048, 1536, q4)[0] for m in (65, 256)] == ["dense", "dense"]
    assert gm.linear_plan(gm.GEMV_MAX_ROWS, 896, 896, q8)[0] == "gemv"
    kernel, cfg = gm.linear_plan(gm.GEMV_MAX_ROWS + 1, 896, 896, q8)
    assert kernel == "mma" and "SB" not in cfg
    assert [gm.linear_plan(m, 896, 896, q8)[0] for m in (64, 65)] == ["mma", "dense"]
    inv = KernelOptions(batch_invariant=True)
    plans = [gm.linear_plan(m, 1536, 8960, q4, inv) for m in (1, 5, 64, 256)]
    assert all(k == "mma" and c["SB"] == 1 for k, c in plans)
    fixed = {(c["SPLIT_K"], c["SWAP"], c["PARTS"], c["BLOCK_N"]) for _, c in plans}
    assert len(fixed) == 1
