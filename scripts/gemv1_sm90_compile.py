"""Compile kernels/gguf_gemv.py's one-row GEMVs for sm_90a without a GPU: registers, spills, SASS counts.

Triton's bundled ptxas and cuobjdump assemble and list the kernel, so a CPU machine sees before a lease whether
a tile compiles, what it costs in registers (a program's rows must fit without spilling), and how many
instructions of each kind it issues per weight element (loads, integer ops, FMAs). Not a speed measurement.
usage: PYTHONPATH=$PWD python3 scripts/gemv1_sm90_compile.py [--shapes qkv,o,gate_up,down,lm_head] [--sass]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from verispec.kernels import gguf_gemv as gg

SHAPES = {"qkv": (2048, 1536, False), "o": (1536, 1536, False), "gate_up": (8960, 1536, True),
          "down": (1536, 8960, False), "lm_head": (151936, 1536, False)}
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_one(qtype: str, n: int, k: int, silu: bool, cfg: dict, sass: bool = False) -> dict:
    """ptxas's verdict on one config: regs, spill bytes, and (sass) the SASS opcode counts per weight element."""
    cfg = dict(cfg)
    warps = cfg.pop("num_warps")
    res = bool(cfg.pop("RES", 0)) or qtype == "Q6_K"
    if res:
        sb, sb1 = gg.resident_tiles(k)
        cfg.update(SB=sb, SB1=sb1, EVEN=n % cfg["BLOCK_N"] == 0, EVEN1=sb + sb1 == k // 256)
    else:
        cfg["EVEN"] = (k // 256) % cfg["SB"] == 0 and n % cfg["BLOCK_N"] == 0
    kern = gg.q6k_gemv1_kernel if qtype == "Q6_K" else gg.q4k_gemv1_kernel
    w = "*i16" if qtype == "Q6_K" else "*i32"
    sig = {"x64_ptr": "*i64", ("i16_ptr" if qtype == "Q6_K" else "w32_ptr"): w}
    if qtype == "Q6_K":
        sig["u8_ptr"] = "*u8"
    sig.update({"b_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32"})
    const = dict(K=k, HAS_BIAS=False, SILU_MUL=silu, PDL=True, **cfg)
    const["ASM"] = True
    if qtype != "Q6_K":
        const["RES"] = res
    sig.update({name: "constexpr" for name in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kern.arg_names) if name.endswith("_ptr")}
    ck = triton.compile(ASTSource(kern, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=warps))
    with tempfile.TemporaryDirectory() as tmp:
        path, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(path, "w") as fh:
            fh.write(ck.asm["ptx"])
        r = subprocess.run([os.path.join(_BIN, "ptxas"), "-v", "--gpu-name", "sm_90a", path, "-o", cubin],
                           capture_output=True, text=True, check=True)
        out = dict(regs=_num(r"Used (\d+) registers", r.stderr), spill=_num(r"(\d+) bytes spill stores", r.stderr))
        if sass:
            dump = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-sass", cubin], capture_output=True,
                                  text=True, check=True).stdout
            ops = collections.Counter(m.group(1).split(".")[0] for m in
                                      re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?P\d\s+)?([A-Z][A-Z0-9.]*)", dump))
            elems = k * cfg["BLOCK_N"] * (2 if silu else 1) / (32 * warps)  # weight elements a thread
            out["instr_per_elem"] = round(sum(ops.values()) / elems, 2)
            out["top"] = {op: round(c / elems, 2) for op, c in ops.most_common(8)}
    return out


def _num(pat: str, text: str) -> int:
    m = re.search(pat, text)
    return int(m.group(1)) if m else -1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sass", action="store_true", help="count SASS instructions a weight element")
    args = ap.parse_args()
    for name in args.shapes.split(","):
        n, k, silu = SHAPES[name]
        cases = [("Q4_K", gg.q4k_gemv1_config(n * (2 if silu else 1), k)),
                 ("Q4_K", gg.q4k_gemv1_config(n, k, resident=True)),
                 ("Q6_K", gg.q6k_gemv1_config(n, k))]
        cases += [("Q4_K", dict(RES=1, BLOCK_N=bn, num_warps=w)) for bn, w in [(1, 1), (4, 4), (8, 4)]]
        cases += [("Q6_K", dict(BLOCK_N=bn, num_warps=w)) for bn, w in [(1, 1), (1, 2), (4, 4)]]
        for qt, cfg in cases:
            try:
                r = compile_one(qt, n, k, silu, cfg, args.sass)
            except Exception as e:  # noqa: BLE001 - report a config that does not compile, go on
                r = f"{type(e).__name__}: {str(e)[:200]}"
            print(f"{name:>8} {n}x{k} silu={int(silu)} {qt} {cfg}: {r}", flush=True)


if __name__ == "__main__":
    main()
