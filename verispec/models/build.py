"""Which module class runs which architecture, and build_model over it (the loader's one entry)."""

from __future__ import annotations

import torch

from verispec.config import ModelConfig
from verispec.models import qwen2
from verispec.models.gemma3 import Gemma3ForCausalLM

# qwen2.CausalLM runs qwen2, llama and qwen3 (config variants); gemma3 has its own layers.
MODEL_CLASSES: dict[str, type[qwen2.CausalLM]] = {
    "qwen2": qwen2.CausalLM, "llama": qwen2.CausalLM, "qwen3": qwen2.CausalLM, "gemma3": Gemma3ForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[qwen2.CausalLM]:
    """The module class for cfg.arch (ValueError naming the architecture if verispec runs none)."""
    if cfg.arch not in MODEL_CLASSES:
        raise ValueError(f"unsupported architecture {cfg.arch!r}; verispec runs {', '.join(MODEL_CLASSES)}")
    return MODEL_CLASSES[cfg.arch]


def build_model(cfg: ModelConfig, state_dict: dict[str, torch.Tensor], device, dtype,
                modules: dict[str, torch.nn.Module] | None = None) -> qwen2.CausalLM:
    """qwen2.build_model with the architecture's class (modules: quantized layers replacing its own)."""
    return qwen2.build_model(cfg, state_dict, device, dtype, model_cls=model_class(cfg), modules=modules)
