"""The Qwen2 architecture; Llama (no qkv bias) and Qwen3 (q/k RMSNorm, no bias) are config variants.

forward(input_ids, positions, meta, kv_caches) works on a flat batch of tokens: every sequence's new
tokens laid end to end, with AttentionMetadata saying where each sequence starts and which cache
slots it owns. Parameter names follow Hugging Face so checkpoints load by name.

Attention goes through the model's attention backend (attn_backend: attention/reference.py by
default, attention/triton.py once models/kernel_path.enable_triton switched the model on), which
also writes the K/V. The modules with a `kernels` attribute call the Triton kernels for CUDA tensors
when it is set (a models/kernel_path.Kernels); this file imports no kernel module itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from verispec.attention.backend import AttentionBackend
from verispec.attention.reference import ReferenceBackend
from verispec.config import ModelConfig
from verispec.core.attention_metadata import AttentionMetadata
from verispec.models.layers.norm import RMSNorm
from verispec.models.layers.quant import QuantLinear, is_quantized
from verispec.models.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from verispec.core.parallel import TensorParallel
    from verispec.kernels.l2_prefetch import Regions
    from verispec.models.kernel_path import Kernels


def _reduced(tp: TensorParallel | None, x: torch.Tensor) -> torch.Tensor:
    """A row-parallel projection's output: summed over the tensor-parallel ranks (as is without TP)."""
    return x if tp is None else tp.all_reduce(x)


class Attention(nn.Module):
    kernels: Kernels | None = None  # set: the linear kernels for CUDA tensors
    # Tensor parallelism (distributed/shard.py): this rank's heads only; o_proj is row-parallel.
    tp: TensorParallel | None = None
    window: int = 0  # sliding window (0: global): keys at positions <= query position - window are masked

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q, k and v in one GEMM: the checkpoint's q_proj / k_proj / v_proj stacked by build_model.
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, positions, rotary: RotaryEmbedding, meta: AttentionMetadata, kv_cache,
                backend: AttentionBackend, prefetch: Regions | None = None):
        """prefetch: weight regions the attention launch asks L2 for (the Triton backend's option)."""
        t = x.shape[0]
        k_ = self.kernels if not self.quantized else None  # quantized projections run their own matmul
        if k_ is not None and x.is_cuda:
            qkv = k_.linear(x, self.qkv_proj.weight, self.qkv_proj.bias, options=k_.options)
        else:
            qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = backend.rotary_write_kv(rotary, positions, q, k, v, kv_cache, meta.slot_mapping)
        out = backend.forward(q, kv_cache, meta, self.scale, prefetch, window=self.window)
        if k_ is not None and x.is_cuda:
            return _reduced(self.tp, k_.linear(out.reshape(t, -1), self.o_proj.weight, options=k_.options))
        return _reduced(self.tp, self.o_proj(out.reshape(t, -1)))

    @property
    def quantized(self) -> bool:
        """True when the projections hold quantized weights (models/layers/quant.py)."""
        return is_quantized(self.qkv_proj)


