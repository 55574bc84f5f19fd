"""DFlash drafter checkpoints in the published layout (z-lab's DFlashDraftModel, which vLLM and SGLang load).

A drafter is a directory with config.json and model.safetensors (or shards listed in
model.safetensors.index.json).

config.json is a Qwen3-style config: `architectures: ["DFlashDraftModel"]`, `model_type: "qwen3"`,
`dflash_config: {mask_token_id, target_layer_ids}`, `block_size`, `num_target_layers` (the target's
layer count) and the drafter's own layer fields (hidden_size, intermediate_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps, rope_theta,
max_position_embeddings, vocab_size, ...). Readers look a DFlash key up in dflash_config first, then
at the top level (newer published configs put target_layer_ids there). verispec also writes
target_name, target_fingerprint and loss_gamma at the top level; other loaders ignore them, and a
checkpoint without them loads here without the fingerprint check. (The config itself is read and
written by dflash_model.config_from_published / published_config.)

model.safetensors holds, all `.weight` and without biases: `fc` [H, n*H] (n = len(target_layer_ids)),
`hidden_norm` [H], `norm` [H], and per drafter layer N `layers.N.input_layernorm`,
`layers.N.post_attention_layernorm`, `layers.N.self_attn.{q,k,v,o}_proj`,
`layers.N.self_attn.{q,k}_norm` (per head, [head_dim]) and `layers.N.mlp.{gate,up,down}_proj`.
No embedding and no LM head: both are the target's. `PUBLISHED_NAMES` maps our parameter names to
these.

target_layer_ids are 0-based decoder layers of the target: id i is Hugging Face's
`hidden_states[i + 1]` (hidden_states[0] is the embedding output), which is what the target's
CausalLM captures for layer i (the last layer's after the final norm, as transformers reports it).

What a published config can switch on that this drafter does not compute (sliding-window or causal
attention, attention biases, scaled or partial rope, embedding or logit scales, soft-capping, its
own embedding or LM head, a reduced draft vocabulary, DFlash2's extra modules...) is refused by
name, never run approximately. The old verispec layout (config.json with "method": "dflash" and
verispec's parameter names) still loads; `save_drafter(layout="verispec")` still writes it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from verispec.models.qwen2 import CausalLM
from verispec.spec_decode.dflash_model import (
    CONFIG,
    DFlashConfig,
    DFlashDrafter,
    check_fingerprint,
    config_from_published,
    published_config,
)

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"

# Inside `layers.N.`: our module name -> the published one.
_LAYER_NAMES = {
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
PUBLISHED_NAMES = {"fc": "fc", "hidden_norm": "hidden_norm", "norm": "norm",
                   **{f"layers.N.{k}": f"layers.N.{v}" for k, v in _LAYER_NAMES.items()}}
_OUR_LAYER_NAMES = {v: k for k, v in _LAYER_NAMES.items()}


def published_name(name: str) -> str:
    """Our parameter name (`layers.0.q_proj.weight`) -> the published one (`layers.0.self_attn.q_proj.weight`)."""
    parts = name.split(".")
    if parts[0] == "layers":
        return ".".join(["layers", parts[1], _LAYER_NAMES[parts[2]], parts[-1]])
    return name


def our_name(name: str) -> str | None:
    """The published tensor name -> ours, or None for a tensor our drafter has no parameter for."""
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) >= 4:
        mod = _OUR_LAYER_NAMES.get(".".join(parts[2:-1]))
        return None if mod is None else f"layers.{parts[1]}.{mod}.{parts[-1]}"
    return name if name in ("fc.weight", "hidden_norm.weight", "norm.weight") else None


def read_weights(path: Path, where: str, device="cpu") -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, or of the shards model.safetensors.index.json lists."""
    if (path / WEIGHTS).is_file():
        files = [path / WEIGHTS]
    elif (path / INDEX).is_file():
        files = [path / f for f in sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))]
    else:
        raise ValueError(f"DFlash drafter {where!r} must be a directory with {CONFIG} and {WEIGHTS}")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as st:
            for k in st.keys():
                out[k] = st.get_tensor(k)
    return out


def _refuse_tensors(names: list[str], where: str) -> None:
    own = [n for n in names if "embed_tokens" in n or "lm_head" in n]
    if own:
        raise ValueError(f"DFlash drafter {where!r} ships its own {own[:2]}; verispec's drafter reads the "
                         f"target's embedding and LM head, so it cannot run this one")
    if any(n.split(".")[0] in ("d2t", "t2d") for n in names):
        raise ValueError(f"DFlash drafter {where!r} has a reduced draft vocabulary (d2t/t2d), which verispec "
                         f"does not support")
    if names:
        raise ValueError(f"DFlash drafter {where!r}: tensors verispec's drafter has no place for: {sorted(names)[:6]}")


