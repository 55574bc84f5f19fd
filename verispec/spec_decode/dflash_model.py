"""The DFlash drafter: a few bidirectional decoder layers conditioned on target hidden states.

Inputs of one drafting block (B tokens at absolute positions p0 .. p0+B-1):
  * the block's tokens [last accepted token, MASK x (B-1)] through the target's frozen embedding;
  * context features: the hidden states of `target_layers` of the target at every earlier
    position (< p0), concatenated, projected by `fc` and normalised by `hidden_norm`. Every drafter
    layer turns them into extra K/V with its own k_proj / v_proj (no layer norm in between), so a
    position's context K/V depend only on the target's features there: they can be cached per
    position and never depend on the block.
Queries of a block see the context keys before the block and every key of their own block (no
causal order inside the block). The final hidden states go through the target's frozen lm_head; the
output at block position j predicts the token at p0 + j (j = 1 .. B-1).

Training packs several blocks per sequence; `block_attention_mask` keeps them apart.

This is the math of z-lab's published DFlashDraftModel (Qwen3-style layers with per-head q/k norms).
Its config.json is read and written here (config_from_published, published_config), its checkpoint
directory by spec_decode/dflash_format.py, which describes the layout.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from verispec.models.layers.norm import RMSNorm
from verispec.models.layers.rotary import RotaryEmbedding, _rotate
from verispec.models.qwen2 import CausalLM


@dataclass
class DFlashConfig:
    """Everything needed to rebuild a drafter and to check it belongs to its target.

    target_layers: 0-based target layers whose outputs feed `fc` (Hugging Face's hidden_states[i + 1],
    the published format's `target_layer_ids`); num_target_layers: the target's layer count (None:
    unknown, in an old verispec config without a fingerprint). target_name, target_fingerprint and
    loss_gamma are verispec's own: a drafter trained elsewhere has no fingerprint (None)."""

    target_layers: list[int]
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    loss_gamma: float = 7.0
    num_target_layers: int | None = None
    target_name: str = ""
    target_fingerprint: dict | None = None  # see target_fingerprint(): shape fields + probe embedding rows
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        """The old verispec layout's config.json (save_drafter(layout="verispec"))."""
        return json.dumps({"method": "dflash", **asdict(self)}, indent=2)

    @staticmethod
    def from_dict(d: dict) -> DFlashConfig:
        """From a drafter's config.json: the old verispec layout ("method": "dflash" and this class's
        fields) or the published one (see spec_decode/dflash_format.py)."""
        if d.get("method") != "dflash" or "architectures" in d:
            return config_from_published(d)
        d = {k: v for k, v in d.items() if k != "method"}
        known = set(DFlashConfig.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"DFlash drafter config has unknown keys {sorted(unknown)}")
        cfg = DFlashConfig(**d)
        if cfg.num_target_layers is None and cfg.target_fingerprint:
            cfg.num_target_layers = cfg.target_fingerprint.get("shape", {}).get("num_layers")
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ValueError on a config no drafter can be built from."""
        if not self.target_layers or list(self.target_layers) != sorted(set(self.target_layers)) \
                or min(self.target_layers) < 0:
            raise ValueError(f"target layers must be non-negative and strictly increasing, got {self.target_layers}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "vocab_size", "max_position_embeddings"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")


def default_target_layers(num_target_layers: int, count: int = 5) -> list[int]:
    """`count` layers spread uniformly from layer 1 to layer L-3 (all layers of a shallow target; the
    middle layer for count 1), as the published DFlash drafters choose them when none are given."""
    if num_target_layers <= count:
        return list(range(num_target_layers))
    if count == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return sorted({round(lo + (hi - lo) * i / (count - 1)) for i in range(count)})


def default_gamma(block_size: int) -> float:
    """Decay of the loss weight over block positions (DFlash uses 7 / 5 / 4 for B = 16 / 10 / 8)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size / 2.3))


ARCHITECTURE, CONFIG = "DFlashDraftModel", "config.json"  # the published layout (spec_decode/dflash_format.py)


