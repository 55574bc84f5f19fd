"""What one `verispec train-drafter` run is asked to do: TrainOptions, every option with its default (no torch
here, so the command line parses fast)."""

from __future__ import annotations

from dataclasses import dataclass

from verispec.config import EngineConfig


@dataclass
class TrainOptions:
    target: str
    out: str
    minutes: float = 20.0
    gen_fraction: float = 0.45
    num_prompts: int = 5000
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    device: str = EngineConfig.device
    block_size: int = 16
    layers: int = 2
    target_layers: int = 5
    seed: int = EngineConfig.seed
    temperature: float = 0.0
    batch_seqs: int = 32
    anchors: int = 16
    lr: float = 6e-4
    warmup: int = 100
    ckpt_every: int = 500
    max_steps: int | None = None
    max_num_seqs: int = EngineConfig.max_num_seqs
    val_fraction: float = 0.03
    save_dtype: str = "bfloat16"
    feature_batch_tokens: int = 16384
    max_feature_gb: float = 60.0
    prompt_sources: str = "stdlib"
    prompt_styles: str = "chat"
    max_stub_chars: int = 1500
    responses_per_prompt: int = 1
    extra_temperature: float = 0.7
    refill_below: float = 0.75
    max_val_prompts: int = 256
    log_every: int = 20
    sequences: str | None = None
    generate_only: bool = False
    resume: bool = False
    save_state: bool = False
