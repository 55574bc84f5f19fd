"""The bench's target and draft models, loaded once per run: from their files, or with --random-weights as
random weights in the model's exact shapes (its GGUF metadata when local, else a table)."""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from verispec.bench.prompts import Prompt
from verispec.config import EngineConfig, ModelConfig
from verispec.engine.builder import default_quantization
from verispec.loader.model_loader import load_model, resolve_device_dtype
from verispec.models.build import build_model, model_class
from verispec.models.qwen2 import CausalLM

# Shapes of the registry models' GGUF files (the Qwen ones keep a separate output.weight), for
# --random-weights when the file itself is not on this machine; "arch" defaults to qwen2.
_QWEN2_COMMON = dict(vocab_size=151936, num_kv_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
                     max_position_embeddings=32768, tie_word_embeddings=False, bos_token_id=151643,
                     eos_token_id=151645)
REGISTRY_SHAPES: dict[str, dict] = {
    "qwen2.5-coder-0.5b-instruct": dict(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                                        head_dim=64, **_QWEN2_COMMON),
    "qwen2.5-coder-1.5b-instruct": dict(hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                                        head_dim=128, **_QWEN2_COMMON),
    "gemma-3-270m": dict(arch="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18,
                         num_heads=4, num_kv_heads=1, head_dim=256, rope_theta=1e6, rope_local_theta=1e4,
                         sliding_window=512, sliding_window_pattern=6, max_position_embeddings=32768,
                         bos_token_id=2, eos_token_id=1),
}


@dataclass(frozen=True)
class BenchSetup:
    """What every bench kind needs to build its engines: the engine options they start from (model, device,
    dtype, seed, async_scheduling, spec_audit_rate, ...; drive.make_engine sizes the rest per workload) and
    where the weights come from."""

    engine: EngineConfig
    random_weights: bool = False
    model_overrides: dict | None = None  # ModelConfig fields to replace (random weights only), e.g. num_layers

    @property
    def model(self) -> str:
        return self.engine.model

    @property
    def seed(self) -> int:
        return self.engine.seed


class TokenIdTokenizer:
    """Stands in for a tokenizer when random weights run without the model file: token-id prompts only."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids: set[int] = set()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        raise ValueError("text prompts need the model's tokenizer: put the GGUF file on this machine")

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""

    def convert_ids_to_tokens(self, ids):
        return [str(i) for i in ids] if isinstance(ids, list) else str(ids)


@dataclass
class BenchModel:
    """The target model, loaded once per bench run and shared by its engines."""

    setup: BenchSetup
    tokenizer: object
    config: ModelConfig
    model: CausalLM
    device: torch.device
    dtype: torch.dtype
    load_seconds: float
    has_tokenizer: bool = True
    quantization: str = "none"
    elem_bytes: int = field(init=False)
    # tensor_parallel_size > 1: the rank processes `model` (rank 0's shard) was sharded with; every engine
    # of the run is assembled over them (drive.make_engine).
    tp: object = None
    weight_bytes: int = field(init=False)  # the weights as held (quantized or dense)
    step_weight_bytes: int = field(init=False)  # what one decode step reads of them

    def __post_init__(self) -> None:
        from verispec.models.layers.quant import step_weight_nbytes, weight_nbytes

        self.elem_bytes = torch.tensor([], dtype=self.dtype).element_size()
        self.weight_bytes = weight_nbytes(self.model)
        self.step_weight_bytes = step_weight_nbytes(self.model)

    def encode(self, p: Prompt) -> list[int]:
        """Token ids of a bench prompt (text: as the engine encodes a prompt, BOS in front where the model
        wants one, e.g. Gemma)."""
        if p.token_ids is not None:
            return list(p.token_ids)
        if not self.has_tokenizer:
            raise ValueError("text prompts (HumanEval) need the tokenizer: the model's GGUF file is not here")
        return self.tokenizer.encode_prompt(p.text or "")


def local_gguf(name: str) -> Path | None:
    """A GGUF file for `name` already on this machine (a path, the model cache, or /tmp/models), never pulled."""
    from verispec.loader.registry import models_dir, stage_cache_dir

    stem = Path(name).name.removesuffix(".gguf")
    for cand in (Path(name).expanduser(), models_dir() / f"{stem}.gguf", stage_cache_dir() / f"{stem}.gguf",
                 Path("/tmp/models") / f"{stem}.gguf"):
        if cand.is_file():
            return cand
    return None


@functools.cache
def _gguf_config(path: str) -> ModelConfig:
    from verispec.loader.gguf import GGUFFile, model_config_from_metadata

    f = GGUFFile(path)
    return model_config_from_metadata(f.metadata, tensor_names=f.tensors.keys(), source=f.path)


@functools.cache
def _gguf_tokenizer(path: str):
    from verispec.loader.tokenizer import Tokenizer

    return Tokenizer.from_gguf(path)


def shapes_for(name: str, overrides: dict | None = None) -> ModelConfig:
    """The model's exact shapes (from its GGUF metadata when local, else the table), with overrides applied."""
    path = local_gguf(name)
    if path is not None:
        cfg = dataclasses.replace(_gguf_config(str(path)))
    else:
        stem = Path(name).name.removesuffix(".gguf")
        if stem not in REGISTRY_SHAPES:
            raise ValueError(f"no shapes known for {name!r}: use one of {sorted(REGISTRY_SHAPES)} or a local GGUF")
        shapes = dict(REGISTRY_SHAPES[stem])
        cfg = ModelConfig.for_arch(shapes.pop("arch", "qwen2"), **shapes)
    return dataclasses.replace(cfg, **(overrides or {}), name=name)


