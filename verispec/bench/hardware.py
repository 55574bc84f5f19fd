"""The target GPU's limits, and how much of them a measured run used (the one place for these figures).

Two limits bound a decode step: reading the weights and the KV cache from memory (small batches), and the
matmul FLOPs (large batches, prefill). A run's `hw_frac` is the larger of the two fractions, so 1.0 means the
hardware was saturated by whichever resource bound it; `hw_bound` names it ("mem" or "flop").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from verispec.config import ModelConfig

GPU_NAME = "NVIDIA H200"
HBM_BYTES_PER_S = 4.3e12  # measured device-to-device copy on the H200 (shared/device/README.md)
BF16_FLOPS_PER_S = 790e12  # measured bf16 dense matmul on the H200


@dataclass(frozen=True)
class StepRecord:
    """One engine step as the bench saw it."""

    seconds: float
    num_seqs: int  # sequences touched by the step
    context_tokens: int  # sum over those sequences of their length after the step (KV entries read)
    new_tokens: int  # output tokens the step emitted
    prefill: bool  # some sequence emitted its first token in this step
    draft_tokens: int = 0  # drafts verified by the steps whose counts the engine committed during this step()
    accepted: int = 0  # ... of which accepted
    planned_k: int = 0  # the policy's k for the step planned during this step() (engine.planned_k)
    # how the steps launched since the last record ran ("graph", "split": two replays, "eager"; comma-joined where
    # several: an overlapped loop's admission step emits nothing and is carried into the next record), and their tokens
    launch: str = ""
    launched_tokens: int = 0


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters a forward pass multiplies with per token: every linear layer plus the LM head.

    The input embedding is a row gather, not a matmul, so it is left out (nor is it read whole)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    return cfg.num_layers * per_layer + cfg.vocab_size * h


def weight_bytes_per_step(cfg: ModelConfig, elem_bytes: int) -> int:
    """Bytes of weights one decode step must read: all matmul weights, biases and norms (no embedding)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    small = cfg.num_layers * (2 * h + ((q + 2 * kv) if cfg.qkv_bias else 0)) + h
    return (matmul_params(cfg) + small) * elem_bytes


def kv_bytes_per_token(cfg: ModelConfig, elem_bytes: int) -> int:
    """Bytes of K and V one cached token holds, over all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem_bytes


def attention_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Causal attention FLOPs (QK^T and PV) to process a sequence of `seq_len` tokens."""
    return 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len * (seq_len + 1) / 2


def useful_flops(cfg: ModelConfig, seq_lens: Iterable[tuple[int, int]]) -> float:
    """FLOPs to compute every (prompt_len, output_len) sequence once: 2 * params * tokens + attention."""
    total = 0.0
    p = matmul_params(cfg)
    for prompt, out in seq_lens:
        n = prompt + out
        total += 2.0 * p * n + attention_flops(cfg, n)
    return total


def hardware_use(
    cfg: ModelConfig, elem_bytes: int, steps: list[StepRecord], seconds: float, flops: float,
    weight_bytes: int | None = None,
) -> dict[str, float | str]:
    """Fractions of the memory-bandwidth and FLOP limits used over `seconds` by these steps (see
    hardware_totals)."""
    return hardware_totals(cfg, elem_bytes, len(steps), sum(s.context_tokens for s in steps), seconds, flops,
                           weight_bytes)


def hardware_totals(
    cfg: ModelConfig, elem_bytes: int, num_steps: int, context_tokens: int, seconds: float, flops: float,
    weight_bytes: int | None = None,
) -> dict[str, float | str]:
    """Fractions of the memory-bandwidth and FLOP limits used over `seconds`.

    mem_frac: (weights once per step + `context_tokens` KV entries read) / seconds / HBM_BYTES_PER_S;
    flop_frac: flops / seconds / BF16_FLOPS_PER_S. weight_bytes: what a step reads of the weights as the
    model holds them (quantized weights: models/layers/quant.step_weight_nbytes); None: every matmul
    weight in elem_bytes."""
    if seconds <= 0:
        return {"mem_frac": 0.0, "flop_frac": 0.0, "hw_frac": 0.0, "hw_bound": "mem"}
    w = weight_bytes_per_step(cfg, elem_bytes) if weight_bytes is None else weight_bytes
    kvb = kv_bytes_per_token(cfg, elem_bytes)
    moved = num_steps * w + context_tokens * kvb
    mem = moved / seconds / HBM_BYTES_PER_S
    flop = flops / seconds / BF16_FLOPS_PER_S
    return {"mem_frac": mem, "flop_frac": flop, "hw_frac": max(mem, flop), "hw_bound": "mem" if mem >= flop else "flop"}


def step_flops(cfg: ModelConfig, steps: list[StepRecord]) -> float:
    """FLOPs of decode steps: 2 * params per emitted token, plus each sequence's new tokens attending its
    context (counted once per sequence-step; drafts that were rejected are not counted)."""
    p = matmul_params(cfg)
    per_ctx = 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    return sum(2.0 * p * s.new_tokens + per_ctx * s.context_tokens * s.new_tokens / max(s.num_seqs, 1)
               for s in steps)


def decode_steps(batch: int, prompt_len: int, output_len: int, step_s: float) -> list[StepRecord]:
    """Steps of a plain (no speculation) batched decode, for peers whose steps we cannot see."""
    return [StepRecord(step_s, batch, batch * (prompt_len + i + 1), batch, False) for i in range(1, output_len)]


HARDWARE = {"gpu": GPU_NAME, "hbm_bytes_per_s": HBM_BYTES_PER_S, "bf16_flops_per_s": BF16_FLOPS_PER_S}
