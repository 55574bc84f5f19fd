"""Matmuls over GGUF blocks as stored, on the CPU: a small C kernel (cpu_gguf.c) built once with the
system C compiler and called through ctypes.

Up to MAX_ROWS rows of x (decode, verify) run cpu_gguf.c's GEMV: it streams each weight row's blocks once,
dequantizes them exactly as loader/dequant.py does and sums in float32 (AVX-512 where the CPU has it, else AVX2 + FMA), so
the result is the float32 reference's up to summation order, reading the file's bytes only; more rows dequantize the
weight to float32 in the kernel and run torch's GEMM. Any number of rows of a Q8_0, Q5_0, Q4_0, Q4_K or Q6_K weight
may instead take the integer-dot GEMV (linear(int8=True), the loader's default, prompt chunks included): x rounded
to int8 per 32 elements, as llama.cpp, not the reference's arithmetic, each weight block unpacked once for up to
MAX_ROWS rows (in register-resident groups of a few), and each row's result the same bits at every row count (so a
decode, a verify, a batch and a prompt chunk agree). At 48 / 128 / 512 rows it is 1.9x / 1.3x / 1.35x faster than
the dequantize + GEMM route on a 2-core AVX-512 EPYC (BENCHMARKS "Session 30, CPU"). The library is built with
`cc -O3 -march=native -fopenmp` into `<cache>/kernels/` keyed by the source, the compiler and the CPU; no
compiler, a failed build or a wrong answer on the start-up check make available() False (the caller
keeps the int4 path). VERISPEC_CPU_GGUF=0 turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from verispec.core import envs
from verispec.core.envs import cache_dir

log = logging.getLogger("verispec")

_SOURCE = Path(__file__).with_name("cpu_gguf.c")
# Built into the same library: the decode step's small float32 ops (kernels/cpu_ops.py calls them).
_SOURCES = (_SOURCE, Path(__file__).with_name("cpu_ops.c"))
MAX_ROWS = 16  # cpu_gguf.c's MAX_M: more rows take the dequantize + GEMM route (the integer dot: any row count)
_GEMM_SLICE_ELEMS = 1 << 22  # that route dequantizes this many weight elements at a time (16 MB of float32)
# ggml type id -> (elements, bytes) per block, for the types cpu_gguf.c runs.
BLOCKS: dict[int, tuple[int, int]] = {2: (32, 18), 6: (32, 22), 8: (32, 34), 12: (256, 144), 14: (256, 210)}
GEMV_TYPES = frozenset({2, 6, 8, 14})  # what the loader runs here (Q4_K's float GEMV is 1.6x slower than int4)
INT8_TYPES = frozenset({2, 6, 8, 12, 14})  # Q4_0, Q5_0, Q8_0, Q4_K, Q6_K: the integer-dot GEMV (linear(int8=True))


@dataclass(frozen=True)
class CPUBlocks:
    """An N x K weight as its GGUF blocks: uint8 [N, K / elements * bytes] (the file's bytes, row by row)."""

    blocks: torch.Tensor
    qtype: int
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.qtype not in BLOCKS:
            raise ValueError(f"CPUBlocks: ggml type {self.qtype} has no CPU kernel (types: {sorted(BLOCKS)})")
        elems, nbytes = BLOCKS[self.qtype]
        if k % elems:
            raise ValueError(f"CPUBlocks: K = {k} is not a multiple of the type's {elems}-element blocks")
        want = (n, k // elems * nbytes)
        b = self.blocks
        if b.dtype != torch.uint8 or tuple(b.shape) != want or not b.is_contiguous() or b.device.type != "cpu":
            raise ValueError(f"CPUBlocks: blocks must be contiguous CPU uint8 {want}, got {b.dtype} "
                             f"{tuple(b.shape)} on {b.device}")


def _cc() -> str | None:
    return envs.c_compiler() or shutil.which("cc") or shutil.which("gcc")


def _cpu_key() -> str:
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return flags + platform.machine()


def _build(cc: str, flags: tuple[str, ...] = ()) -> Path:
    """The built library (cached by source, compiler, CPU and extra flags): compiled to a temp file, then renamed."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"".join(src.read_bytes() for src in _SOURCES) + version.encode() + _cpu_key().encode()
                         + " ".join(flags).encode()).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"cpu_gguf-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:  # -ffp-contract=off: scale * q + bias rounds as dequant.py's two float32 ops
        cmd = [cc, "-O3", "-march=native", *flags, "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC",
               *map(str, _SOURCES), "-o", tmp, "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()[:500]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (logged) when it cannot be built or is turned off."""
    if not envs.cpu_gguf_kernel():
        return None
    cc = _cc()
    if cc is None:
        log.info("no C compiler (cc, gcc or $CC): the CPU GGUF kernel is off")
        return None
    try:
        return _load(_build(cc))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.info("the CPU GGUF kernel did not build (%s): it is off", e)
        return None


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.vs_gemv.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr, i64, ctypes.c_int]
    lib.vs_dequant.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ctypes.c_int]
    lib.vs_gemv_int8.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, i64, ctypes.c_int]
    f32 = ctypes.c_float
    lib.vs_rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, f32, ptr, ptr]
    lib.vs_silu_mul.argtypes = [ptr, i64, i64, ptr]
    lib.vs_rope_write_kv.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, i64, ptr, i64,
                                     ptr, ptr]
    lib.vs_paged_attention.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, ptr, ptr, i64, ptr, i64, i64, ptr,
                                       ctypes.c_int, i64, f32, ptr, ctypes.c_int]
    for f in (lib.vs_gemv, lib.vs_dequant, lib.vs_avx512, lib.vs_simd_bits, lib.vs_gemv_int8, lib.vs_int8,
              lib.vs_int8_route, lib.vs_rms_norm, lib.vs_silu_mul, lib.vs_rope_write_kv, lib.vs_paged_attention):
        f.restype = ctypes.c_int
    return lib


