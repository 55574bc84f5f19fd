"""Shared bench machinery: load the model once (real or random weights), build engines around it, drive an
engine's step loop with per-step timing."""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from verispec.bench.hardware import StepRecord
from verispec.bench.prompts import Prompt
from verispec.config import EngineConfig, ModelConfig, SpeculativeConfig
from verispec.core.sampling_params import RequestOutputKind, SamplingParams, with_output_kind
from verispec.engine.builder import assemble_parts
from verispec.engine.engine import LLMEngine
from verispec.loader.model_loader import DTYPES, load_model, resolve_device_dtype
from verispec.models.qwen2 import CausalLM, build_model

BLOCK_SIZE = 16
# Shapes of the registry models' GGUF files (both keep a separate output.weight), for --random-weights
# when the file itself is not on this machine.
_QWEN2_COMMON = dict(vocab_size=151936, num_kv_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
                     max_position_embeddings=32768, tie_word_embeddings=False, bos_token_id=151643,
                     eos_token_id=151645)
REGISTRY_SHAPES: dict[str, dict] = {
    "qwen2.5-coder-0.5b-instruct": dict(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                                        head_dim=64, **_QWEN2_COMMON),
    "qwen2.5-coder-1.5b-instruct": dict(hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                                        head_dim=128, **_QWEN2_COMMON),
}
_ids = itertools.count()


@dataclass
class BenchSetup:
    """What every bench kind needs to build its engines."""

    model: str
    device: str = "auto"
    dtype: str = "auto"
    random_weights: bool = False
    model_overrides: dict | None = None  # ModelConfig fields to replace (random weights only), e.g. num_layers
    seed: int = 0
    max_num_batched_tokens: int = 2048
    async_scheduling: bool | None = None  # None: the engine's default (on for CUDA)
    spec_audit_rate: float = 0.0  # the engine's runtime acceptance audit (fraction of speculative steps)


class TokenIdTokenizer:
    """Stands in for a tokenizer when random weights run without the model file: token-id prompts only."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids: set[int] = set()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        raise ValueError("text prompts need the model's tokenizer: put the GGUF file on this machine")

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
    elem_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.elem_bytes = torch.tensor([], dtype=self.dtype).element_size()

    def encode(self, p: Prompt) -> list[int]:
        """Token ids of a bench prompt."""
        if p.token_ids is not None:
            return list(p.token_ids)
        if not self.has_tokenizer:
            raise ValueError("text prompts (HumanEval) need the tokenizer: the model's GGUF file is not here")
        return self.tokenizer.encode(p.text or "")


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
        cfg = ModelConfig.for_arch("qwen2", **REGISTRY_SHAPES[stem])
    cfg = dataclasses.replace(cfg, **(overrides or {}))
    cfg.name = name
    return cfg


def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    """A model with `cfg`'s shapes and random weights scaled to keep activations O(1), made on `device`."""
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in CausalLM(cfg).named_parameters()}
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
    device, dtype = resolve_device_dtype(setup.device, setup.dtype)
    if not setup.random_weights:
        tok, cfg, model = load_model(str(local_gguf(setup.model) or setup.model), device, dtype)
        return BenchModel(setup, tok, cfg, model, device, dtype, time.perf_counter() - t0)
    cfg = shapes_for(setup.model, setup.model_overrides)
    model = random_model(cfg, device, dtype, setup.seed)
    path = local_gguf(setup.model)
    if path is not None:
        tok, has = _gguf_tokenizer(str(path)), True
    else:
        tok, has = TokenIdTokenizer(cfg.vocab_size), False
    return BenchModel(setup, tok, cfg, model, device, dtype, time.perf_counter() - t0, has)


def load_draft(bm: BenchModel, name: str, overrides: dict | None = None) -> tuple:
    """(tokenizer, config, model) of a draft model: random weights with the draft's own shapes (plus
    `overrides`) when the target has random weights, else loaded from its file."""
    if not bm.setup.random_weights:
        return load_model(str(local_gguf(name) or name), bm.device, bm.dtype)
    cfg = shapes_for(name, overrides)
    return bm.tokenizer, cfg, random_model(cfg, bm.device, bm.dtype, bm.setup.seed + 1)


