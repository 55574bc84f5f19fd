"""Where the acceptance gates run: every parity, oracle, counter and fault gate takes a `target`.

  * "cpu": the tiny random models on the CPU in float32 (the torch path), as the gates always ran;
  * "cuda": the real qwen2.5-coder-0.5b-instruct on CUDA in float32 with CUDA graphs and the Triton
    kernels on: the production path with only the dtype changed (in bf16 a request's tokens depend
    on the batch shape; in float32 they do not, measured on the H200, issue 18). Marked `gpu` (skipped
    without CUDA) and `gpu_gate`: `pytest --gate-device cpu` runs these cells on the CPU instead (the
    real model on the torch path: a dry run of the GPU cells' plumbing and thresholds, slow).

A gate module parametrizes its module-scoped `target` fixture over TARGETS (CUDA_ONLY for a GPU-only
gate, as direct parametrization with scope="module") and asks gate_model() for its model (the real
model is loaded once per session: conftest.py's qwen05_gate)."""

from __future__ import annotations

import dataclasses

import pytest

from verispec.models.qwen2 import CausalLM, build_model

GPU_GATE = [pytest.mark.gpu, pytest.mark.gpu_gate]
TARGETS = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda-f32", marks=GPU_GATE)]
CUDA_ONLY = [pytest.param("cuda", id="cuda-f32", marks=GPU_GATE)]


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