class MLP(nn.Module):
    kernels: Kernels | None = None  # set: the GEMV / split-K kernels with fused SiLU-and-mul for CUDA tensors
    tp: TensorParallel | None = None  # set: gate_up column-parallel, down row-parallel (distributed/shard.py)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # gate and up in one GEMM: the checkpoint's gate_proj / up_proj stacked by build_model.
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def l2_regions(self, nbytes: int) -> Regions | None:
        """What of gate_up an L2 prefetch of nbytes asks for (cached: the weight never moves)."""
        key = (nbytes, self.gate_up_proj.weight.data_ptr())
        if getattr(self, "_l2", (None, None))[0] != key:
            from verispec.kernels.l2_prefetch import stacked_head  # once per weight (the Triton backend only)

            self._l2 = (key, stacked_head(self.gate_up_proj.weight, nbytes))
        return self._l2[1]

    @property
    def quantized(self) -> bool:
        """True when the projections hold quantized weights (models/layers/quant.py)."""
        return is_quantized(self.gate_up_proj)

    def forward(self, x):
        k_ = self.kernels
        if k_ is not None and x.is_cuda and not self.quantized:
            o = k_.options
            return _reduced(self.tp, k_.linear(k_.gate_up_silu(x, self.gate_up_proj.weight, o), self.down_proj.weight,
                                               options=o))
        if isinstance(self.gate_up_proj, QuantLinear):  # quantized: SiLU-and-mul in the kernel where it can
            return _reduced(self.tp, self.down_proj(self.gate_up_proj.silu_mul(x)))
        y = self.gate_up_proj(x)
        gate, up = y.chunk(2, dim=-1)
        return _reduced(self.tp, self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, positions, rotary, meta, kv_cache, backend: AttentionBackend):
        # Small steps' attention may ask L2 for the head of gate_up's weight (the backend decides).
        nbytes = backend.l2_prefetch_bytes(x.shape[0], meta) if not self.mlp.quantized else 0
        pf = self.mlp.l2_regions(nbytes) if nbytes else None
        k_ = self.self_attn.kernels
        if k_ is not None and x.is_cuda and not self.self_attn.qk_norm and not self.self_attn.quantized \
                and not self.mlp.quantized:
            rows = x.shape[0]
            if rows <= k_.gemv_max_rows:
                return self._forward_fused(x, residual, positions, rotary, meta, kv_cache, backend, pf,
                                           k_.qkv_rope_write_kv, k_.gemv)
            if 2 <= rows <= k_.small_m_max_rows and self.self_attn.head_dim % k_.small_m_head_dim == 0:
                return self._forward_fused(x, residual, positions, rotary, meta, kv_cache, backend, pf,
                                           k_.small_m_qkv_rope_write_kv, k_.small_m_linear)
            if 2 <= rows <= k_.fused_qkv_max_rows:
                return self._forward_fused_qkv(x, residual, positions, rotary, meta, kv_cache, backend, pf)
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rotary, meta, kv_cache, backend, pf)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def _forward_fused_qkv(self, x, residual, positions, rotary, meta, kv_cache, backend, pf: Regions | None):
        """A step of a few rows (KernelOptions.fused_qkv_max_rows) with only the attention's input fused: RMSNorm +
        qkv + rotary + K/V write in the one-row family's kernel (qkv_rope.qkv_rope_write_kv, row by row), then
        attention, o, the post-attention norm, gate_up + SiLU-mul and down as the unfused path runs them."""
        o, residual = self._fused_attention(x, residual, positions, rotary, meta, kv_cache, backend, pf,
                                            self.self_attn.kernels.qkv_rope_write_kv)
        x, residual = self.post_attention_layernorm(o, residual)
        return self.mlp(x), residual

    def _fused_attention(self, x, residual, positions, rotary, meta, kv_cache, backend, pf: Regions | None, qkv_rope):
        """The attention half of the fused paths: RMSNorm + qkv + rotary + K/V write in one `qkv_rope` kernel,
        attention, o; returns (o's output, the new residual)."""
        attn, ln1 = self.self_attn, self.input_layernorm
        k_ = attn.kernels
        q, residual = qkv_rope(
            x, attn.qkv_proj.weight, attn.qkv_proj.bias, positions, rotary.cos, rotary.sin, kv_cache,
            meta.slot_mapping, attn.num_heads, attn.num_kv_heads, attn.head_dim, norm=(ln1.weight, ln1.eps),
            residual=residual, options=k_.options)
        a = backend.forward(q, kv_cache, meta, attn.scale, pf, window=attn.window)
        return _reduced(attn.tp, k_.linear(a.reshape(x.shape[0], -1), attn.o_proj.weight, options=k_.options)), residual

    def _forward_fused(self, x, residual, positions, rotary, meta, kv_cache, backend, pf: Regions | None,
                       qkv_rope, norm_linear):
        """A small step on CUDA in five kernels: RMSNorm + qkv + rotary + K/V write, attention
        (+ its combine), o, RMSNorm + gate_up + SiLU-mul, down. Each norm runs in its projection's
        prologue, which saves a dependent kernel launch per norm (separate norm kernels were slower:
        docs/BENCHMARKS.md, session 4); the qkv kernel writes K/V into the paged cache itself. pf:
        what the attention launch asks L2 for (the head of gate_up's weight). qkv_rope / norm_linear:
        the one-row kernels (qkv_rope.qkv_rope_write_kv, linear.gemv) or the 2..16-row ones
        (small_m_qkv.small_m_qkv_rope_write_kv, small_m.small_m_linear); o and down go through
        Kernels.linear, which picks the same family by row count."""
        mlp, ln2 = self.mlp, self.post_attention_layernorm
        k_ = self.self_attn.kernels
        o_ = k_.options
        o, residual = self._fused_attention(x, residual, positions, rotary, meta, kv_cache, backend, pf, qkv_rope)
        y, residual = norm_linear(o, mlp.gate_up_proj.weight, silu_mul=True, norm=(ln2.weight, ln2.eps),
                                  residual=residual, options=o_)
        return _reduced(mlp.tp, k_.linear(y, mlp.down_proj.weight, options=o_)), residual


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # No random init (build_model binds the weights): normal_ on the meta device would import
        # torch._dynamo, 2.5 s of start-up.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Decoder-only LM over a paged KV cache. Weights are frozen (inference only).

    attn_backend: the attention backend its layers use; kernels: set by enable_triton (the LM head's
    GEMV for CUDA tensors, and the options the model's kernels run with). tp: set by
    distributed/shard.py: the embedding and the LM head hold this rank's vocabulary rows
    [vocab_start, vocab_start + rows) (the last shard zero-padded), and config keeps the full model's sizes."""

    kernels: Kernels | None = None
    tp: TensorParallel | None = None
    vocab_start: int = 0

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.attn_backend: AttentionBackend = ReferenceBackend()
        self.requires_grad_(False)

    def layer_rotary(self, i: int) -> RotaryEmbedding:
        """The rotary embedding layer i uses (one for all layers here)."""
        return self.rotary

    @property
    def device(self) -> torch.device:
        """Where the model's tensors live."""
        return self.model.norm.weight.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The dense LM head (the embedding when tied); a quantized model has none (compute_logits)."""
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.model.embed_tokens(input_ids)
        # Vocabulary-parallel: each rank looks up the ids in its rows, zeros elsewhere; the sum is exact.
        weight = self.model.embed_tokens.weight
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), weight).masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(x)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        capture_layers: tuple[int, ...] = (),
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns (final normed hidden states [T, H], hidden states after each layer in capture_layers).

        Captured layer i is Hugging Face's `hidden_states[i + 1]`: the output of decoder layer i, and
        for the last layer the output after the final norm (transformers reports it so, and the
        published DFlash drafters index target layers that way)."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        captured: list[torch.Tensor] = []
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, positions, self.layer_rotary(i), meta, kv_caches[i], self.attn_backend)
            if i in capture_layers and i != last:
                captured.append(x + residual)
        x, _ = self.model.norm(x, residual)
        if last in capture_layers:
            captured.append(x)
        return x, captured

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits in float32 for the given hidden states (written into `out` if given)."""
        if self.tp is not None:  # vocabulary-parallel: every rank's rows, gathered (padding cut off)
            part = self._local_logits(hidden, None)
            logits = self.tp.all_gather(part)[:, : self.config.vocab_size]
            return logits if out is None else out.copy_(logits)
        return self._local_logits(hidden, out)

    def _local_logits(self, hidden: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        head = self._modules.get("lm_head")
        if isinstance(head, QuantLinear):  # quantized weights (the LM head of a tied model too)
            logits = head(hidden)
            return logits.float() if out is None else out.copy_(logits)
        k_ = self.kernels
        if k_ is not None and hidden.is_cuda:
            return k_.linear(hidden, self.lm_head_weight, out_dtype=torch.float32, out=out, options=k_.options)
        logits = F.linear(hidden, self.lm_head_weight)
        return logits.float() if out is None else out.copy_(logits)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters under Hugging Face's names (the fused projections split back, as views)."""
        return unfuse_projections({n: p for n, p in self.named_parameters()}, self.config)


_QKV = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")


def fuse_projections(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face names -> ours: per layer, q/k/v_proj stacked into qkv_proj, gate/up_proj into
    gate_up_proj (weights and biases), in place (so the parts are freed as they are stacked).
    Tensors already under the fused names pass through."""
    out = sd
    for i in range(cfg.num_layers):
        for mod, parts, fused in (("self_attn", _QKV, "qkv_proj"), ("mlp", _GATE_UP, "gate_up_proj")):
            for kind in ("weight", "bias"):
                names = [f"model.layers.{i}.{mod}.{p}.{kind}" for p in parts]
                if all(n in out for n in names):
                    out[f"model.layers.{i}.{mod}.{fused}.{kind}"] = torch.cat([out.pop(n) for n in names])
    return out


def unfuse_projections(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of fuse_projections (views of the fused tensors)."""
    out = dict(sd)
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    for i in range(cfg.num_layers):
        for mod, parts, fused, sizes in (("self_attn", _QKV, "qkv_proj", [q, kv, kv]),
                                         ("mlp", _GATE_UP, "gate_up_proj", [inter, inter])):
            for kind in ("weight", "bias"):
                t = out.pop(f"model.layers.{i}.{mod}.{fused}.{kind}", None)
                if t is not None:
                    for p, piece in zip(parts, t.split(sizes), strict=True):
                        out[f"model.layers.{i}.{mod}.{p}.{kind}"] = piece
    return out


def build_model(cfg: ModelConfig, state_dict: dict[str, torch.Tensor], device, dtype,
                model_cls: type[CausalLM] | None = None, modules: dict[str, nn.Module] | None = None) -> CausalLM:
    """Instantiate model_cls (default CausalLM) on the meta device, then bind the loaded tensors (no
    double allocation beyond one layer's fused projections). state_dict may use Hugging Face's names or ours.
    modules: submodules by path that replace the model's own, already on `device` (quantized layers,
    loader/quantized.py); state_dict holds the rest."""
    with torch.device("meta"):
        model = (model_cls or CausalLM)(cfg)
    for path, m in (modules or {}).items():
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, m)
    replaced = tuple(f"{p}." for p in (modules or {}))
    state_dict = fuse_projections(state_dict, cfg)
    missing = []
    for name, param in model.named_parameters():
        if name.startswith(replaced):
            continue
        t = state_dict.get(name)
        if t is None:
            missing.append(name)
            continue
        if tuple(t.shape) != tuple(param.shape):
            raise ValueError(f"weight {name} has shape {tuple(t.shape)}, expected {tuple(param.shape)}")
        _set_param(model, name, t.to(device=device, dtype=dtype))
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    for m in model.modules():  # rotary tables were built on the CPU, not on the meta device
        if isinstance(m, RotaryEmbedding):
            m.to(device)
    return model.eval()


def _set_param(model: nn.Module, name: str, value: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    setattr(mod, attr, nn.Parameter(value, requires_grad=False))
