"""Where the acceptance gates run: every parity, oracle, counter and fault gate takes a `target`.

  * "cpu": the tiny random models on the CPU in float32 (the torch path), as the gates always ran;
  * "cuda": the real qwen2.5-coder-0.5b-instruct on CUDA in float32 with CUDA graphs and the Triton
    kernels on: the production path with only the dtype changed (in bf16 a request's tokens depend
    on the batch shape; in float32 they do not, measured on the H200, issue 18). Marked `gpu` (skipped
    without CUDA) and `gpu_gate`: `pytest --gate-device cpu` runs these cells on the CPU instead (the
    real model on the torch path: a dry run of the GPU cells' plumbing and thresholds, slow).
    `pytest --gate-dtype bfloat16` runs them in the production dtype, every engine on the gate model
    with batch_invariant=True (CUDA; the cells' id is then cuda-bf16): the exact checks stay exact.

A gate module parametrizes its module-scoped `target` fixture over TARGETS (CUDA_ONLY for a GPU-only
gate, as direct parametrization with scope="module") and asks gate_model() for its model (the real
model is loaded once per session: conftest.py's qwen05_gate)."""

from __future__ import annotations

import dataclasses

import pytest

from verispec.models.qwen2 import CausalLM, build_model

GPU_GATE = [pytest.mark.gpu, pytest.mark.gpu_gate]
GATE_DTYPES = {"float32": "f32", "bfloat16": "bf16"}  # --gate-dtype -> the id suffix of the CUDA cells
GATE_DTYPE = "float32"
TARGETS = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda-f32", marks=GPU_GATE)]
CUDA_ONLY = [pytest.param("cuda", id="cuda-f32", marks=GPU_GATE)]


def configure(dtype: str) -> None:
    """Set the gate model's dtype (conftest.pytest_configure, from --gate-dtype), and with it the CUDA
    cells' id (cuda-f32 / cuda-bf16), before any test module imports TARGETS or CUDA_ONLY."""
    global GATE_DTYPE, TARGETS, CUDA_ONLY
    if dtype not in GATE_DTYPES:
        raise ValueError(f"gate dtype must be one of {list(GATE_DTYPES)}, got {dtype!r}")
    GATE_DTYPE = dtype
    cuda = pytest.param("cuda", id=f"cuda-{GATE_DTYPES[dtype]}", marks=GPU_GATE)
    TARGETS = [pytest.param("cpu", id="cpu"), cuda]
    CUDA_ONLY = [cuda]


def engine_defaults(device) -> dict:
    """EngineConfig fields every engine on the gate model gets (tests/tiny.py reads them from the model's
    engine_defaults): batch_invariant=True for bf16 on CUDA, where without it a request's tokens depend on
    the step's shape; nothing in float32, nor on the CPU, whose torch path has no invariant mode (a
    --gate-device cpu run in bf16 is a plumbing dry run, its exact checks may fail there)."""
    import torch

    return {"batch_invariant": True} if GATE_DTYPE == "bfloat16" and torch.device(device).type == "cuda" else {}


def gate_model(target: str, request: pytest.FixtureRequest, cpu_model) -> CausalLM:
    """The target's model: cpu_model() (a tiny one) on "cpu", the session's real 0.5B on "cuda"."""
    if target == "cpu":
        return cpu_model()
    return request.getfixturevalue("qwen05_gate")[2]


def layer_skip_draft(model: CausalLM, num_layers: int | None = None) -> CausalLM:
    """A draft model for the real target: its first num_layers decoder layers (default: 5/6 of them),
    then its own final norm and LM head, sharing the target's weights (no copy). Its drafts are
    sometimes right and often wrong, which the audit and counter gates need (the target itself accepts
    everything; with half the layers it accepted 1 of 189 drafts on the scenario's random-id prompts)."""
    cfg = model.config
    keep = num_layers or cfg.num_layers * 5 // 6
    sd = {n: p for n, p in model.named_parameters()
          if not n.startswith("model.layers.") or int(n.split(".")[2]) < keep}
    p = next(model.parameters())
    return build_model(dataclasses.replace(cfg, num_layers=keep), sd, p.device, p.dtype)

