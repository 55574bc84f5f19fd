"""The Gemma 3 text architecture, on qwen2.py's attention, paged cache and forward contract.

What differs from Qwen2 / Llama:
  * local (sliding-window) and global attention layers interleaved: every sliding_window_pattern-th
    layer is global; local layers see the last sliding_window positions and rotate with their own
    base (rope_local_theta), global layers with rope_theta;
  * q / k RMSNorm per head before the rotary embedding; attention scale query_pre_attn_scalar ** -0.5;
  * four RMSNorms per layer: before and after attention, before and after the MLP;
  * RMSNorm multiplies by (1 + w): the norm weights this model holds are 1 + w already, as llama.cpp's
    converter stores them in the GGUF (transformers' GGUF loader subtracts the 1 again; a Hugging
    Face state dict needs + 1 on every *norm.weight before build_model);
  * GELU (tanh approximation) gated MLP; embeddings scaled by sqrt(hidden_size); tied LM head;
    optional final logit softcapping.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from verispec.attention.backend import AttentionBackend
from verispec.attention.reference import ReferenceBackend
from verispec.config import ModelConfig
from verispec.models.layers.norm import RMSNorm
from verispec.models.layers.rotary import RotaryEmbedding
from verispec.models.qwen2 import MLP, Attention, Backbone, CausalLM


class GeluMLP(MLP):
    """down(gelu_tanh(gate(x)) * up(x)); gate and up in one GEMM, as in qwen2.MLP."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k_ = self.kernels if not self.quantized else None  # quantized projections run their own matmul
        if k_ is not None and x.is_cuda:
            y = k_.linear(x, self.gate_up_proj.weight, options=k_.options)
        else:
            y = self.gate_up_proj(x)
        gate, up = y.chunk(2, dim=-1)
        h = F.gelu(gate, approximate="tanh") * up
        if k_ is not None and x.is_cuda:
            return k_.linear(h, self.down_proj.weight, options=k_.options)
        return self.down_proj(h)


class Gemma3DecoderLayer(nn.Module):
    """Pre- and post-norms around attention and MLP; `window` is this layer's sliding window (0: global)."""

    def __init__(self, cfg: ModelConfig, window: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = Attention(cfg)
        self.self_attn.window = window
        self.self_attn.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = GeluMLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, x, residual, positions, rotary, meta, kv_cache, backend: AttentionBackend):
        """(x, residual) -> (x', residual') with the hidden state x + residual, as qwen2's layers:
        the residual adds ride in the following norms."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, positions, rotary, meta, kv_cache, backend))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 over the paged KV cache: qwen2.CausalLM's forward and hooks with Gemma's layers,
    two rotary tables (local, global), the scaled embedding and the softcapped logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        if not cfg.tie_word_embeddings:
            raise ValueError("gemma3 ties its LM head to the embeddings")
        nn.Module.__init__(self)
        self.config = cfg
        self.model = Backbone(cfg)
        self.windows = cfg.layer_windows()
        self.model.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, w) for w in self.windows)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_theta)
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.attn_backend: AttentionBackend = ReferenceBackend()
        self.requires_grad_(False)

    def layer_rotary(self, i: int) -> RotaryEmbedding:
        """Local layers rotate with rope_local_theta, global ones with rope_theta."""
        return self.rotary_local if self.windows[i] else self.rotary

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings times sqrt(hidden_size), the factor rounded to the weights' dtype (as transformers does)."""
        e = self.model.embed_tokens(input_ids)
        return e * float(torch.tensor(self.embed_scale, dtype=e.dtype))

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits in float32, softcapped when the config says so."""
        cap = self.config.final_logit_softcapping
        if cap is None:
            return super().compute_logits(hidden, out)
        logits = torch.tanh(super().compute_logits(hidden) / cap) * cap
        return logits if out is None else out.copy_(logits)
