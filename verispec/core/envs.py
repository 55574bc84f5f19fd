"""Every environment variable verispec reads, declared and parsed here and nowhere else.

Each is read when its function is called; engines call them once, when they are built, so
nothing on the hot path looks at os.environ. Kernel tuning is not set here: it is an options
object (verispec/core/options.py) that scripts build variants of. verispec never sets an
environment variable itself (tests/conftest.py sets TRITON_INTERPRET for the CPU kernel tests).
"""

from __future__ import annotations

import os
from pathlib import Path


def fault() -> str | None:
    """VERISPEC_FAULT=<name>: plant one known bug (test-only; see verispec/core/faults.py)."""
    return os.environ.get("VERISPEC_FAULT") or None


def debug_stale() -> bool:
    """VERISPEC_DEBUG_STALE=1: a read of a stale host mirror raises StaleMirrorError."""
    return os.environ.get("VERISPEC_DEBUG_STALE") == "1"


def cache_dir() -> Path:
    """VERISPEC_CACHE_DIR: models and dequantized caches (default ~/.cache/verispec)."""
    return Path(os.environ.get("VERISPEC_CACHE_DIR") or os.path.join("~", ".cache", "verispec")).expanduser()


def stage_cache_dir() -> Path:
    """VERISPEC_STAGE_CACHE: where `pull` downloads wheels before it verifies them."""
    return Path(os.environ.get("VERISPEC_STAGE_CACHE") or "~/.cache/verispec-stage").expanduser()


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton's own switch to run kernels in its CPU interpreter (tests only;
    tests/conftest.py sets it before triton is imported). Triton reads it when a kernel module is
    imported, so the kernel modules read it then too (the interpreter-friendly loop, no inline PTX)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cpu_gguf_kernel() -> bool:
    """VERISPEC_CPU_GGUF=0: the CPU GGUF-block C kernel off (the int4 planes instead; an A/B switch)."""
    return os.environ.get("VERISPEC_CPU_GGUF", "1") != "0"


def cpu_gguf_int8() -> bool:
    """VERISPEC_CPU_GGUF_INT8=0: one-row CPU GEMVs of Q8_0 / Q5_0 / Q4_0 / Q6_K blocks in float32 (the exact
    arithmetic of the float32 reference) instead of the integer dot with x rounded to int8, and Q4_K weights as
    int4 planes instead of blocks through the integer dot (an A/B switch, read when a model loads)."""
    return os.environ.get("VERISPEC_CPU_GGUF_INT8", "1") != "0"


def cpu_ops() -> bool:
    """VERISPEC_CPU_OPS=0: a quantized CPU model keeps torch's norms, rotary and attention instead of
    kernels/cpu_ops.py's C ops, and one kernel call per weight segment (an A/B switch, read when a model loads)."""
    return os.environ.get("VERISPEC_CPU_OPS", "1") != "0"


def c_compiler() -> str | None:
    """CC: the C compiler that builds the CPU GGUF kernel (default: cc or gcc on PATH)."""
    return os.environ.get("CC") or None
