"""What one `verispec train-drafter` run is asked to do: TrainOptions, every option with its default (no torch
here, so the command line parses fast)."""

from __future__ import annotations

from dataclasses import dataclass

from verispec.config import EngineConfig


@dataclass
class TrainOptions:
    target: str
    out: str
    minutes: float = 15.0
    gen_fraction: float = 0.5
    num_prompts: int = 10000
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
    max_epochs: float = 10.0  # most passes over the training sequences (0: no cap)
    val_every: int = 250  # steps between validation losses (the best weights are the ones saved)
    max_num_seqs: int = EngineConfig.max_num_seqs
    val_fraction: float = 0.03
    save_dtype: str = "bfloat16"
    feature_batch_tokens: int = 16384
    max_feature_gb: float = 80.0
    prompt_sources: str = "magpie,stdlib"
    magpie_share: float = 0.8  # of num_prompts, when magpie is mixed with stub sources
    magpie_fraction: float = 0.25  # most of the generation budget the first user turns may take
    magpie_temperature: float = 1.0
    magpie_top_p: float = 0.95
    magpie_max_tokens: int = 320
    magpie_keep_incomplete: bool = False
    multi_turn: float = 0.25  # share of the Magpie conversations that get a second user turn
    exclude_prompts: str = ""  # comma-separated prompt files kept out of training (beside the repository's)
    prompt_styles: str = "chat"
    max_stub_chars: int = 1500
    responses_per_prompt: int = 2
    extra_temperature: float = 0.7
    refill_below: float = 0.75
    max_val_prompts: int = 256
    log_every: int = 20
    sequences: str | None = None
    generate_only: bool = False
    resume: bool = False
    save_state: bool = False
    stop_after_steps: int | None = None
    stop_after_minutes: float | None = None
    state_dtype: str = "float32"
    state_shard_mib: float = 15.0
