"""The configuration chain: a model's architecture, and every engine option (type, default, help text, check)
written once, in EngineConfig and SpeculativeConfig, and validated in one place (their __post_init__)."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
# The architectures verispec runs (models/build.py maps each to its module class).
ARCHITECTURES = ("qwen2", "llama", "qwen3", "gemma3")
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
SPEC_METHODS = ("ngram", "draft_model", "self", "dflash")
QUANTIZATION_NAMES = (None, "gguf", "none")  # vLLM's names
# The commands whose flags are made from EngineConfig's fields (entrypoints/args.py).
COMMANDS = ("generate", "serve", "bench")


@dataclass
class ModelConfig:
    """Architecture of a decoder-only transformer: the Qwen2 / Llama / Qwen3 family and Gemma 3."""

    arch: str  # "qwen2" | "llama" | "qwen3" | "gemma3"
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
    # Gemma 3 (models/gemma3.py); the other architectures leave these at their defaults.
    sliding_window: int | None = None  # local layers see the last sliding_window positions (None: no local layers)
    sliding_window_pattern: int = 6  # every pattern-th layer (1-based) is global, the others local
    rope_local_theta: float = 10_000.0  # rotary base of the local layers
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (None: head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) (None: off)

    def layer_windows(self) -> list[int]:
        """Each layer's sliding window: keys at positions <= query position - window are masked (0: global)."""
        if self.sliding_window is None:
            return [0] * self.num_layers
        p = self.sliding_window_pattern
        return [0 if p > 0 and (i + 1) % p == 0 else self.sliding_window for i in range(self.num_layers)]

    @staticmethod
    def for_arch(arch: str, **kw) -> ModelConfig:
        """Defaults that differ between the family's members."""
        defaults = {
            "qwen2": dict(qkv_bias=True, qk_norm=False),
            "llama": dict(qkv_bias=False, qk_norm=False),
            "qwen3": dict(qkv_bias=False, qk_norm=True),
            "gemma3": dict(qkv_bias=False, qk_norm=True, tie_word_embeddings=True, rms_norm_eps=1e-6),
        }
        if arch not in defaults:
            raise ValueError(f"unsupported architecture {arch!r}; verispec runs {', '.join(defaults)}")
        return ModelConfig(arch=arch, **{**defaults[arch], **kw})


class UnsupportedOption(ValueError, NotImplementedError):
    """A contract option whose non-default values the engine does not implement yet (a ValueError, so the
    command line reports it like any bad value, and a NotImplementedError, which is what it is)."""


def option(default: Any, help: str, *, check: Callable[[Any], bool] | None = None, must: str | None = None,
           choices: tuple | None = None, supported: tuple | None = None,
           commands: tuple[str, ...] = COMMANDS) -> Any:
    """A config field: its default, its help text (the CLI's too), and its check.

    check(value) -> bool runs after the type check (None is let through for optional fields); `must` says what
    a good value is, for the error. A value outside `supported` (the values implemented so far) raises
    UnsupportedOption. `commands`: which of
    generate / serve / bench get a flag for it."""
    meta = dict(help=help, check=check, must=must, choices=choices, supported=supported, commands=commands)
    return field(default=default, metadata=meta)


# What a field without option() metadata gets: its type checked, no flag on any command.
_NO_META: dict[str, Any] = dict(help="", check=None, must=None, choices=None, supported=None, commands=())


def _at_least(lo: int) -> dict[str, Any]:
    """option() keywords for an integer >= lo."""
    return dict(check=lambda v: v >= lo, must=f"an integer >= {lo}")


def _is_device(v: str) -> bool:
    return v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit())


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "True or False"}


def _type_ok(value: Any, types: tuple) -> bool:
    for t in types:
        if t is type(None) and value is None:
            return True
        if t is bool and isinstance(value, bool):
            return True
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if t not in (bool, int, float, type(None)) and isinstance(value, t):
            return True
    return False


