"""The one-row Q4_K GEMV (kernels/gguf_gemv.py) against the float64 dot of the same bfloat16 x with
loader/dequant.py's weights: every output within one bfloat16 ulp of the exact value (the interpreter rounds
to bfloat16 toward zero, the GPU to nearest; the float32 sums and the kernel's folded dequant constant add far
less). Triton's interpreter on CPU at small odd shapes, compiled at the 1.5B's shapes on CUDA; and the
dispatch: which calls take it."""

from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from verispec.core.options import KernelOptions
from verispec.kernels import gguf_matmul as gm
from verispec.kernels.gguf_gemv import q4k_gemv1_config

Q4 = int(T.Q4_K)
ON = KernelOptions(gguf_gemv1=True)  # the one-row kernel (off by default since its GPU test failed)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def exact(x: torch.Tensor, w: gm.GGUFWeight, bias: torch.Tensor | None, silu_mul: bool) -> torch.Tensor:
    """float64 x @ dequant(w)^T (+ bias; SiLU-and-mul of the halves)."""
    y = x.double() @ w.dequantize().double().T
    if bias is not None:
        y = y + bias.double()
    if silu_mul:
        y = torch.nn.functional.silu(y[:, : w.shape[0] // 2]) * y[:, w.shape[0] // 2 :]
    return y


def within_one_ulp(out: torch.Tensor, ref: torch.Tensor) -> None:
    """|out - ref| <= one bfloat16 ulp at |ref| (2^(exponent - 7)) for every element."""
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape and out.isfinite().all()
    mag = ref.abs().clamp_min(2.0 ** -60)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - 7)
    err = (out.double() - ref).abs()
    worst = (err / ulp).max().item()
    assert worst <= 1.0, f"worst error {worst:.3f} ulp"


def one_row(x, w, bias=None, silu_mul=False, **tiles):
    cfg = dict(ONE_ROW=1, BLOCK_M=1, **(tiles or q4k_gemv1_config(w.shape[0] // (2 if silu_mul else 1), w.shape[1])))
    return gm.gguf_gemv(x, w, bias, config=cfg, silu_mul=silu_mul)


def bf16(*shape, seed: int, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, torch.bfloat16)


@pytest.mark.parametrize("n,k,tiles,silu,bias", [
    (37, 512, {}, False, False),                                   # default tiles: SB 2 divides, N does not
    (40, 768, dict(BLOCK_N=4, SB=8, num_warps=4), False, True),    # one masked step (3 of 8 super-blocks)
    (32, 512, dict(BLOCK_N=16, SB=2, num_warps=4), True, False),   # no masks; [gate; up]
    (24, 1280, dict(BLOCK_N=8, SB=4, num_warps=4), True, False),   # 5 super-blocks: a masked last step
])
def test_one_row_is_within_one_ulp_of_the_exact_dot(n, k, tiles, silu, bias):
    w = gm.random_weight(Q4, 2 * n if silu else n, k, seed=n + k)
    x = bf16(1, k, seed=k)
    b = bf16(n, seed=n) if bias else None
    within_one_ulp(one_row(x, w, b, silu, **tiles), exact(x, w, b, silu))


def test_the_ulp_check_can_fail():
    """A weight read one sub-block off (another weight's sums) is far outside one ulp."""
    w = gm.random_weight(Q4, 16, 512, seed=1)
    other = gm.random_weight(Q4, 16, 512, seed=2)
    x = bf16(1, 512, seed=3)
    with pytest.raises(AssertionError, match="ulp"):
        within_one_ulp(one_row(x, other), exact(x, w, None, False))


def test_dispatch_takes_it_for_one_bf16_row_of_q4k_only():
    """linear_plan gives one row of Q4_K the kernel with KernelOptions.gguf_gemv1 (default off: it failed
    its GPU test); Q6_K, more rows, the int8 option and the default keep the others; a float32 x falls back
    to the float GEMV (its 1e-5 accuracy, which bfloat16 output could not show)."""
    kernel, cfg = gm.linear_plan(1, 2048, 1536, Q4, ON)
    assert kernel == "gemv" and cfg["ONE_ROW"] == 1
    assert "ONE_ROW" not in gm.linear_plan(1, 2048, 1536, Q4)[1]
    assert "ONE_ROW" not in gm.linear_plan(1, 2048, 1536, Q4, KernelOptions(gguf_gemv1=True, gguf_int8_gemv=True))[1]
    assert "ONE_ROW" not in gm.linear_plan(1, 2048, 1536, int(T.Q6_K), ON)[1]
    assert gm.linear_plan(2, 2048, 1536, Q4, ON)[0] == "mma"
    w = gm.random_weight(Q4, 21, 512, seed=5)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(6))
    out = one_row(x, w)
    ref = gm.gguf_linear_ref(x, w)
    assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_default_tiles():
    """SB 2 where it divides a row of at most 8 super-blocks (no masks at K = 1536), else 8; 128 threads of
    4 SB a row."""
    assert q4k_gemv1_config(2048, 1536) == dict(BLOCK_N=16, SB=2, num_warps=4)
    assert q4k_gemv1_config(1536, 8960) == dict(BLOCK_N=4, SB=8, num_warps=4)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,k,silu", [(2048, 1536, False), (1536, 1536, False), (17920, 1536, True),
                                      (1536, 8960, False), (151936, 1536, False), (1000, 2304, False)])
def test_gpu_one_row_at_real_shapes(n, k, silu):
    """Compiled (inline PTX), the 1.5B's qkv, o, gate_up, down and LM head shapes and an odd one: within
    one ulp of the exact dot, through gguf_linear's own dispatch."""
    w = gm.random_weight(Q4, 2 * n if silu else n, k, seed=n, device="cuda")
    x = bf16(1, k, seed=k, device="cuda")
    assert gm.linear_plan(1, n, k, Q4, ON)[1].get("ONE_ROW") == 1
    within_one_ulp(gm.gguf_linear(x, w, silu_mul=silu, options=ON), exact(x, w, None, silu))
