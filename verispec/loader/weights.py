"""Load a model's weights (GGUF file or Hugging Face folder) as a Hugging Face-named state dict.

Dequantized GGUF weights are cached as safetensors under
``${VERISPEC_CACHE_DIR:-~/.cache/verispec}/dequant/`` so later loads skip dequantization.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from verispec.config import ModelConfig
from verispec.core import envs
from verispec.loader.dequant import SUPPORTED_TYPES, dequantize, type_name
from verispec.loader.gguf import SUPPORTED_ARCHS, GGUFError, GGUFFile, model_config_from_metadata

CACHE_FORMAT_VERSION = 1
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms around attention and MLP: llama.cpp's ffn_norm is the pre-MLP norm, which Gemma's
# Hugging Face names call pre_feedforward_layernorm (Llama's name for it is post_attention_layernorm).
_GEMMA3_BLOCK = {
    **_BLOCK, "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, arch: str = "qwen2") -> str | None:
    """Hugging Face state-dict name of a GGUF tensor, or None for tensors verispec does not use."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    block = _GEMMA3_BLOCK if arch == "gemma3" else _BLOCK
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in block:
        return None
    return f"model.layers.{m.group(1)}.{block[m.group(2)]}.{m.group(3)}"


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rope pairs) to get Hugging Face's layout."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def cache_dir() -> Path:
    """Directory for dequantized-weight caches."""
    return envs.cache_dir() / "dequant"


def cache_path(path: str | os.PathLike[str], dtype: torch.dtype) -> Path:
    """Cache file for a GGUF file's weights in ``dtype``; keyed on path, size, mtime and format."""
    p = os.path.abspath(path)
    st = os.stat(p)
    key = f"{p}|{st.st_size}|{st.st_mtime_ns}|{dtype}|v{CACHE_FORMAT_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return cache_dir() / f"{Path(p).stem}-{str(dtype).removeprefix('torch.')}-{digest}.safetensors"


def _dequantize_gguf(
    f: GGUFFile, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, progress: bool
) -> dict[str, torch.Tensor]:
    wanted = [(n, hf_name(n, cfg.arch)) for n in f.tensors]
    wanted = [(n, h) for n, h in wanted if h is not None]
    for n, _ in wanted:
        if f.tensors[n].ggml_type not in SUPPORTED_TYPES:
            names = ", ".join(sorted(type_name(t) for t in SUPPORTED_TYPES))
            raise GGUFError(
                f"{f.path}: tensor {n!r} has ggml type {type_name(f.tensors[n].ggml_type)}, which verispec "
                f"cannot dequantize (supported: {names})"
            )
    it: Any = wanted
    if progress:
        from tqdm import tqdm

        it = tqdm(wanted, desc=f"dequantizing {Path(f.path).name}", unit="tensor")
    out: dict[str, torch.Tensor] = {}
    for n, h in it:
        info = f.tensors[n]
        w = dequantize(f.raw(n), info.ggml_type, info.shape, device=device, dtype=dtype)
        if cfg.arch == "llama" and n.endswith(("attn_q.weight", "attn_k.weight")):
            w = unpermute_rope(w, cfg.num_heads if "attn_q" in n else cfg.num_kv_heads).contiguous()
        out[h] = w
    return out