def published_config(cfg: DFlashConfig, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The published config.json of a drafter (plus verispec's target_name, target_fingerprint and
    loss_gamma; `verispec_extra` when cfg.extra is set)."""
    n = cfg.num_layers
    d = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layers)},
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": n,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": ["full_attention"] * n,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": n,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "target_name": cfg.target_name,
        "target_fingerprint": cfg.target_fingerprint,
        "loss_gamma": cfg.loss_gamma,
    }
    for key in ("num_target_layers", "target_fingerprint"):
        if d[key] is None:
            del d[key]
    if cfg.extra:
        d["verispec_extra"] = cfg.extra
    return d


def _unsupported(d: dict, dc: dict) -> list[str]:
    """What the config switches on that DFlashDrafter does not compute."""
    def val(key):
        return dc.get(key, d.get(key))

    out = []
    if d.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act {d['hidden_act']!r} (only silu)")
    if d.get("attention_bias"):
        out.append("attention biases (attention_bias)")
    kinds = sorted({t for t in d.get("layer_types") or [] if t != "full_attention"})
    if kinds:
        out.append(f"layer_types {kinds} (only full_attention)")
    if d.get("use_sliding_window") or val("use_swa"):
        out.append("sliding-window attention")
    if d.get("is_causal") or dc.get("causal"):
        out.append("causal attention inside the block")
    ropes = [r for r in (d.get("rope_scaling"), d.get("rope_parameters")) if isinstance(r, dict)]
    kinds = sorted({r.get("rope_type", r.get("type", "default")) for r in ropes} - {"default"})
    if kinds:
        out.append(f"rope type {kinds} (only default)")
    if float(d.get("partial_rotary_factor", 1.0)) != 1.0:
        out.append("partial rotary embeddings (partial_rotary_factor)")
    if d.get("v_head_dim") not in (None, d.get("head_dim", 128)):
        out.append("v_head_dim different from head_dim")
    for key in ("input_embedding_scale", "output_multiplier", "logit_scale", "attention_value_scale"):
        v = val(key)
        if v is not None and float(v) != 1.0:
            out.append(f"{key} {v}")
    if val("final_logit_softcapping"):
        out.append("final_logit_softcapping")
    if val("attention_sink_bias"):
        out.append("attention sinks (attention_sink_bias)")
    if val("projector_type") not in (None, "dflash"):
        out.append(f"projector_type {val('projector_type')!r}")
    if d.get("target_hidden_size") not in (None, d.get("hidden_size")):
        out.append(f"target_hidden_size {d['target_hidden_size']} different from hidden_size")
    if d.get("draft_vocab_size") not in (None, d.get("vocab_size")):
        out.append("a reduced draft vocabulary (draft_vocab_size)")
    return out


def config_from_published(d: dict, where: str = "") -> DFlashConfig:
    """DFlashConfig from a published config.json (defaults as transformers' Qwen3Config has them;
    rope_theta and mask_token_id must be given). Raises ValueError naming what does not fit."""
    def refuse(msg: str):
        raise ValueError(f"DFlash drafter {where!r}: {msg}")

    archs = d.get("architectures") or []
    if ARCHITECTURE not in archs:
        refuse(f"{CONFIG} names architectures {archs}; verispec runs {ARCHITECTURE} drafters only")
    dc = d.get("dflash_config") or {}
    if not isinstance(dc, dict):
        refuse("dflash_config must be an object")
    missing = object()

    def get(key, default=missing):
        v = dc.get(key, d.get(key, missing))
        if v is missing or v is None:
            if default is missing:
                refuse(f"{CONFIG} gives no {key}")
            return default
        return v

    def num(key, default=missing, kind=int):
        v = get(key, default)
        try:
            return kind(v)
        except (TypeError, ValueError):
            refuse(f"{CONFIG}: {key} must be a number, got {v!r}")

    bad = _unsupported(d, dc)
    if bad:
        refuse("it uses " + "; ".join(bad) + ", which verispec's DFlash drafter does not compute")
    rope = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    rope_theta = d.get("rope_theta", rope.get("rope_theta"))
    if rope_theta is None:
        refuse(f"{CONFIG} gives no rope_theta (nor rope_parameters.rope_theta)")
    num_layers, num_heads = num("num_hidden_layers"), num("num_attention_heads")
    n_target = None if get("num_target_layers", None) is None else num("num_target_layers")
    layer_ids = get("target_layer_ids", None)
    if layer_ids is None:
        if n_target is None:
            refuse(f"{CONFIG} gives neither dflash_config.target_layer_ids nor num_target_layers")
        layer_ids = default_target_layers(n_target, num_layers)
    if not isinstance(layer_ids, list) or not all(isinstance(i, int) for i in layer_ids):
        refuse(f"target_layer_ids must be a list of integers, got {layer_ids!r}")
    block_size = num("block_size", 16)
    fingerprint = d.get("target_fingerprint")
    cfg = DFlashConfig(
        target_layers=list(layer_ids), hidden_size=num("hidden_size"), num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num("num_key_value_heads", num_heads), head_dim=num("head_dim", 128),
        intermediate_size=num("intermediate_size"), vocab_size=num("vocab_size"), block_size=block_size,
        mask_token_id=num("mask_token_id"), rope_theta=float(rope_theta),
        rms_norm_eps=num("rms_norm_eps", 1e-6, float), max_position_embeddings=num("max_position_embeddings", 32768),
        loss_gamma=num("loss_gamma", dc.get("loss_decay_gamma", default_gamma(block_size)), float),
        num_target_layers=n_target, target_name=d.get("target_name") or "",
        target_fingerprint=fingerprint if isinstance(fingerprint, dict) and fingerprint else None,
        extra=d.get("verispec_extra") or {},
    )
    try:
        cfg.validate()
    except ValueError as e:
        refuse(str(e))
    return cfg


PROBE_ROWS, PROBE_COLS = 8, 32


def target_fingerprint(target: CausalLM, name: str = "") -> dict:
    """A cheap, dtype-robust identity of a target model.

    `shape`: the architecture fields that must match exactly. `probe`: the first PROBE_COLS values of
    PROBE_ROWS embedding rows spread over the vocabulary, in float32 rounded to 5 decimals (they are
    compared with a tolerance, so the same checkpoint loaded in bfloat16 or float32 matches, and a
    different checkpoint of the same shape does not). `sha256` hashes both, for display; `name` is the
    registry name or path the drafter was trained against (informational only)."""
    c = target.config
    shape = dict(
        arch=c.arch, vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_layers,
        num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        intermediate_size=c.intermediate_size,
    )
    ids = [1 + i * (c.vocab_size - 1) // (PROBE_ROWS + 1) for i in range(1, PROBE_ROWS + 1)]
    with torch.no_grad():
        rows = target.model.embed_tokens(torch.tensor(ids, device=target.device))  # quantized too
        probe = [[round(float(x), 5) for x in r] for r in rows[:, :PROBE_COLS].float().cpu()]
    blob = json.dumps({"shape": shape, "probe": [[round(x, 2) for x in r] for r in probe]}, sort_keys=True)
    return {"name": name, "shape": shape, "probe_ids": ids, "probe": probe,
            "sha256": hashlib.sha256(blob.encode()).hexdigest()}


def check_fingerprint(saved: dict, target: CausalLM, drafter_path: str) -> None:
    """Raise ValueError unless `saved` (from a drafter's config) describes `target`."""
    now = target_fingerprint(target)
    trained_for = saved.get("name") or "an unnamed target"
    if saved.get("shape") != now["shape"]:
        diff = {k: (v, now["shape"].get(k)) for k, v in saved.get("shape", {}).items() if now["shape"].get(k) != v}
        raise ValueError(
            f"DFlash drafter {drafter_path!r} was trained for {trained_for} and does not fit this target "
            f"(drafter vs target: {diff}); train one for this model with `verispec train-drafter`"
        )
    a, b = torch.tensor(saved["probe"]), torch.tensor(now["probe"])
    if a.shape != b.shape or saved.get("probe_ids") != now["probe_ids"]:
        raise ValueError(f"DFlash drafter {drafter_path!r} has a malformed target fingerprint")
    tol = 0.02 * a.abs().amax(-1, keepdim=True) + 1e-4
    if not bool(((a - b).abs() <= tol).all()):
        raise ValueError(
            f"DFlash drafter {drafter_path!r} was trained for {trained_for}, a different model with the "
            f"same shape as this target (embedding fingerprint differs); train one for this model with "
            f"`verispec train-drafter`"
        )


def block_attention_mask(anchors: torch.Tensor, ctx_valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mask [S, A*B, C + A*B] (True = may attend) for A blocks per row.

    anchors: [S, A] long, the absolute position of each block's first token; ctx_valid: [S, C] bool,
    whether the context key at absolute position c (index c) exists. Block a's queries see context
    keys at positions < anchors[a] that are valid, and all keys of block a itself (bidirectional);
    other blocks stay invisible."""
    s, a = anchors.shape
    c = ctx_valid.shape[1]
    pos = torch.arange(c, device=anchors.device)
    ctx = (pos[None, None, :] < anchors[:, :, None]) & ctx_valid[:, None, :]  # [S, A, C]
    ctx = ctx.repeat_interleave(block_size, dim=1)  # [S, A*B, C]
    blk_id = torch.arange(a * block_size, device=anchors.device) // block_size
    own = (blk_id[:, None] == blk_id[None, :]).expand(s, -1, -1)  # [S, A*B, A*B]
    return torch.cat([ctx, own], dim=-1)


def store_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """K/V [T, KH, D] into a paged cache [2, slots, KH, D]. Every slot must be valid (the drafting
    step sends unused rows to a dump slot): no masking, so nothing syncs and CUDA graphs capture it."""
    cache[0].index_copy_(0, slots, k.to(cache.dtype))
    cache[1].index_copy_(0, slots, v.to(cache.dtype))


def rope(rotary: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] to absolute positions [T] (the target's rotate-half layout)."""
    return _rotate(x, rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1))


class DFlashLayer(nn.Module):
    """Pre-norm decoder layer; attention keys = injected context K/V + the block's own K/V."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h, nh, kh, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.nh, self.kh, self.d = nh, kh, d
        self.q_proj = nn.Linear(h, nh * d, bias=False)
        self.k_proj = nn.Linear(h, kh * d, bias=False)
        self.v_proj = nn.Linear(h, kh * d, bias=False)
        self.o_proj = nn.Linear(nh * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def kv(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated K and V [T, KH, D] of already normalised inputs x [T, H] at positions [T]."""
        t = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(t, self.kh, self.d))
        v = self.v_proj(x).view(t, self.kh, self.d)
        return rope(rotary, positions, k), v

    def forward_paged(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, meta,
                      kv_cache: torch.Tensor, backend) -> torch.Tensor:
        """The engine's form: x [T, H] (blocks laid end to end), positions [T]. The block's K/V
        are written to kv_cache at meta.slot_mapping (store_kv: every slot is valid, so no mask and
        no sync), next to the context K/V already there, and the queries attend through the target's
        paged attention backend (attention/backend.py; meta.causal False: bidirectional)."""
        t, hsz = x.shape
        h = self.input_layernorm(x)
        q = self.q_norm(self.q_proj(h).view(t, self.nh, self.d))
        k = self.k_norm(self.k_proj(h).view(t, self.kh, self.d))
        v = self.v_proj(h).view(t, self.kh, self.d)
        q, k = rotary(positions, q, k)
        store_kv(kv_cache, k, v, meta.slot_mapping)
        out = backend.forward(q.to(kv_cache.dtype), kv_cache, meta, self.d**-0.5)
        x = x + self.o_proj(out.reshape(t, self.nh * self.d).to(x.dtype))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def forward(self, x, positions, rotary, ctx_k, ctx_v, mask):
        """x [S, Q, H], positions [S, Q], ctx_k/ctx_v [S, C, KH, D], mask [S, Q, C+Q] -> [S, Q, H]."""
        s, q_len, hsz = x.shape
        h = self.input_layernorm(x).reshape(s * q_len, hsz)
        flat_pos = positions.reshape(-1)
        q = self.q_norm(self.q_proj(h).view(s * q_len, self.nh, self.d))
        k = self.k_norm(self.k_proj(h).view(s * q_len, self.kh, self.d))
        v = self.v_proj(h).view(s, q_len, self.kh, self.d)
        q, k = rotary(flat_pos, q, k)
        q = q.view(s, q_len, self.nh, self.d).transpose(1, 2)
        keys = torch.cat([ctx_k, k.view(s, q_len, self.kh, self.d)], 1).transpose(1, 2)
        vals = torch.cat([ctx_v, v], 1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, keys.to(q.dtype), vals.to(q.dtype), attn_mask=mask[:, None],
                                             scale=self.d**-0.5, enable_gqa=self.nh != self.kh)
        x = x + self.o_proj(out.transpose(1, 2).reshape(s, q_len, self.nh * self.d))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DFlashDrafter(nn.Module):
    """The drafter's own weights: fc + hidden_norm (context projection), layers, final norm."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(len(cfg.target_layers) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)

    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random init (normal std for projections, output projections scaled by depth)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    scale = std / math.sqrt(2 * self.config.num_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                    p.copy_(torch.randn(p.shape, generator=g) * scale)

    def context_kv(self, feats: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per drafter layer, the rotated context (K, V) [T, KH, D] of target features [T, n*H]."""
        ctx = self.hidden_norm(self.fc(feats))
        return [layer.kv(ctx, positions, self.rotary) for layer in self.layers]

    def write_context(self, feats: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      kv_caches: list[torch.Tensor]) -> None:
        """Context K/V of target features [T, n*H] at positions [T] into each layer's paged cache."""
        for cache, (k, v) in zip(kv_caches, self.context_kv(feats, positions), strict=True):
            store_kv(cache, k, v, slots)

    def forward_paged(self, block_emb: torch.Tensor, positions: torch.Tensor, meta, kv_caches: list[torch.Tensor],
                      backend) -> torch.Tensor:
        """block_emb [T, H] (blocks end to end), positions [T] -> final hidden states [T, H];
        the context K/V must already be in kv_caches (see DFlashLayer.forward_paged)."""
        x = block_emb
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer.forward_paged(x, positions, self.rotary, meta, cache, backend)
        return self.norm(x)

    def forward(self, block_emb, positions, ctx_kv, mask) -> torch.Tensor:
        """block_emb [S, Q, H], positions [S, Q], ctx_kv per layer ([S, C, KH, D], same), mask
        [S, Q, C+Q] -> final normalised hidden states [S, Q, H] (feed to the target's lm_head)."""
        x = block_emb
        for layer, (k, v) in zip(self.layers, ctx_kv, strict=True):
            x = layer(x, positions, self.rotary, k, v, mask)
        return self.norm(x)


def new_config(target: CausalLM, name: str, mask_token_id: int, block_size: int = 16, num_layers: int = 2,
               num_target_layers: int = 5) -> DFlashConfig:
    """A drafter config sized from the target (same width, heads and MLP as the target's layers)."""
    c = target.config
    return DFlashConfig(
        target_name=name, target_fingerprint=target_fingerprint(target, name), num_target_layers=c.num_layers,
        target_layers=default_target_layers(c.num_layers, num_target_layers), hidden_size=c.hidden_size,
        num_layers=num_layers, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        intermediate_size=c.intermediate_size, vocab_size=c.vocab_size, block_size=block_size,
        mask_token_id=mask_token_id, rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, loss_gamma=default_gamma(block_size),
    )
