"""The Qwen2 architecture; Llama (no qkv bias) and Qwen3 (q/k RMSNorm, no bias) are config variants.

forward(input_ids, positions, meta, kv_caches) works on a flat batch of tokens: every sequence's new
tokens laid end to end, with AttentionMetadata saying where each sequence starts and which cache
slots it owns. Parameter names follow Hugging Face so checkpoints load by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from verispec.config import ModelConfig
from verispec.models.layers.attention import AttentionMetadata, reference_attention, write_kv
from verispec.models.layers.norm import RMSNorm
from verispec.models.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    use_triton = False  # fused KV-cache write kernel for CUDA tensors

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, positions, rotary: RotaryEmbedding, meta: AttentionMetadata, kv_cache, attn_fn):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        if self.use_triton and k.is_cuda:
            from verispec.kernels.paged_attention import triton_write_kv

            triton_write_kv(kv_cache, k, v, meta.slot_mapping)
        else:
            write_kv(kv_cache, k, v, meta.slot_mapping)
        out = attn_fn(q, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    use_triton = False  # fused SiLU-and-mul kernel for CUDA tensors

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        if self.use_triton and x.is_cuda:
            from verispec.kernels.fused import silu_and_mul

            return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, positions, rotary, meta, kv_cache, attn_fn):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rotary, meta, kv_cache, attn_fn)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Decoder-only LM over a paged KV cache. Weights are frozen (inference only)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.attn_fn = reference_attention
        self.requires_grad_(False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        capture_layers: tuple[int, ...] = (),
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns (final normed hidden states [T, H], hidden states after each layer in capture_layers)."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        captured: list[torch.Tensor] = []
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, positions, self.rotary, meta, kv_caches[i], self.attn_fn)
            if i in capture_layers:
                captured.append(x + residual)
        x, _ = self.model.norm(x, residual)
        return x, captured

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 for the given hidden states."""
        return F.linear(hidden, self.lm_head_weight).float()


def build_model(cfg: ModelConfig, state_dict: dict[str, torch.Tensor], device, dtype) -> CausalLM:
    """Instantiate on the meta device, then bind the loaded tensors (no double allocation)."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    missing = []
    for name, param in model.named_parameters():
        t = state_dict.get(name)
        if t is None:
            missing.append(name)
            continue
        if tuple(t.shape) != tuple(param.shape):
            raise ValueError(f"weight {name} has shape {tuple(t.shape)}, expected {tuple(param.shape)}")
        _set_param(model, name, t.to(device=device, dtype=dtype))
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    rot = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
    model.rotary = rot.to(device)
    return model.eval()


def _set_param(model: nn.Module, name: str, value: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    setattr(mod, attr, nn.Parameter(value, requires_grad=False))