def load_drafter(path: str | Path, device, dtype) -> DFlashDrafter:
    """Rebuild a drafter from a directory in the published layout (or verispec's old one), weights
    cast to dtype. Raises ValueError naming what does not fit; the target is checked by check_target."""
    p, where = Path(path), str(path)
    if not (p / CONFIG).is_file():
        raise ValueError(f"DFlash drafter {where!r} must be a directory with {CONFIG} and {WEIGHTS}")
    try:
        d = json.loads((p / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"DFlash drafter {where!r}: {CONFIG} is not JSON ({e})") from None
    old = d.get("method") == "dflash" and "architectures" not in d
    cfg = DFlashConfig.from_dict(d) if old else config_from_published(d, where)
    if (p / "mask_embedding.pt").exists():
        raise ValueError(f"DFlash drafter {where!r} ships mask_embedding.pt (its own mask embedding); verispec "
                         f"embeds the mask token with the target's embedding and does not support it")
    raw = read_weights(p, where)
    with torch.device(device):
        drafter = DFlashDrafter(cfg)
    params = dict(drafter.named_parameters())
    sd, stray = {}, []
    for k, v in raw.items():
        ours = k if old else our_name(k)
        if ours in params:
            sd[ours] = v
        else:
            stray.append(k)
    _refuse_tensors(stray, where)
    missing = [k if old else published_name(k) for k in params if k not in sd]
    if missing:
        raise ValueError(f"DFlash drafter {where!r}: missing tensors {missing[:4]} (of {len(missing)})")
    for k, t in sd.items():
        if tuple(t.shape) != tuple(params[k].shape):
            name = k if old else published_name(k)
            raise ValueError(f"DFlash drafter {where!r}: tensor {name} has shape {tuple(t.shape)}, its config "
                             f"needs {tuple(params[k].shape)}")
    drafter.load_state_dict(sd, strict=True)
    drafter.requires_grad_(False)
    return drafter.to(dtype=dtype).eval()


def save_drafter(drafter: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                 layout: str = "published") -> str:
    """Write model.safetensors + config.json in the published layout (layout="verispec": the old
    one); return the sha256 of the weights file."""
    if layout not in ("published", "verispec"):
        raise ValueError(f"layout must be 'published' or 'verispec', got {layout!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = published_name if layout == "published" else str
    sd = {name(k): v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    tmp = out / (WEIGHTS + ".tmp")
    save_file(sd, str(tmp), metadata={"format": "pt"})
    tmp.chmod(0o644)
    tmp.replace(out / WEIGHTS)
    cfg = drafter.config
    text = (json.dumps(published_config(cfg, dtype), indent=2, sort_keys=True) if layout == "published"
            else cfg.to_json())
    (out / CONFIG).write_text(text + "\n")
    return hashlib.sha256((out / WEIGHTS).read_bytes()).hexdigest()


def check_target(cfg: DFlashConfig, target: CausalLM, where: str) -> None:
    """Raise ValueError, naming the problem, unless the drafter described by cfg fits `target`:
    hidden size, vocabulary, the target's layer count (num_target_layers), target_layer_ids and the
    mask token within range, and (when cfg carries one) verispec's target fingerprint."""
    tc = target.config
    if cfg.hidden_size != tc.hidden_size:
        raise ValueError(f"DFlash drafter {where!r} has hidden size {cfg.hidden_size}, the target {tc.hidden_size}: "
                         f"it was made for another model")
    if cfg.vocab_size != tc.vocab_size:
        raise ValueError(f"DFlash drafter {where!r} has a vocabulary of {cfg.vocab_size}, the target "
                         f"{tc.vocab_size}: it was made for another model")
    if cfg.num_target_layers is not None and cfg.num_target_layers != tc.num_layers:
        raise ValueError(f"DFlash drafter {where!r} does not fit this target: it was made for a target of "
                         f"{cfg.num_target_layers} layers (num_target_layers), this one has {tc.num_layers}")
    out = [i for i in cfg.target_layers if not 0 <= i < tc.num_layers]
    if out:
        raise ValueError(f"DFlash drafter {where!r}: target_layer_ids {out} are out of range for this target's "
                         f"{tc.num_layers} layers (0 .. {tc.num_layers - 1})")
    if not 0 <= cfg.mask_token_id < tc.vocab_size:
        raise ValueError(f"DFlash drafter {where!r}: mask_token_id {cfg.mask_token_id} is out of range for this "
                         f"target's vocabulary of {tc.vocab_size}")
    if cfg.target_fingerprint:
        check_fingerprint(cfg.target_fingerprint, target, where)