def _check_complete(
    sd: dict[str, torch.Tensor], cfg: ModelConfig, where: str, err: type[ValueError] = GGUFError
) -> None:
    need = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if cfg.tie_word_embeddings else ["lm_head.weight"])
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight"]
    if cfg.arch == "gemma3":
        per_layer += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    per_layer += [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"] if cfg.qkv_bias else []
    per_layer += [f"self_attn.{p}_norm.weight" for p in "qk"] if cfg.qk_norm else []
    need += [f"model.layers.{i}.{p}" for i in range(cfg.num_layers) for p in per_layer]
    missing = [k for k in need if k not in sd]
    if missing:
        raise err(f"{where}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def _atomic_save(sd: dict[str, torch.Tensor], dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in sd.items()}, str(tmp),
                  metadata={"format": "pt", "verispec_cache_version": str(CACHE_FORMAT_VERSION)})
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            tmp.unlink()


def _load_cache(dest: Path, device: torch.device) -> dict[str, torch.Tensor] | None:
    if not dest.is_file():
        return None
    try:
        with safe_open(str(dest), framework="pt") as fh:
            if (fh.metadata() or {}).get("verispec_cache_version") != str(CACHE_FORMAT_VERSION):
                return None
        return load_file(str(dest), device=str(device))
    except Exception:  # unreadable or corrupt cache: rebuild it
        dest.unlink(missing_ok=True)
        return None


def load_gguf_weights(
    path: str | os.PathLike[str], *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    progress: bool = False, use_cache: bool = True,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and Hugging Face-named weights of a GGUF model (dequantized on ``device``)."""
    device = torch.device(device)
    f = GGUFFile(path)
    cfg = model_config_from_metadata(f.metadata, tensor_names=f.tensors.keys(), source=f.path)
    dest = cache_path(f.path, dtype) if use_cache else None
    sd = _load_cache(dest, device) if dest is not None else None
    if sd is None:
        sd = _dequantize_gguf(f, cfg, device, dtype, progress)
        _check_complete(sd, cfg, f.path)
        if dest is not None:
            _atomic_save(sd, dest)
    _check_complete(sd, cfg, str(dest or f.path))
    return cfg, sd


def hf_model_config(config: dict[str, Any], name: str = "", where: str = "config.json") -> ModelConfig:
    """ModelConfig from a Hugging Face ``config.json`` dict (qwen2, llama, qwen3)."""
    arch = config.get("model_type")
    if arch not in SUPPORTED_ARCHS or arch == "gemma3":  # Gemma 3 loads from its GGUF only (so far)
        raise ValueError(f"{where}: unsupported model_type {arch!r}; verispec runs {', '.join(SUPPORTED_ARCHS)}")
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        kw: dict[str, Any] = dict(
            vocab_size=int(config["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]), num_layers=int(config["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
        )
    except KeyError as e:
        raise ValueError(f"{where}: missing required key {e.args[0]!r}") from None
    rope = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ValueError(f"{where}: rope scaling {scaling} is not supported: verispec's plain rotary embedding "
                         "would give wrong outputs")
    eos = config.get("eos_token_id")
    kw.update(
        rope_theta=float(rope), rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        bos_token_id=config.get("bos_token_id"), eos_token_id=eos[0] if isinstance(eos, list) else eos,
        name=name or str(config.get("_name_or_path", "")),
    )
    if arch != "qwen2":
        kw["qkv_bias"] = bool(config.get("attention_bias", False))
    return ModelConfig.for_arch(arch, **kw)


def load_hf_weights(
    path: str | os.PathLike[str], *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and weights of a Hugging Face folder (config.json + *.safetensors)."""
    folder = Path(path)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{folder}: no config.json; expected a Hugging Face model folder or a .gguf file")
    cfg = hf_model_config(json.loads(cfg_file.read_text()), name=folder.name, where=str(cfg_file))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors weight files")
    sd: dict[str, torch.Tensor] = {}
    for fp in files:
        for k, v in load_file(str(fp), device=str(torch.device(device))).items():
            if k.startswith("model.") or k == "lm_head.weight":
                sd[k] = v.to(dtype)
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    _check_complete(sd, cfg, str(folder), ValueError)
    return cfg, sd


def load_weights(
    path: str | os.PathLike[str], *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    progress: bool = False, use_cache: bool = True,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and Hugging Face-named weights of a ``.gguf`` file or a Hugging Face model folder."""
    if os.path.isdir(path):
        return load_hf_weights(path, device=device, dtype=dtype)
    return load_gguf_weights(path, device=device, dtype=dtype, progress=progress, use_cache=use_cache)
