"""Load a model by name or path: resolve the file, read its weights and tokenizer, build the module."""

from __future__ import annotations

from pathlib import Path

import torch

from verispec.config import ModelConfig
from verispec.core import envs
from verispec.loader.registry import resolve_model
from verispec.loader.tokenizer import Tokenizer
from verispec.models.build import build_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """'auto' device: cuda if available; 'auto' dtype: float32 on cpu, bfloat16 on cuda."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA GPU")
    if dtype == "auto":
        dtype = "float32" if device == "cpu" else "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
    return torch.device(device), DTYPES[dtype]


QUANTIZATIONS = ("gguf", "none")


def is_gguf_model(name_or_path: str) -> bool:
    """True for a registry name or a .gguf file (what quantization='gguf' can load); nothing is pulled."""
    from verispec.loader.registry import REGISTRY

    return name_or_path in REGISTRY or (str(name_or_path).endswith(".gguf") and not Path(name_or_path).is_dir())


def load_model(name_or_path: str, device: torch.device, dtype: torch.dtype, progress: bool = True,
               quantization: str = "none"):
    """(tokenizer, config, model) for a registry name, a .gguf file or a HF folder.

    quantization "none": weights dequantized to `dtype` (the float32 reference on the CPU); "gguf": a GGUF
    file's weights kept quantized (loader/quantized.py; ValueError for a Hugging Face folder)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    path = resolve_model(name_or_path, progress=progress)
    modules = None
    if quantization == "gguf":
        if not Path(path).is_file():
            raise ValueError(f"quantization='gguf' needs a .gguf model, got the folder {path}")
        from verispec.loader.quantized import load_gguf_quantized  # local: gguf off the import path

        cfg, weights, modules = load_gguf_quantized(path, device=device, dtype=dtype)
    else:
        from verispec.loader.weights import load_weights  # local: keeps gguf off the import path until a load

        cfg, weights = load_weights(path, device=device, dtype=dtype, progress=progress)
    cfg.name = name_or_path
    tok = Tokenizer.from_gguf(path) if Path(path).is_file() else Tokenizer.from_hf_folder(path)
    model = build_model(cfg, weights, device, dtype, modules=modules)
    if quantization == "gguf" and torch.device(device).type == "cpu" and dtype == torch.float32 and envs.cpu_ops():
        from verispec.models.kernel_path import enable_cpu_ops  # the C ops of the quantized CPU path

        enable_cpu_ops(model)
    return tok, cfg, model


def read_config(name_or_path: str, progress: bool = True) -> ModelConfig:
    """The ModelConfig of a registry name (pulled if missing), a .gguf file or a HF folder, without its
    weights (checks that must come before a load)."""
    import json

    from verispec.loader.gguf import read_model_config
    from verispec.loader.weights import hf_model_config

    path = Path(resolve_model(name_or_path, progress=progress))
    if path.is_file():
        return read_model_config(path, name_or_path)
    return hf_model_config(json.loads((path / "config.json").read_text()), name_or_path, str(path / "config.json"))


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * torch.tensor([], dtype=dtype).element_size()