def make_engine(bm: BenchModel, spec: dict | None, max_num_seqs: int, prompt_ids: list[list[int]],
                max_tokens: list[int], draft: tuple | None = None) -> LLMEngine:
    """An engine around the shared model, with just enough KV blocks and context for this workload.

    `draft` is a preloaded (tokenizer, config, model) for a draft_model spec (loaded from its name if None)."""
    k = int((spec or {}).get("num_speculative_tokens", 4)) if spec else 0
    need = [len(p) + m + k + 2 for p, m in zip(prompt_ids, max_tokens, strict=True)]
    max_len = min(BLOCK_SIZE * math.ceil(max(need) / BLOCK_SIZE), bm.config.max_position_embeddings)
    per_seq = sorted((math.ceil(n / BLOCK_SIZE) for n in need), reverse=True)
    blocks = sum(per_seq[:max_num_seqs]) + 16
    dtype_name = next(n for n, d in DTYPES.items() if d == bm.dtype)
    cfg = EngineConfig(
        model=bm.setup.model, device=str(bm.device), dtype=dtype_name, max_num_seqs=max_num_seqs,
        max_model_len=max_len, max_num_batched_tokens=bm.setup.max_num_batched_tokens, block_size=BLOCK_SIZE,
        num_gpu_blocks=blocks, enable_prefix_caching=False,
        async_scheduling=bm.device.type == "cuda" if bm.setup.async_scheduling is None else bm.setup.async_scheduling,
        seed=bm.setup.seed, speculative_config=SpeculativeConfig.from_dict(spec),
        spec_audit_rate=bm.setup.spec_audit_rate, extra={"graph_capture": "all"},  # no capture in timed runs
    )
    from verispec.spec_decode import factory

    if draft is not None:
        factory.DRAFT_LOADER_OVERRIDE = lambda name, device, dtype: draft
    try:
        parts = assemble_parts(cfg, bm.tokenizer, bm.model, bm.device, bm.dtype)
    finally:
        factory.DRAFT_LOADER_OVERRIDE = None
    return LLMEngine(cfg, parts)


def free_memory() -> None:
    """Return freed GPU memory (a dropped engine's KV cache) to the allocator's pool before the next engine.

    The engine froze the GC at start-up (builder.freeze_gc), itself included: unfreeze first, or a dropped
    engine sitting in a reference cycle would never be collected."""
    gc.unfreeze()
    if torch.cuda.is_available():
        gc.collect()  # engines may sit in reference cycles; slow with many objects, so GPU only
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    """Wait for the GPU so a host clock reading covers the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class RunResult:
    """A workload driven to completion through engine.step()."""

    wall_s: float
    steps: list[StepRecord]  # one per step that emitted outputs (streamed runs; empty for final-only runs)
    prompt_lens: list[int]
    outputs: list[list[int]]
    ttft_s: list[float]  # streamed runs only (empty for final-only runs: no output before the last)
    e2e_s: list[float]
    spec: dict  # deltas of the engine's spec_decode_* counters over the run
    num_steps: int  # engine steps of the run
    context_tokens: int  # KV entries its steps read: sum over steps of the touched sequences' lengths


def _spec_delta(m0: dict, m1: dict) -> dict:
    per0, per1 = m0["spec_decode_num_accepted_tokens_per_pos"], m1["spec_decode_num_accepted_tokens_per_pos"]
    per0 = per0 + [0] * (len(per1) - len(per0))
    return {
        "num_drafts": m1["spec_decode_num_drafts"] - m0["spec_decode_num_drafts"],
        "num_draft_tokens": m1["spec_decode_num_draft_tokens"] - m0["spec_decode_num_draft_tokens"],
        "num_accepted_tokens": m1["spec_decode_num_accepted_tokens"] - m0["spec_decode_num_accepted_tokens"],
        "accepted_per_pos": [b - a for a, b in zip(per0, per1, strict=True)],
    }


def context_reads(prompt_len: int, output_len: int) -> int:
    """KV entries a sequence's steps read when each step adds one token: (p + 1) + ... + (p + o)."""
    return output_len * prompt_len + output_len * (output_len + 1) // 2


