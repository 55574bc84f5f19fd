"""Megatron-style sharding of a loaded model for one tensor-parallel rank, and the size checks.

Rank r of N keeps: its num_heads / N query heads and num_kv_heads / N KV heads of qkv_proj (column-
parallel, bias included) and the matching input columns of o_proj (row-parallel); its
intermediate_size / N rows of gate and of up (column-parallel) and the matching columns of down_proj
(row-parallel); rows [r * ceil(V / N), ...) of the embedding and of the LM head (vocabulary-parallel,
the last shard zero-padded to the common size). Norms and the rotary tables are replicated. Each
row-parallel projection is followed by one all-reduce (models/qwen2.py); the model's config keeps the
full sizes (the engine's books, the vocabulary checks and the KV sizing read it).
"""

from __future__ import annotations

import torch
from torch import nn

from verispec.config import ModelConfig
from verispec.core.parallel import TensorParallel
from verispec.models.qwen2 import MLP, Attention, CausalLM

# Architectures whose layers are the Qwen2 ones (Gemma 3's own MLP and norms are not sharded yet).
SHARDABLE = ("qwen2", "llama", "qwen3")


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """Raise ValueError unless the model can be split over `size` ranks: its architecture is one of
    SHARDABLE and size divides the query heads, the KV heads and the MLP width."""
    if size == 1:
        return
    if cfg.arch not in SHARDABLE:
        raise ValueError(f"tensor_parallel_size={size}: verispec shards {', '.join(SHARDABLE)} models, "
                         f"not {cfg.arch!r}")
    for what, n in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                    ("MLP width (intermediate_size)", cfg.intermediate_size)):
        if n % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the model's {n} {what}; "
                             f"{cfg.name or 'the model'} can run on {_divisors(cfg)}")


def _divisors(cfg: ModelConfig) -> str:
    ok = [d for d in range(1, cfg.num_kv_heads + 1)
          if cfg.num_heads % d == 0 and cfg.num_kv_heads % d == 0 and cfg.intermediate_size % d == 0]
    return "tensor_parallel_size " + " or ".join(map(str, ok))


def vocab_rows(vocab_size: int, size: int) -> int:
    """Rows of the embedding / LM head each rank holds (the last shard is padded to it)."""
    return -(-vocab_size // size)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


def _vocab_shard(w: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    rows = vocab_rows(w.shape[0], size)
    part = w[rank * rows : (rank + 1) * rows]
    if part.shape[0] < rows:
        part = torch.cat([part, part.new_zeros(rows - part.shape[0], w.shape[1])])
    return part


def shard_model(model: CausalLM, tp: TensorParallel) -> CausalLM:
    """Replace model's weights by rank tp.rank's shards (in place; the full tensors are dropped
    unless someone else holds them) and hand the layers `tp` for their all-reduces. Returns model."""
    cfg, r, n = model.config, tp.rank, tp.world_size
    check_tensor_parallel(cfg, n)
    d = cfg.head_dim
    for m in model.modules():
        if isinstance(m, Attention):
            hq, hkv = m.num_heads // n, m.num_kv_heads // n
            q, kv = m.num_heads * d, m.num_kv_heads * d
            rows = torch.cat([torch.arange(r * hq * d, (r + 1) * hq * d),
                              q + torch.arange(r * hkv * d, (r + 1) * hkv * d),
                              q + kv + torch.arange(r * hkv * d, (r + 1) * hkv * d)])
            m.qkv_proj.weight = _param(m.qkv_proj.weight[rows])
            if m.qkv_proj.bias is not None:
                m.qkv_proj.bias = _param(m.qkv_proj.bias[rows])
            m.o_proj.weight = _param(m.o_proj.weight[:, r * hq * d : (r + 1) * hq * d])
            m.num_heads, m.num_kv_heads = hq, hkv
            m.q_size, m.kv_size = hq * d, hkv * d
            m.tp = tp
        elif isinstance(m, MLP):
            inter = m.down_proj.weight.shape[1]
            w = inter // n
            gate_up = m.gate_up_proj.weight
            m.gate_up_proj.weight = _param(torch.cat([gate_up[r * w : (r + 1) * w],
                                                      gate_up[inter + r * w : inter + (r + 1) * w]]))
            m.down_proj.weight = _param(m.down_proj.weight[:, r * w : (r + 1) * w])
            m.tp = tp
    emb = model.model.embed_tokens
    emb.weight = _param(_vocab_shard(emb.weight, r, n))
    if not cfg.tie_word_embeddings:
        model.lm_head.weight = _param(_vocab_shard(model.lm_head.weight, r, n))
    model.vocab_start = r * vocab_rows(cfg.vocab_size, n)
    model.tp = tp
    return model
