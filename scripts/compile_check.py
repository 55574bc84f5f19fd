"""Compile the small-M kernels (kernels/small_m.py, small_m_qkv.py) for the H200 (sm_90) without a GPU.

Triton's wheel carries ptxas, so a kernel can be compiled to a cubin with no driver: this catches the
errors the CPU interpreter cannot see (layouts, tl.dot shapes, shared memory) before the one GPU shot,
and prints each config's shared memory, registers per thread and spill stack (cuobjdump -res-usage), the
figures small_m_config's tiles were chosen by. Every layer shape of the given models, with the tiles
small_m_config picks (and the qkv + rotary kernel with its defaults), in bf16 with PDL on.

    python3 scripts/compile_check.py [--models qwen2.5-coder-1.5b-instruct,qwen2.5-coder-0.5b-instruct]
Exit status 1 if a kernel fails to compile or spills.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, not interpret
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from verispec.bench.models import shapes_for  # noqa: E402
from verispec.kernels import linear as lin  # noqa: E402
from verispec.kernels import small_m as sm  # noqa: E402
from verispec.kernels import small_m_qkv as smq  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
LINEAR_ARGS = ["x_ptr", "w_ptr", "b_ptr", "out_ptr", "ws_ptr", "nw_ptr", "r_ptr", "rout_ptr", "eps", "M", "N_OUT",
               "UP_OFFSET", "stride_xm", "stride_wn", "stride_om"]
QKV_ARGS = ["x_ptr", "w_ptr", "b_ptr", "pos_ptr", "cos_ptr", "sin_ptr", "slot_ptr", "q_ptr", "cache_ptr", "nw_ptr",
            "r_ptr", "rout_ptr", "eps", "M", "stride_xm", "stride_wn", "stride_qt", "stride_qh", "stride_c",
            "stride_cs", "stride_ch"]


def _type(name: str, out_f32: bool) -> str:
    """The Triton signature type of a kernel argument, by its name."""
    if name in ("ws_ptr", "cos_ptr", "sin_ptr") or (name == "out_ptr" and out_f32):
        return "*fp32"
    if name in ("pos_ptr", "slot_ptr"):
        return "*i64"
    if name.endswith("_ptr"):
        return "*bf16"
    return "fp32" if name == "eps" else "i32"


def compile_one(fn, args: list[str], const: dict, num_warps: int, num_stages: int, out_f32: bool = False) -> dict:
    """Compile fn for sm_90; returns its shared memory, registers and spill stack (bytes)."""
    sig = {a: _type(a, out_f32) for a in args} | {c: "constexpr" for c in const}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=TARGET,
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", res), re.search(r"STACK:(\d+)", res)
    return dict(shared=k.metadata.shared, regs=int(regs.group(1)) if regs else -1,
                stack=int(stack.group(1)) if stack else -1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen2.5-coder-1.5b-instruct,qwen2.5-coder-0.5b-instruct")
    args = ap.parse_args()
    bad = 0
    for model in args.models.split(","):
        cfg = shapes_for(model)
        h, inter = cfg.hidden_size, cfg.intermediate_size
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        layers = [("o", h, q, False, False), ("gate_up+norm", inter, h, True, True), ("down", h, inter, False, False),
                  ("lm_head", cfg.vocab_size, h, False, False)]
        for name, n_out, k, silu, norm in layers:
            c = sm.small_m_config(n_out, k, silu, norm)
            ks, split = lin.splitk_split(k, c["BLOCK_K"], c["SPLIT_K"])
            const = dict(K=k, KS=ks, HAS_BIAS=False, SILU_MUL=silu, NORM=norm, HAS_RES=norm, SPLIT_K=split,
                         BLOCK_M=sm.BLOCK_M, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], DOT_PREC="tf32", PDL=True)
            try:
                r = compile_one(sm._small_m_kernel, LINEAR_ARGS, const, c["num_warps"], c["num_stages"],
                                out_f32=name == "lm_head")
            except Exception as e:  # noqa: BLE001 - report every failing kernel, not only the first
                print(f"{model} {name}: FAILED to compile: {e}")
                bad += 1
                continue
            bad += r["stack"] != 0
            print(f"{model} {name:<13} N={n_out} K={k} tiles {c['BLOCK_N']}x{c['BLOCK_K']} split {split} "
                  f"warps {c['num_warps']}: shared {r['shared']} B, {r['regs']} regs, spill stack {r['stack']} B")
        const = dict(K=h, HALF=cfg.head_dim // 2, NUM_Q=cfg.num_heads, NUM_KV=cfg.num_kv_heads, BLOCK_M=sm.BLOCK_M,
                     BLOCK_P=smq.ROPE_PAIRS, BLOCK_K=smq.qkv_block_k(h), HAS_BIAS=cfg.qkv_bias,
                     NORM=True, HAS_RES=True, DOT_PREC="tf32", PDL=True)
        try:
            r = compile_one(smq._small_m_qkv_rope_kernel, QKV_ARGS, const, 8, 2)
        except Exception as e:  # noqa: BLE001
            print(f"{model} qkv_rope: FAILED to compile: {e}")
            bad += 1
            continue
        bad += r["stack"] != 0
        print(f"{model} qkv_rope+norm N={q + 2 * kv} K={h} tiles 16x{const['BLOCK_K']} warps 8: "
              f"shared {r['shared']} B, {r['regs']} regs, spill stack {r['stack']} B")
    # The other flag combinations the GPU tests launch (bias, split SiLU-and-mul, norm without residual, odd K).
    for name, k, silu, norm, res, bias, split in [("bias", 333, False, False, False, True, 1),
                                                  ("silu split", 1000, True, False, False, False, 4),
                                                  ("norm", 77, False, True, False, False, 1),
                                                  ("bias split", 530, False, False, False, True, 2)]:
        c = dict(BLOCK_N=16, BLOCK_K=256 if split > 1 else 128)
        ks, splits = lin.splitk_split(k, c["BLOCK_K"], split)
        const = dict(K=k, KS=ks, HAS_BIAS=bias, SILU_MUL=silu, NORM=norm, HAS_RES=res, SPLIT_K=splits,
                     BLOCK_M=sm.BLOCK_M, DOT_PREC="tf32", PDL=True, **c)
        try:
            r = compile_one(sm._small_m_kernel, LINEAR_ARGS, const, 4, 3)
            print(f"test flags {name:<11} K={k} split {splits}: shared {r['shared']} B, {r['regs']} regs, "
                  f"spill stack {r['stack']} B")
        except Exception as e:  # noqa: BLE001
            print(f"test flags {name}: FAILED to compile: {e}")
            bad += 1
    print("OK" if not bad else f"{bad} kernel(s) failed or spilled")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