def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    """A model with `cfg`'s shapes and random weights scaled to keep activations O(1), made on `device`."""
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in model_class(cfg)(cfg).named_parameters()}
    sd = {}
    for n, shape in shapes.items():
        if n.endswith("norm.weight"):
            t = torch.ones(shape, device=device, dtype=dtype)
        elif n.endswith("bias"):
            t = 0.02 * torch.randn(shape, generator=g, device=device, dtype=dtype)
        else:
            std = 1.0 if "embed" in n else shape[-1] ** -0.5
            t = torch.randn(shape, generator=g, device=device, dtype=dtype) * std
        sd[n] = t
    return build_model(cfg, sd, device, dtype)


def load_bench_model(setup: BenchSetup) -> BenchModel:
    """Load (or, with random weights, make) the target model and its tokenizer."""
    t0 = time.perf_counter()
    name = setup.model
    device, dtype = resolve_device_dtype(setup.engine.device, setup.engine.dtype)
    if setup.engine.tensor_parallel_size > 1:
        return _load_tensor_parallel(setup, device, dtype, t0)
    if not setup.random_weights:
        path = str(local_gguf(name) or name)
        quant = setup.engine.quantization or default_quantization(path, device)
        tok, cfg, model = load_model(path, device, dtype, quantization=quant)
        return BenchModel(setup, tok, cfg, model, device, dtype, time.perf_counter() - t0, quantization=quant)
    if setup.engine.quantization == "gguf":
        raise ValueError("quantization='gguf' needs a model's real GGUF weights, not --random-weights")
    cfg = shapes_for(name, setup.model_overrides)
    model = random_model(cfg, device, dtype, setup.seed)
    path = local_gguf(name)
    if path is not None:
        tok, has = _gguf_tokenizer(str(path)), True
    else:
        tok, has = TokenIdTokenizer(cfg.vocab_size), False
    return BenchModel(setup, tok, cfg, model, device, dtype, time.perf_counter() - t0, has)


def _load_tensor_parallel(setup: BenchSetup, device: torch.device, dtype: torch.dtype, t0: float) -> BenchModel:
    """The target sharded over tensor_parallel_size rank processes (real weights only: the other ranks
    load the same file)."""
    from verispec.distributed.group import TensorParallelGroup
    from verispec.distributed.shard import shard_model
    from verispec.engine.builder import check_tensor_parallel_config

    if setup.random_weights:
        raise ValueError("--tensor-parallel-size > 1 runs real weights only (every rank loads the model file); "
                         "drop --random-weights")
    config = dataclasses.replace(setup.engine, model=str(local_gguf(setup.model) or setup.model))
    check_tensor_parallel_config(config)
    group = TensorParallelGroup(config)
    try:
        tok, cfg, model = load_model(config.model, device, dtype)
        shard_model(model, group.comm)
    except BaseException:
        group.shutdown()
        raise
    return BenchModel(setup, tok, cfg, model, device, dtype, time.perf_counter() - t0, tp=group)


def load_draft(bm: BenchModel, name: str, overrides: dict | None = None) -> tuple:
    """(tokenizer, config, model) of a draft model: random weights with the draft's own shapes (plus
    `overrides`) when the target has random weights, else loaded from its file."""
    if not bm.setup.random_weights:
        return load_model(str(local_gguf(name) or name), bm.device, bm.dtype)
    cfg = shapes_for(name, overrides)
    return bm.tokenizer, cfg, random_model(cfg, bm.device, bm.dtype, bm.setup.seed + 1)