class _Checked:
    """Field-by-field validation from the fields' metadata, shared by the config classes."""

    PREFIX: ClassVar[str] = ""

    @classmethod
    def _types(cls) -> dict[str, tuple]:
        """Each field's allowed types: (int,), (int, NoneType), ... (from its annotation, once per class)."""
        if "_field_types" not in cls.__dict__:
            hints = typing.get_type_hints(cls)
            cls._field_types = {f.name: typing.get_args(hints[f.name]) or (hints[f.name],)
                                for f in dataclasses.fields(cls)}
        return cls._field_types

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def check_field(cls, name: str, value: Any) -> None:
        """Raise ValueError (UnsupportedOption for a value not implemented yet) naming the field."""
        f = cls._field(name)
        meta, types = {**_NO_META, **f.metadata}, cls._types()[name]
        optional = type(None) in types
        if meta["choices"] is not None:
            if value not in meta["choices"]:
                shown = ", ".join(repr(c) for c in meta["choices"])
                raise ValueError(f"{cls.PREFIX}{name} must be one of {shown}, got {value!r}")
        elif not (optional and value is None):
            ok = _type_ok(value, types) and (meta["check"] is None or meta["check"](value))
            if not ok:
                must = meta["must"] or " or ".join(_TYPE_WORDS.get(t, t.__name__) for t in types if t is not type(None))
                raise ValueError(f"{cls.PREFIX}{name} must be {must}{' or None' if optional else ''}, got {value!r}")
        if meta["supported"] is not None and value not in meta["supported"]:
            runs = " or ".join(repr(v) for v in meta["supported"])
            raise UnsupportedOption(f"{cls.PREFIX}{name}={value!r} is not supported yet: verispec accepts the option "
                                    f"(vLLM's name) but runs only {runs}")

    @classmethod
    def _field(cls, name: str) -> dataclasses.Field:
        for f in dataclasses.fields(cls):
            if f.name == name:
                return f
        raise KeyError(name)

    def _check_all(self) -> None:
        for name in self.field_names():
            self.check_field(name, getattr(self, name))

    @classmethod
    def help_of(cls, name: str) -> str:
        return cls._field(name).metadata.get("help", "")