def drive(engine: LLMEngine, prompt_ids: list[list[int]], params: list[SamplingParams],
          device: torch.device, stream: bool = True) -> RunResult:
    """Submit every prompt at once, then step until all finish.

    stream=True asks for CUMULATIVE outputs (every step's state, what the server streams) and times each
    step. A synchronous engine's steps are then timed with the GPU synchronized after each. An async-
    scheduling engine overlaps step N on the GPU with step N-1's host work, so a sync per step would defeat
    what it measures: there a step's time is the host's pace (which the GPU bounds in steady state) and
    only the end syncs.

    stream=False asks for FINAL_ONLY outputs, as LLM.generate does: one output per request, when it
    finishes; the loop only steps (no per-step timing or sync). Its step count is the engine's, and its KV
    reads are counted from the final token counts (context_reads: one token per sequence per step, so no
    speculation), which equals the streamed count when every prompt is prefilled in one step."""
    if not stream and engine.proposer is not None:
        raise ValueError("final-only runs count one token per sequence per step: no speculation")
    kind = RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY
    params = with_output_kind(params, kind)
    rids = [f"bench-{next(_ids)}" for _ in prompt_ids]
    index = {r: i for i, r in enumerate(rids)}
    m0 = engine.get_metrics()
    sync(device)
    t0 = time.perf_counter()
    for rid, ids, sp in zip(rids, prompt_ids, params, strict=True):
        engine.add_request(rid, None, sp, ids)
    loop = _stream_loop if stream else _final_loop
    outputs, steps, ttft, e2e = loop(engine, index, t0, device)
    sync(device)
    wall = time.perf_counter() - t0
    m1 = engine.get_metrics()
    prompt_lens = [len(p) for p in prompt_ids]
    if stream:
        num_steps, ctx = len(steps), sum(s.context_tokens for s in steps)
    else:
        num_steps = m1["num_steps"] - m0["num_steps"]
        ctx = sum(context_reads(p, len(o)) for p, o in zip(prompt_lens, outputs, strict=True))
    return RunResult(wall, steps, prompt_lens, outputs, ttft, e2e, _spec_delta(m0, m1), num_steps, ctx)


def _check_progress(idle: int) -> None:
    if idle > 1000:
        raise RuntimeError("engine makes no progress (KV blocks too few?)")


def _stream_loop(engine: LLMEngine, index: dict[str, int], t0: float, device: torch.device) -> tuple:
    """Step with CUMULATIVE outputs: (outputs, steps, ttft, e2e), a StepRecord per step with outputs."""
    per_step_sync = not engine.config.async_scheduling
    n = len(index)
    outputs: list[list[int]] = [[] for _ in range(n)]
    ttft, e2e = [0.0] * n, [0.0] * n
    steps: list[StepRecord] = []
    idle = 0
    while engine.has_unfinished_requests():
        ts = time.perf_counter()
        outs = engine.step()
        if per_step_sync:
            sync(device)
        now = time.perf_counter()
        idle = 0 if outs else idle + 1
        _check_progress(idle)
        ctx = new = 0
        prefill = False
        for o in outs:
            i = index[o.request_id]
            toks = o.outputs[0].token_ids
            prefill |= not outputs[i]
            if toks and not outputs[i]:
                ttft[i] = now - t0
            new += len(toks) - len(outputs[i])
            ctx += len(o.prompt_token_ids) + len(toks)
            outputs[i] = toks  # a fresh list in every output: no copy needed
            if o.finished:
                e2e[i] = now - t0
        if outs:
            steps.append(StepRecord(now - ts, len(outs), ctx, new, prefill))
    return outputs, steps, ttft, e2e


def _final_loop(engine: LLMEngine, index: dict[str, int], t0: float, device: torch.device) -> tuple:
    """Step with FINAL_ONLY outputs: (outputs, [], [], e2e); only finished requests come back."""
    n = len(index)
    outputs: list[list[int]] = [[] for _ in range(n)]
    e2e = [0.0] * n
    idle, last = 0, engine.num_steps
    while engine.has_unfinished_requests():
        outs = engine.step()
        if outs:
            now = time.perf_counter()
            for o in outs:
                i = index[o.request_id]
                outputs[i] = o.outputs[0].token_ids
                e2e[i] = now - t0
        idle = 0 if outs or engine.num_steps != last else idle + 1
        last = engine.num_steps
        _check_progress(idle)
    return outputs, [], [], e2e


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy sampling that runs to max_tokens (no EOS stop): every method and peer emits the same count."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))]