def variant(flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """The library built with extra compiler flags after -march=native (tests: a narrower SIMD route on a wider
    CPU, e.g. ("-mno-avx512vnni",)), or None where it does not build. Not what the loader runs."""
    cc = _cc()
    if cc is None:
        return None
    try:
        return _load(_build(cc, flags))
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return None


def int8_route(lib: ctypes.CDLL | None = None) -> int:
    """The integer dot's route for the 32-element types in lib (default: the loader's library): 512 (AVX512-VNNI,
    two blocks per step), 256 (VNNI on 8 lanes), 1 (AVX2 maddubs), 0 (none)."""
    lib = lib if lib is not None else library()
    return int(lib.vs_int8_route()) if lib is not None else 0


def gemv_int8(lib: ctypes.CDLL, x: torch.Tensor, w: CPUBlocks) -> torch.Tensor:
    """x [m, K] float32 through lib's integer-dot GEMV (any m >= 1, every INT8_TYPES type): what
    linear(int8=True) calls, on a given library."""
    n, k = w.shape
    x2 = x.reshape(-1, k).to(torch.float32).contiguous()
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    if lib.vs_gemv_int8(w.qtype, w.blocks.data_ptr(), n, k, x2.data_ptr(), x2.shape[0], y.data_ptr(), n,
                        torch.get_num_threads()) != 0:
        raise ValueError(f"cpu_gguf.gemv_int8: the kernel refused type {w.qtype}, shape {w.shape}, {x2.shape[0]} rows")
    return y


def dequantize(w: CPUBlocks) -> torch.Tensor:
    """The float32 [N, K] weight (the values loader/dequant.py gives, bit for bit)."""
    lib = _lib()
    n, k = w.shape
    out = torch.empty(n, k, dtype=torch.float32)
    if lib.vs_dequant(w.qtype, w.blocks.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads()) != 0:
        raise ValueError(f"cpu_gguf.dequantize: the kernel refused type {w.qtype}, shape {w.shape}")
    return out


def linear(x: torch.Tensor, w: CPUBlocks, int8: bool = False) -> torch.Tensor:
    """x [..., K] -> [..., N] float32 (x is cast to float32): the GEMV for up to MAX_ROWS rows, else
    dequantize + F.linear. int8: every row count of an INT8_TYPES weight takes the integer-dot GEMV where it
    is built (int8_available()): x rounded to int8 per 32 elements, as llama.cpp's, each row's result
    independent of the row count."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"cpu_gguf.linear: x has {x.shape[-1]} features, the weight {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).to(torch.float32).contiguous()
    m = x2.shape[0]
    if int8 and m and w.qtype in INT8_TYPES and int8_available():
        return gemv_int8(_lib(), x2, w).reshape(*lead, n)
    if m > MAX_ROWS:  # weight rows dequantized a slice at a time (the LM head whole would be 545 MB)
        step = max(64, _GEMM_SLICE_ELEMS // k)
        parts = [F.linear(x2, dequantize(_rows(w, r0, min(n, r0 + step)))) for r0 in range(0, n, step)]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).reshape(*lead, n)
    y = torch.empty(m, n, dtype=torch.float32)
    if m and _lib().vs_gemv(w.qtype, w.blocks.data_ptr(), n, k, x2.data_ptr(), m, k, y.data_ptr(), n,
                            torch.get_num_threads()) != 0:
        raise ValueError(f"cpu_gguf.linear: the kernel refused type {w.qtype}, shape {w.shape}, {m} rows")
    return y.reshape(*lead, n)


def _rows(w: CPUBlocks, r0: int, r1: int) -> CPUBlocks:
    """Rows [r0, r1) of a weight (a view of its blocks)."""
    return w if (r0, r1) == (0, w.shape[0]) else CPUBlocks(w.blocks[r0:r1], w.qtype, (r1 - r0, w.shape[1]))


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("the CPU GGUF kernel is not available (cpu_gguf.available() is False)")
    return lib


def simd_bits() -> int:
    """The vector width the GEMVs were built for: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (plain C)."""
    return int(_lib().vs_simd_bits()) if available() else 0


@functools.cache
def int8_available() -> bool:
    """Whether the integer-dot GEMV is built (AVX2 + FMA: the CPU has them, AVX-512 ones included)."""
    return available() and bool(_lib().vs_int8())


def fast() -> bool:
    """Whether the GEMVs of GEMV_TYPES are vectorized, AVX-512 or AVX2 (the plain C loop is slower than the
    int4 path, so without either the loader keeps that)."""
    return simd_bits() > 0


@functools.cache
def available() -> bool:
    """Whether the kernel built and matches the float32 reference on a small random weight of each type."""
    if library() is None:
        return False
    from verispec.loader.dequant import dequantize as ref_dequantize

    g = torch.Generator().manual_seed(0)
    for t, (elems, nbytes) in BLOCKS.items():
        n, k = 5, 2 * elems
        raw = torch.randint(0, 256, (n, k // elems, nbytes), generator=g, dtype=torch.uint8)
        raw[..., :2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)  # d = 1.0 (random bytes can be inf / nan)
        if t == 12:
            raw[..., 2:4] = torch.tensor([0x00, 0x38], dtype=torch.uint8)  # dmin = 0.5
        if t == 14:
            raw[..., 208:210] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)
        w = CPUBlocks(raw.reshape(n, -1).contiguous(), t, (n, k))
        ref = ref_dequantize(w.blocks.reshape(-1), t, (n, k))
        x = torch.randn(3, k, generator=g)
        if not torch.equal(dequantize(w), ref) or not torch.allclose(linear(x, w), x @ ref.t(), rtol=1e-4,
                                                                      atol=1e-3):
            log.info("the CPU GGUF kernel gave wrong results on its check (type %d): it is off", t)
            return False
    return True


class StackedLinear:
    """A CPU QuantLinear's GGUF-block segments (stacked along N) as one kernel call each, written straight into
    their columns of one [m, N] float32 output: what QuantLinear.forward runs for up to max_rows rows (any count
    where every segment takes the integer dot, else MAX_ROWS), in place of linear() per segment and a
    concatenation (a decode step makes ~100 such calls, and each op costs microseconds). The same kernels as
    linear(int8=...) per segment, so the same results."""

    def __init__(self, weights: list[CPUBlocks], int8: list[bool]) -> None:
        if not weights or len(int8) != len(weights) or len({w.shape[1] for w in weights}) != 1:
            raise ValueError("StackedLinear needs one int8 flag per weight and weights of one in_features")
        self.weights = weights  # held: the kernels read their blocks through raw pointers
        self.k = weights[0].shape[1]
        self.n = sum(w.shape[0] for w in weights)
        off, self._parts = 0, []
        for w, i8 in zip(weights, int8, strict=True):
            self._parts.append((w.qtype, w.blocks.data_ptr(), w.shape[0], i8 and w.qtype in INT8_TYPES, off))
            off += w.shape[0]
        self.max_rows = sys.maxsize if all(p[3] for p in self._parts) else MAX_ROWS  # (the float GEMV: MAX_ROWS)
        self._lib = _lib()

    def __call__(self, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        """x [m, K] float32, 1 <= m <= max_rows -> [m, N] float32 (silu_mul: [m, N / 2] = silu(gate) * up)."""
        m = x.shape[0]
        if x.dim() != 2 or x.shape[1] != self.k or x.dtype != torch.float32 or not 1 <= m <= self.max_rows:
            raise ValueError(f"StackedLinear: x must be float32 [1..{self.max_rows}, {self.k}], got {x.dtype} "
                             f"{tuple(x.shape)}")
        x = x if x.is_contiguous() else x.contiguous()
        y = torch.empty(m, self.n, dtype=torch.float32)
        lib, xp, yp, k, n, th = self._lib, x.data_ptr(), y.data_ptr(), self.k, self.n, torch.get_num_threads()
        for qtype, wp, rows, int8, off in self._parts:
            if int8:
                rc = lib.vs_gemv_int8(qtype, wp, rows, k, xp, m, yp + 4 * off, n, th)
            else:
                rc = lib.vs_gemv(qtype, wp, rows, k, xp, m, k, yp + 4 * off, n, th)
            if rc != 0:
                raise ValueError(f"cpu_gguf.StackedLinear: the kernel refused type {qtype}, {rows} x {k}, {m} rows")
        if not silu_mul:
            return y
        out = torch.empty(m, n // 2, dtype=torch.float32)
        if n % 2 or lib.vs_silu_mul(yp, m, n // 2, out.data_ptr()) != 0:
            raise ValueError(f"cpu_gguf.StackedLinear: silu_mul needs an even N, got {n}")
        return out