@dataclass(frozen=True)
class SpeculativeConfig(_Checked):
    """vLLM-style speculative_config (frozen; checked on construction)."""

    method: str | None = option(None, "ngram | draft_model | self | dflash (left out with a model: draft_model)",
                                choices=SPEC_METHODS)
    num_speculative_tokens: int = option(4, "drafts per request per step (k)", check=lambda k: 1 <= k <= 16,
                                         must="an integer in [1, 16]")
    model: str | None = option(None, "the draft model (draft_model) or the DFlash drafter folder (dflash)")
    prompt_lookup_min: int = option(1, "ngram: shortest n-gram to look up", **_at_least(1))
    prompt_lookup_max: int = option(4, "ngram: longest n-gram to look up", **_at_least(1))
    # On by default (the contract's default): one k per step, planned from the requests' acceptance and
    # the step's cost (spec_decode/policy.py); on the H200 it is ahead of k pinned in 13 of 16 measured
    # points (docs/BENCHMARKS.md, session 9).
    adaptive: bool = option(True, "let the engine pick each step's drafts (0..k) from its requests' "
                                  "acceptance and the step's cost (false: k pinned)")

    PREFIX: ClassVar[str] = "speculative_config."
    METHODS: ClassVar[tuple[str, ...]] = SPEC_METHODS

    def __post_init__(self) -> None:
        if self.method is None and self.model:
            object.__setattr__(self, "method", "draft_model")
        if self.method is None:
            raise ValueError(f"speculative_config.method must be one of {SPEC_METHODS}, got None")
        self._check_all()
        if self.method in ("draft_model", "dflash") and not self.model:
            raise ValueError(f"speculative_config.model is required for method {self.method!r}")
        if self.method == "ngram" and self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                "speculative_config needs prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min!r}, {self.prompt_lookup_max!r}"
            )

    @staticmethod
    def from_dict(d: Mapping | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """The config of a speculative_config dict (vLLM's keys); None stays None. Unknown keys and bad
        values raise ValueError naming them."""
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = SpeculativeConfig.field_names()
        unknown = set(d) - set(known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {sorted(unknown)}; known: {sorted(known)}")
        return SpeculativeConfig(**d)


@dataclass(frozen=True)
class EngineConfig(_Checked):
    """Every engine option: the LLM constructor's keywords and the generate / serve / bench flags.

    Frozen and checked on construction: a bad value raises ValueError naming the field, before anything is
    loaded. `device`, `dtype` and `async_scheduling` may be 'auto' / None here; the engine resolves them
    (engine/builder.resolve_config), so LLM(...).config holds what actually runs."""

    model: str = option(DEFAULT_MODEL, "registry name (pulled on first use), .gguf file or Hugging Face model folder",
                        check=bool, must="a non-empty string")
    device: str = option("auto", "cpu, cuda, cuda:N or auto (cuda when torch sees a GPU)", check=_is_device,
                         must="'cpu', 'cuda', 'cuda:N' or 'auto'")
    dtype: str = option("auto", "weights and activations (auto: float32 on cpu, bfloat16 on cuda)",
                        choices=DTYPE_NAMES)
    speculative_config: SpeculativeConfig | None = option(
        None, 'speculative decoding, e.g. {"method": "ngram", "num_speculative_tokens": 4} (JSON on the '
              'command line); keys: ' + ", ".join(f.name for f in dataclasses.fields(SpeculativeConfig)),
        commands=("generate", "serve"))
    async_scheduling: bool | None = option(
        None, "overlap a step's GPU work with the next step's host work (None: on for cuda, off for cpu)")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of a prompt prefix seen before",
                                         commands=("generate", "serve"))
    max_num_seqs: int = option(256, "most sequences in one step", **_at_least(1),
                               commands=("generate", "serve"))
    max_model_len: int | None = option(None, "context length, prompt + output (None: the model's)",
                                       **_at_least(2), commands=("generate", "serve"))
    max_num_batched_tokens: int = option(2048, "most tokens in one step (prefill chunks share it)",
                                         **_at_least(1))
    block_size: int = option(16, "tokens per KV-cache block", **_at_least(1),
                             commands=("generate", "serve"))
    num_gpu_blocks: int | None = option(None, "KV-cache blocks (None: sized from free memory)",
                                        **_at_least(1), commands=("generate", "serve"))
    gpu_memory_utilization: float = option(0.85, "fraction of free GPU memory the KV cache may take",
                                           check=lambda v: 0 < v <= 1, must="a number in (0, 1]",
                                           commands=("generate", "serve"))
    seed: int = option(0, "seed of the engine's sampling and drafting")
    spec_audit_rate: float = option(0.0, "fraction of speculative steps re-verified on the host (disagreements: "
                                         "spec_decode_audit_mismatches)", check=lambda v: 0 <= v <= 1,
                                    must="a number in [0, 1]")
    enforce_eager: bool = option(False, "never run CUDA graphs (target and drafters)")
    graph_capture: str = option("lazy", "lazy: each CUDA graph on its first use; all: every shape at start-up",
                                choices=("lazy", "all"), commands=("generate", "serve"))
    gc_freeze: bool = option(True, "move everything alive once the engine is built into the GC's permanent "
                                   "generation (fewer, shorter collections while generating)")
    quantization: str | None = option(
        None, "gguf: keep a GGUF file's weights quantized (CPU: torch's int4 matmul, bf16 activations; CUDA: "
              "the GGUF kernels); none: dequantize at load to dtype (the float32 reference on CPU). None: the "
              "engine's default: gguf for GGUF files on CPU when no dtype is given, none otherwise",
        choices=QUANTIZATION_NAMES)
    tensor_parallel_size: int = option(
        1, "ranks the target is sharded over (Megatron-style, one process per rank, torch.distributed: NCCL on "
           "CUDA, gloo on CPU); must divide the model's attention and KV heads", **_at_least(1))
    data_parallel_size: int = option(
        1, "engine replicas behind one server (verispec serve; requests go to the replica with the fewest in "
           "flight); replica i runs on cuda:i on CUDA", **_at_least(1), commands=("serve",))
    distributed_timeout: float = option(
        120.0, "seconds a tensor-parallel collective waits for a rank before the engine fails (a dead or hung "
               "rank ends the engine with RankFailure instead of a hang)", check=lambda v: v > 0,
        must="a number > 0")
    batch_invariant: bool | None = option(
        None, "True (CUDA only): a request's tokens never depend on the batch, on speculation or on chunking: "
              "every linear layer, attention split and reduction in one fixed order whatever the step's shape "
              "(None: the engine's default, off)")

    def __post_init__(self) -> None:
        if not isinstance(self.speculative_config, SpeculativeConfig | None):
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
        self._check_all()

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any], caller: str = "EngineConfig()") -> EngineConfig:
        """The config of keyword arguments: TypeError naming an unknown one (with the nearest known
        name), ValueError naming a bad value."""
        known = cls.field_names()
        for name in kwargs:
            if name not in known:
                near = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise TypeError(f"{caller} got an unexpected keyword argument {name!r}{hint}")
        return cls(**kwargs)

    def as_kwargs(self) -> dict[str, Any]:
        """The fields as keyword arguments (LLM(**config.as_kwargs()) builds the same config)."""
        return {name: getattr(self, name) for name in self.field_names()}
