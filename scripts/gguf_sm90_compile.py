"""Compile the GGUF super-block kernel (kernels/gguf_matmul.py's _mma_sb_kernel) for sm_90a without a GPU.

Triton's own ptxas (bundled with the wheel) assembles the PTX, so a CPU machine can check that a config
compiles for the H200 and see what it costs before a lease: registers per thread, spill bytes, shared memory
(a config needing > 227 KB cannot launch), and whether the dot became wgmma. Not a speed measurement.
usage: PYTHONPATH=$PWD python3 scripts/gguf_sm90_compile.py [--qtypes Q4_K,Q6_K] [--k 1536]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from verispec.kernels import gguf_matmul as gm

_PTR = ("x_ptr", "w_ptr", "h_ptr", "i_ptr", "b_ptr", "out_ptr", "ws_ptr", "stride_xm", "stride_om")


def compile_sb(qtype: int, cfg: dict, k: int, silu: bool = False, bias: bool = False) -> dict:
    """ptxas's verdict on one config (mma_config's keys) of a [*, k] weight: regs, spills, shared, wgmma."""
    kern = gm._mma_sb_kernel
    nb, split = k // 256, cfg.get("SPLIT_K", 1)
    sbs, split = gm.splitk_split(nb, 1, split)
    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "h_ptr": "*fp16", "i_ptr": "*i32" if qtype == gm.T.Q4_K else "*u8",
           "b_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32" if split > 1 else "*bf16", "M": "i32",
           "N": "i32", "stride_xm": "i32", "stride_om": "i32"}
    const = dict(NB=nb, SBS=sbs, QTYPE=qtype, HAS_BIAS=bias, SILU_MUL=silu, SPLIT_K=split,
                 BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], SWAP=cfg.get("SWAP", 1), PARTS=cfg.get("PARTS", 1),
                 PREFETCH=cfg.get("PREFETCH", 0), DOT_PREC="tf32", PDL=True)
    sig.update({name: "constexpr" for name in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kern.arg_names) if name in _PTR}
    ck = triton.compile(ASTSource(kern, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    ptx = ck.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as fh:
            fh.write(ptx)
        r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", os.path.join(tmp, "k.cubin")],
                           capture_output=True, text=True, check=True)
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, r.stderr)) else -1  # noqa: E731
    return dict(regs=num(r"Used (\d+) registers"), spill=num(r"(\d+) bytes spill stores"),
                shared=ck.metadata.shared, wgmma="wgmma.mma_async" in ptx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qtypes", default="Q4_K,Q6_K")
    ap.add_argument("--k", type=int, default=1536)
    args = ap.parse_args()
    for name in args.qtypes.split(","):
        qt = int(gm.T[name])
        for m, n, silu in [(64, 8960, True), (256, 8960, True), (64, 1536, False), (256, 151936, False)]:
            cfg = gm.mma_config(m, n, args.k, qt)
            r = compile_sb(qt, cfg, args.k, silu=silu)
            print(f"{name} M={m:<3} N={n:<6} silu={int(silu)} {r} {cfg}", flush=True)


if __name__ == "__main__":
    main()
