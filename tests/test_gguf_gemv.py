"""The one-row Q4_K GEMV (kernels/gguf_gemv.py) against the float64 dot of the same bfloat16 x with
loader/dequant.py's weights, within a bound from the kernel's float32 arithmetic (within_bound): one bfloat16
ulp of the output's rounding plus the error of its folded dequant constant and of float32 sums. Triton's
interpreter on CPU at small odd shapes, compiled at the 1.5B's shapes on CUDA; and the dispatch: which calls
take it.

Session 24's GPU run failed a bound of one ulp alone at the 1.5B's shapes (17.8 ulp at 2048x1536, 75 at the LM
head): outputs near zero, where one ulp is far below the float32 error of a dot of 1536 products. A float32
emulation of the kernel's weights (the folded constant rounded as the kernel rounds it) reproduces those
figures on the CPU (test_the_float32_error_exceeds_one_ulp_near_zero), so the bound was wrong, not the
arithmetic."""

from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from verispec.core.options import KernelOptions
from verispec.kernels import gguf_matmul as gm
from verispec.kernels.gguf_gemv import q4k_gemv1_config, q6k_gemv1_config, resident_tiles
from verispec.loader.dequant import quants

Q4 = int(T.Q4_K)
Q6 = int(T.Q6_K)
ON = KernelOptions(gguf_gemv1=True)  # the one-row kernel (the default since session 26)
OFF = KernelOptions(gguf_gemv1=False)  # gguf_matmul's super-block GEMV
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def exact(x: torch.Tensor, w: gm.GGUFWeight, bias: torch.Tensor | None, silu_mul: bool) -> torch.Tensor:
    """float64 x @ dequant(w)^T (+ bias; SiLU-and-mul of the halves)."""
    y = x.double() @ w.dequantize().double().T
    if bias is not None:
        y = y + bias.double()
    if silu_mul:
        y = torch.nn.functional.silu(y[:, : w.shape[0] // 2]) * y[:, w.shape[0] // 2 :]
    return y


U = 2.0 ** -24  # float32 unit roundoff


def _ulp(mag: torch.Tensor) -> torch.Tensor:
    """One bfloat16 ulp at |value| mag: 2^(exponent - 7)."""
    return torch.exp2(torch.floor(torch.log2(mag.clamp_min(2.0 ** -60))) - 7)


def fold_terms(w: gm.GGUFWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per element of w, float64 [N, K]: its quant q, 2^p (p = 11 for a 64-chunk's low nibbles, the first 32
    elements, 7 for its high ones), its sub-block's d sc and -dmin m (loader/dequant.quants)."""
    q, scale, bias = quants(w.blocks.reshape(-1).cpu(), Q4, tuple(w.shape))
    k = q.shape[1]
    group = torch.arange(k) // 32
    p = torch.where(torch.arange(k) % 64 < 32, 2.0 ** 11, 2.0 ** 7).double()
    return q.double(), p.expand(q.shape), scale.double()[:, group], bias.double()[:, group]


def dot_error_bound(x: torch.Tensor, w: gm.GGUFWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact float64 x @ dequant(w)^T, a bound on the kernel's float32 error of each output) [1, N].

    Per weight, the kernel folds d sc q - dmin m into f a + c with f = 1 + q / 2^p (p = 11 for a 64-chunk's
    low nibbles, the first 32 elements, 7 for its high ones), a = 2^p d sc, c = -(a + dmin m): c rounds to
    float32 (<= U (a + dmin m)) and the FMA's weight once more (<= U |w|). The sums: each accumulator lane
    chains 8 products a step over K / (32 SB) steps and the lanes (32 SB a row, SB <= 8) are then reduced,
    so no product passes more than D = K / 32 + 256 roundings: <= D U / (1 - D U) of sum |x w| (Higham's
    gamma_D)."""
    _, p, s, b = fold_terms(w)
    k = w.shape[1]
    wd = w.dequantize().double().cpu()
    ax = x.double().abs().cpu()
    d = k / 32 + 256
    per_weight = U * (p * s + b.abs()) + U * wd.abs()
    bound = ax @ per_weight.T + (d * U / (1 - d * U)) * (ax @ wd.abs().T)
    return (x.double().cpu() @ wd.T), bound


def q6k_error_bound(x: torch.Tensor, w: gm.GGUFWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """dot_error_bound for the Q6_K kernel: its weight d sc (q - 32) is one FMA of exact float32 terms (a f + c,
    a = 64 d sc, c = -96 d sc), so it rounds once (<= U |w|); each lane chains 16 products, then <= 7 + 1 + 31 + 1
    roundings of the reduction: fewer than D = K / 32 + 256."""
    wd = w.dequantize().double().cpu()
    ax = x.double().abs().cpu()
    d = w.shape[1] / 32 + 256
    bound = U * (ax @ wd.abs().T) + (d * U / (1 - d * U)) * (ax @ wd.abs().T)
    return (x.double().cpu() @ wd.T), bound


def within_bound(out: torch.Tensor, x: torch.Tensor, w: gm.GGUFWeight, bias: torch.Tensor | None,
                 silu_mul: bool) -> None:
    """|out - exact| <= E + one bfloat16 ulp at |exact| + E, for every output: E is dot_error_bound's
    (carried through the bias's float32 add, or through SiLU-and-mul: |silu'| <= 1.1, and a few roundings
    of the float32 epilogue); the ulp covers the rounding to bfloat16, to nearest (GPU) or toward zero (the
    interpreter)."""
    assert out.dtype == torch.bfloat16 and out.isfinite().all()
    y, e = (q6k_error_bound if w.qtype == Q6 else dot_error_bound)(x, w)
    if silu_mul:
        h = w.shape[0] // 2
        g, up, eg, eu = y[:, :h], y[:, h:], e[:, :h], e[:, h:]
        sg = torch.nn.functional.silu(g)
        ref = sg * up
        e = 1.1 * eg * (up.abs() + eu) + (sg.abs() + 1.1 * eg) * eu + 8 * U * ref.abs()
    else:
        ref = y + (bias.double().cpu() if bias is not None else 0.0)
        e = e + 2 * U * ref.abs()
    assert out.shape == ref.shape
    err = (out.double().cpu() - ref).abs()
    worst = (err / (e + _ulp(ref.abs() + e))).max().item()
    assert worst <= 1.0, f"worst error {worst:.3f} of the bound"


def one_row(x, w, bias=None, silu_mul=False, **tiles):
    config = q6k_gemv1_config if w.qtype == Q6 else q4k_gemv1_config
    cfg = dict(ONE_ROW=1, BLOCK_M=1, **(tiles or config(w.shape[0] // (2 if silu_mul else 1), w.shape[1])))
    return gm.gguf_gemv(x, w, bias, config=cfg, silu_mul=silu_mul)


def bf16(*shape, seed: int, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, torch.bfloat16)


@pytest.mark.parametrize("n,k,tiles,silu,bias", [
    (37, 512, {}, False, False),                                   # default tiles: SB 2 divides, N does not
    (40, 768, dict(BLOCK_N=4, SB=8, num_warps=4), False, True),    # one masked step (3 of 8 super-blocks)
    (32, 512, dict(BLOCK_N=16, SB=2, num_warps=4), True, False),   # no masks; [gate; up]
    (24, 1280, dict(BLOCK_N=8, SB=4, num_warps=4), True, False),   # 5 super-blocks: a masked last step
])
def test_one_row_is_within_the_float32_bound_of_the_exact_dot(n, k, tiles, silu, bias):
    w = gm.random_weight(Q4, 2 * n if silu else n, k, seed=n + k)
    x = bf16(1, k, seed=k)
    b = bf16(n, seed=n) if bias else None
    within_bound(one_row(x, w, b, silu, **tiles), x, w, b, silu)


@pytest.mark.parametrize("n,k,tiles,silu,bias", [
    (37, 1536, dict(RES=1, BLOCK_N=2, num_warps=4), False, True),   # 6 = 4 + 2 super-blocks; N odd: masked rows
    (16, 768, dict(RES=1, BLOCK_N=4, num_warps=4), True, False),     # 3 = 2 + 1; [gate; up]
    (12, 1280, dict(RES=1, BLOCK_N=4, num_warps=2), False, False),   # 5 = 4 + 2, the second tile masked
    (8, 2048, dict(RES=1, BLOCK_N=8, num_warps=4), False, False),    # 8: one tile, no second
])
def test_the_resident_form_is_within_the_bound(n, k, tiles, silu, bias):
    """Q4_K's resident form (every byte of the rows requested before the PDL wait, the row as two tiles)."""
    w = gm.random_weight(Q4, 2 * n if silu else n, k, seed=n + k)
    x = bf16(1, k, seed=k)
    b = bf16(n, seed=n) if bias else None
    within_bound(one_row(x, w, b, silu, **tiles), x, w, b, silu)


@pytest.mark.parametrize("n,k,tiles,silu,bias", [
    (37, 1536, {}, False, False),                              # default tiles, 6 = 4 + 2, N odd
    (9, 768, dict(BLOCK_N=4, num_warps=4), False, True),       # 3 = 2 + 1; bias
    (16, 1280, dict(BLOCK_N=2, num_warps=2), True, False),     # 5 = 4 + 2 masked; [gate; up]
    (4, 256, dict(BLOCK_N=4, num_warps=1), False, False),      # one super-block
])
def test_q6k_one_row_is_within_the_bound(n, k, tiles, silu, bias):
    """The resident Q6_K GEMV against the float64 dot of loader/dequant.py's weights."""
    w = gm.random_weight(Q6, 2 * n if silu else n, k, seed=n + k)
    x = bf16(1, k, seed=k)
    b = bf16(n, seed=n) if bias else None
    within_bound(one_row(x, w, b, silu, **tiles), x, w, b, silu)


def test_the_q6k_bound_catches_one_elements_high_bits():
    """One element's qh bit pair changed (its quant 32 away, the element of the row's largest x so that the
    change shows above the sums' error): the output of that row breaks the bound, the others keep it. So a
    kernel that read qh at the wrong bits would fail the test above."""
    n, k = 8, 1536
    w = gm.random_weight(Q6, n, k, seed=11)
    x = bf16(1, k, seed=12)
    e = int(x[0].float().abs().argmax())
    s, r = divmod(e, 256)
    h, r = divmod(r, 128)
    j, pos = divmod(r, 32)
    blocks = w.blocks.clone().view(n, k // 256, 210)
    blocks[3, s, 128 + 32 * h + pos] ^= 2 << (2 * j)  # the high bit of the pair: q +- 32
    bad = gm.GGUFWeight.from_raw(blocks.reshape(-1), Q6, (n, k))
    out = one_row(x, bad)
    y, bound = q6k_error_bound(x, w)
    ratio = ((out.double() - y).abs() / (bound + 2 * U * y.abs() + _ulp(y.abs() + bound)))[0]
    assert ratio[3] > 1.0, ratio
    assert (ratio[torch.arange(n) != 3] <= 1.0).all(), ratio


def test_resident_tiles():
    """The largest power of two of the row's super-blocks, then the power of two >= the rest."""
    assert resident_tiles(1536) == (4, 2)
    assert resident_tiles(8960) == (32, 4)
    assert resident_tiles(2048) == (8, 0)
    assert resident_tiles(768) == (2, 1)
    assert resident_tiles(256) == (1, 0)


def folded_weights(w: gm.GGUFWeight) -> torch.Tensor:
    """The weights as the kernel computes them, emulated on the CPU: fl32(f a + fl32(-(a + dmin m))) (the
    FMA rounds once; f a and the sum are exact in float64 here)."""
    q, p, s, b = fold_terms(w)
    a = p * s
    c = (b - a).float().double()
    return ((1 + q / p) * a + c).float()


def test_the_float32_error_exceeds_one_ulp_near_zero():
    """At the 1.5B's qkv shape the emulated kernel (folded weights, float32 sums) is 17.8 ulp from the exact
    dot at its worst output, as the compiled kernel was in session 24, yet within the bound; a bound of one
    ulp alone cannot hold there."""
    w = gm.random_weight(Q4, 2048, 1536, seed=2048)
    x = bf16(1, 1536, seed=1536)
    ref = exact(x, w, None, False)
    out = (x.float() @ folded_weights(w).T).to(torch.bfloat16)
    worst_ulp = ((out.double() - ref).abs() / _ulp(ref.abs())).max().item()
    assert worst_ulp > 10.0, worst_ulp
    within_bound(out, x, w, None, False)


def test_the_bound_catches_one_sub_block_one_step_off():
    """Every weight of one sub-block one quantization step off (d sc, the row's largest step, toward x's sign,
    so that the errors add up), in each of 8 rows: each of those outputs breaks the bound; the others stay
    within it."""
    w = gm.random_weight(Q4, 64, 1536, seed=3)
    x = bf16(1, 1536, seed=4)
    _, scale, _ = quants(w.blocks.reshape(-1), Q4, tuple(w.shape))
    wf = folded_weights(w)
    rows = torch.arange(0, 64, 8)
    for r in rows.tolist():
        g = int(scale[r].abs().argmax())
        wf[r, 32 * g : 32 * g + 32] += scale[r, g].abs() * x[0, 32 * g : 32 * g + 32].float().sign()
    out = (x.float() @ wf.T).to(torch.bfloat16)
    y, e = dot_error_bound(x, w)
    err = (out.double() - y).abs()
    ratio = (err / (e + _ulp(y.abs() + e)))[0]
    assert (ratio[rows] > 1.0).all(), ratio[rows]
    keep = torch.ones(64, dtype=torch.bool)
    keep[rows] = False
    assert (ratio[keep] <= 1.0).all()


def test_the_ulp_check_can_fail():
    """Another weight's outputs are far outside the bound."""
    w = gm.random_weight(Q4, 16, 512, seed=1)
    other = gm.random_weight(Q4, 16, 512, seed=2)
    x = bf16(1, 512, seed=3)
    with pytest.raises(AssertionError, match="of the bound"):
        within_bound(one_row(x, other), x, w, None, False)


def test_dispatch_takes_it_for_one_bf16_row_of_q4k_only():
    """linear_plan gives one row of Q4_K the kernel with KernelOptions.gguf_gemv1 (the default since the 1.5B's
    batch-1 step timed faster with it, session 26); Q6_K, more rows, the int8 option and gguf_gemv1=False keep
    the others; a float32 x falls back to the float GEMV (its 1e-5 accuracy, which bfloat16 output could not
    show)."""
    kernel, cfg = gm.linear_plan(1, 2048, 1536, Q4, ON)
    assert kernel == "gemv" and cfg["ONE_ROW"] == 1
    assert KernelOptions().gguf_gemv1 and gm.linear_plan(1, 2048, 1536, Q4)[1]["ONE_ROW"] == 1
    assert "ONE_ROW" not in gm.linear_plan(1, 2048, 1536, Q4, OFF)[1]
    assert "ONE_ROW" not in gm.linear_plan(1, 2048, 1536, Q4, KernelOptions(gguf_gemv1=True, gguf_int8_gemv=True))[1]
    assert "ONE_ROW" not in gm.linear_plan(1, 2048, 1536, Q6, ON)[1]
    q6 = gm.linear_plan(1, 2048, 1536, Q6, KernelOptions(gguf_gemv1_q6k=True))[1]
    assert q6["ONE_ROW"] == 1 and q6 == dict(ONE_ROW=1, BLOCK_M=1, **q6k_gemv1_config(2048, 1536))
    assert gm.linear_plan(1, 2048, 1536, Q4, KernelOptions(gguf_gemv1_resident=True))[1]["RES"] == 1
    assert "RES" not in gm.linear_plan(1, 2048, 1536, Q4, ON)[1]
    assert gm.linear_plan(2, 2048, 1536, Q4, ON)[0] == "mma"
    w = gm.random_weight(Q4, 21, 512, seed=5)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(6))
    out = one_row(x, w)
    ref = gm.gguf_linear_ref(x, w)
    assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_default_tiles():
    """SB 8, 4 rows of 4 warps below 16,384 rows; SB 1, 16 rows of 2 warps from there on (session 24's sweep);
    the resident forms' tiles by row length."""
    assert q4k_gemv1_config(2048, 1536) == dict(BLOCK_N=4, SB=8, num_warps=4)
    assert q4k_gemv1_config(1536, 8960) == dict(BLOCK_N=4, SB=8, num_warps=4)
    assert q4k_gemv1_config(16383, 1536) == dict(BLOCK_N=4, SB=8, num_warps=4)
    assert q4k_gemv1_config(17920, 1536) == dict(BLOCK_N=16, SB=1, num_warps=2)
    # the resident forms' first guesses (offline SASS): more rows a program where a row is short
    assert q4k_gemv1_config(2048, 1536, resident=True) == dict(RES=1, BLOCK_N=8, num_warps=4)
    assert q4k_gemv1_config(1536, 8960, resident=True) == dict(RES=1, BLOCK_N=4, num_warps=4)
    assert q6k_gemv1_config(151936, 1536) == dict(BLOCK_N=4, num_warps=4)
    assert q6k_gemv1_config(1536, 8960) == dict(BLOCK_N=2, num_warps=4)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,k,silu", [(2048, 1536, False), (1536, 1536, False), (17920, 1536, True),
                                      (1536, 8960, False), (151936, 1536, False), (1000, 2304, False)])
@pytest.mark.parametrize("qtype,resident", [(Q4, False), (Q4, True), (Q6, True)])
def test_gpu_one_row_at_real_shapes(n, k, silu, qtype, resident):
    """Compiled (inline PTX), the 1.5B's qkv, o, gate_up, down and LM head shapes and an odd one: within
    the float32 bound of the exact dot, through gguf_linear's own dispatch; Q4_K in both forms, Q6_K."""
    opts = KernelOptions(gguf_gemv1_q6k=True, gguf_gemv1_resident=resident)
    w = gm.random_weight(qtype, 2 * n if silu else n, k, seed=n, device="cuda")
    x = bf16(1, k, seed=k, device="cuda")
    assert gm.linear_plan(1, n, k, qtype, opts)[1].get("ONE_ROW") == 1
    within_bound(gm.gguf_linear(x, w, silu_mul=silu, options=opts), x, w, None, silu)
