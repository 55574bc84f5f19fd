"""Model, engine and speculative configuration."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    """Architecture of a decoder-only transformer in the Qwen2 / Llama / Qwen3 family."""

    arch: str  # "qwen2" | "llama" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    qkv_bias: bool = True  # Qwen2: True; Llama / Qwen3: False
    qk_norm: bool = False  # Qwen3: True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = ""

    @staticmethod
    def for_arch(arch: str, **kw) -> ModelConfig:
        """Defaults that differ between the family's members."""
        defaults = {
            "qwen2": dict(qkv_bias=True, qk_norm=False),
            "llama": dict(qkv_bias=False, qk_norm=False),
            "qwen3": dict(qkv_bias=False, qk_norm=True),
        }
        if arch not in defaults:
            raise ValueError(f"unsupported architecture {arch!r}; verispec runs qwen2, llama and qwen3")
        return ModelConfig(arch=arch, **{**defaults[arch], **kw})


@dataclass
class SpeculativeConfig:
    """vLLM-style speculative_config."""

    method: str  # "ngram" | "draft_model" | "self" | "dflash"
    num_speculative_tokens: int = 4
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    METHODS = ("ngram", "draft_model", "self", "dflash")

    @staticmethod
    def from_dict(d: dict | None) -> SpeculativeConfig | None:
        if d is None:
            return None
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {"method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {sorted(unknown)}; known: {sorted(known)}")
        method = d.get("method")
        if method is None and d.get("model"):
            method = "draft_model"
        if method not in SpeculativeConfig.METHODS:
            raise ValueError(f"speculative_config.method must be one of {SpeculativeConfig.METHODS}, got {method!r}")
        cfg = SpeculativeConfig(method=method, **{k: v for k, v in d.items() if k != "method"})
        k = cfg.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        if method in ("draft_model", "dflash") and not cfg.model:
            raise ValueError(f"speculative_config.model is required for method {method!r}")
        if method == "ngram":
            lo, hi = cfg.prompt_lookup_min, cfg.prompt_lookup_max
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError(
                    f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r}, {hi!r}"
                )
        return cfg


@dataclass
class EngineConfig:
    """Engine options (the LLM constructor's arguments after resolution)."""

    model: str
    device: str = "cpu"
    dtype: str = "float32"
    max_num_seqs: int = 256
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_gpu_blocks: int | None = None  # None: sized from memory
    gpu_memory_utilization: float = 0.85
    enable_prefix_caching: bool = True
    async_scheduling: bool = False
    seed: int = 0
    speculative_config: SpeculativeConfig | None = None
    spec_audit_rate: float = 0.0
    extra: dict = field(default_factory=dict)
