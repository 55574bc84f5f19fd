"""Build an engine's parts from its config: weights, tokenizer, model, KV blocks, runner, proposer."""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from verispec.config import EngineConfig, ModelConfig
from verispec.core.faults import NO_FAULTS, Faults
from verispec.engine.kv_blocks import BlockManager
from verispec.loader.model_loader import (
    DTYPES,
    is_gguf_model,
    kv_bytes_per_block,
    load_model,
    resolve_device_dtype,
)
from verispec.loader.tokenizer import Tokenizer
from verispec.models.qwen2 import CausalLM
from verispec.spec_decode.cost import StepCost
from verispec.spec_decode.proposer import Proposer
from verispec.worker.runner import ModelRunner

if TYPE_CHECKING:
    from verispec.distributed.group import TensorParallelGroup

log = logging.getLogger("verispec")

@dataclass
class EngineParts:
    tokenizer: Tokenizer
    model_config: ModelConfig
    model: CausalLM
    max_model_len: int
    blocks: BlockManager
    runner: ModelRunner
    proposer: Proposer | None
    load_seconds: float
    faults: Faults = NO_FAULTS
    # What a step costs, for adaptive speculation (None: no speculation, or adaptive off).
    step_cost: StepCost | None = None
    # Tensor parallelism: the rank processes and their collectives (None: one device).
    tp: TensorParallelGroup | None = None


# Prefill query lengths the target's graphs are captured for (lazily, at first use), at the batch sizes whose
# padded step has at most PREFILL_GRAPH_TOKENS tokens: so (1, 2048), (2, 1024), (4, 512) as well as (128, 16).
# Past 256 (session 20's H100 traces, ngram at batch 64): one prompt chunk of 261-958 tokens beside the decode
# rows ran eagerly (13.5 ms a step) where split replays of <= 320 chunk tokens took 4.7 ms. The lengths past
# 256 add no buffer: the largest shape (b * q) stays the budget.
PREFILL_GRAPH_LENS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
PREFILL_GRAPH_TOKENS = 2048


def verify_query_lens(k: int, adaptive: bool) -> tuple[int, ...]:
    """Query lengths the verify graphs are captured for: 1 + j for every j <= k (adaptive: the policy plans
    any j), or 1 and 1 + k (k pinned)."""
    return tuple(range(1, k + 2)) if adaptive else (1, 1 + k)


def size_kv_blocks(config: EngineConfig, per_block: int, device: torch.device, max_model_len: int) -> int:
    """Blocks for the KV cache: the configured count, else what memory allows (GPU: a fraction of
    free memory; CPU: enough for max_num_seqs full contexts, capped at 4 GiB)."""
    if config.num_gpu_blocks is not None:
        return config.num_gpu_blocks
    want = -(-max_model_len // config.block_size) * min(config.max_num_seqs, 64)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(16, min(int(free * config.gpu_memory_utilization) // per_block, want * 4))
    return max(16, min(want, (4 << 30) // per_block))


def resolve_config(config: EngineConfig) -> EngineConfig:
    """The config with what 'auto' and None stand for on this machine: the device ('auto': cuda if torch
    sees a GPU), the dtype ('auto': float32 on cpu, bfloat16 on cuda) and async_scheduling (None: on for
    cuda). Raises ValueError for a device this machine lacks."""
    dev, dt = resolve_device_dtype(config.device, config.dtype)
    check_batch_invariant(config, dev)
    dtype = next(name for name, d in DTYPES.items() if d == dt)
    async_scheduling = dev.type == "cuda" if config.async_scheduling is None else config.async_scheduling
    device = dev.type if dev.index is None else str(dev)
    quantization = config.quantization or default_quantization(config.model, dev, config.dtype,
                                                               config.tensor_parallel_size)
    return dataclasses.replace(config, device=device, dtype=dtype, async_scheduling=async_scheduling,
                               quantization=quantization)


def default_quantization(model: str, device: torch.device, dtype: str = "auto", tensor_parallel_size: int = 1) -> str:
    """What quantization=None means: "gguf" for a GGUF model (a registry name or a .gguf file) on the CPU
    where torch runs the int4 matmul correctly (checked once), unless a dtype was asked for (an explicit
    dtype, float32 say, asks for the dequantized path in that dtype: the float32 reference) or the model is
    sharded; "none" otherwise (on CUDA the bf16 path stays the default until the GGUF kernels are measured
    faster)."""
    if device.type != "cpu" or not is_gguf_model(model) or dtype not in (None, "auto") or tensor_parallel_size > 1:
        return "none"
    from verispec.loader.cpu_pack import cpu_int4_available

    return "gguf" if cpu_int4_available() else "none"


def check_batch_invariant(config: EngineConfig, device: torch.device | str) -> None:
    """batch_invariant=True needs the CUDA kernels: the CPU path is plain torch, whose matmuls pick their
    kernels by shape (ValueError naming the option)."""
    if config.batch_invariant and torch.device(device).type != "cuda":
        raise ValueError(f"batch_invariant=True needs CUDA (its kernels are the Triton ones); device is {device}")


def freeze_gc() -> float:
    """Collect, then move every object alive now (modules, model, tokenizer, engine) into the GC's
    permanent generation, so the collections a generate loop triggers no longer traverse them; returns
    the seconds it took.

    Objects frozen here are reference-counted as usual; only cyclic garbage among them waits: earlier
    frozen objects are unfrozen first, so a dropped engine sitting in a reference cycle is collected
    when the next engine is built (or by gc.unfreeze() + gc.collect(), as the benches do)."""
    t0 = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    secs = time.perf_counter() - t0
    log.debug("gc.freeze after start-up: %d objects frozen in %.0f ms", gc.get_freeze_count(), 1e3 * secs)
    return secs


def build_engine_parts(config: EngineConfig, faults: Faults = NO_FAULTS) -> EngineParts:
    """Load the model named in config (resolved: resolve_config) and assemble everything around it
    (tensor_parallel_size > 1: rank 0's shard here, after starting the other ranks)."""
    t0 = time.monotonic()
    device, dtype = resolve_device_dtype(config.device, config.dtype)
    if config.tensor_parallel_size > 1:
        if config.quantization == "gguf":
            raise ValueError("quantization='gguf' does not run with tensor_parallel_size > 1 yet; "
                             "use quantization='none'")
        return _build_tensor_parallel(config, faults, device, dtype, t0)
    tok, cfg, model = load_model(config.model, device, dtype, quantization=config.quantization)
    return assemble_parts(config, tok, model, device, dtype, t0, faults)


# Speculative methods that run with tensor parallelism: the drafter runs on rank 0 only, unsharded
# ("self" and dflash run or read the sharded target itself: not wired yet).
TP_METHODS = ("ngram", "draft_model")


def check_tensor_parallel_config(config: EngineConfig) -> None:
    """ValueError for what tensor_parallel_size > 1 does not run, before anything loads: a speculative
    method outside TP_METHODS, data parallelism on top, and a model whose heads (or KV heads, or MLP
    width) the size does not divide (its config is read, not its weights)."""
    from verispec.distributed.shard import check_tensor_parallel
    from verispec.loader.model_loader import read_config

    n = config.tensor_parallel_size
    spec = config.speculative_config
    if spec is not None and spec.method not in TP_METHODS:
        raise ValueError(f"tensor_parallel_size={n} runs speculative methods {' and '.join(TP_METHODS)}, "
                         f"not {spec.method!r}")
    if config.data_parallel_size > 1:
        raise ValueError("tensor_parallel_size > 1 with data_parallel_size > 1 is not supported yet")
    check_tensor_parallel(read_config(config.model), n)


def _build_tensor_parallel(config: EngineConfig, faults: Faults, device, dtype, t0: float) -> EngineParts:
    from verispec.distributed.group import TensorParallelGroup  # (torch.distributed only when TP runs)
    from verispec.distributed.shard import shard_model

    check_tensor_parallel_config(config)
    group = TensorParallelGroup(config)
    try:
        tok, cfg, model = load_model(config.model, device, dtype)
        shard_model(model, group.comm)
        return assemble_parts(config, tok, model, device, dtype, t0, faults, tp=group)
    except BaseException:
        group.shutdown()
        raise


def assemble_parts(config: EngineConfig, tok, model: CausalLM, device, dtype, t0: float | None = None,
                   faults: Faults | None = None, draft_model: tuple | None = None,
                   step_cost: StepCost | None = None, tp: TensorParallelGroup | None = None) -> EngineParts:
    """KV blocks, runner and proposer around an already built model (tests and benches pass theirs).
    faults None: read from the environment now (Faults.from_env). draft_model: the (tokenizer, ModelConfig,
    CausalLM) a draft_model speculative_config drafts with, instead of loading its `model`. step_cost:
    the cost model of adaptive speculation (None: measured / analytic, spec_decode/measure.py). tp: the
    tensor-parallel group `model` was sharded over (rank 0's part; the other ranks get the KV block
    count and graph options from here, and start-up waits until they are ready)."""
    faults = Faults.from_env() if faults is None else faults
    t0 = time.monotonic() if t0 is None else t0
    cfg = model.config
    if tp is not None and (config.tensor_parallel_size != tp.world_size or getattr(model, "tp", None) is not tp.comm):
        raise ValueError(f"tp: a model sharded over this group and tensor_parallel_size={tp.world_size} are needed, "
                         f"got tensor_parallel_size={config.tensor_parallel_size}")
    if config.max_model_len is not None and config.max_model_len > cfg.max_position_embeddings:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's context {cfg.max_position_embeddings}"
        )
    max_model_len = config.max_model_len or cfg.max_position_embeddings
    check_batch_invariant(config, device)
    if torch.device(device).type == "cuda":  # before the proposer: a draft model takes the target's kernel options
        from verispec.models.kernel_path import use_batch_invariant

        use_batch_invariant(model, bool(config.batch_invariant))
    from verispec.spec_decode.factory import build_proposer  # local: spec pulls in draft models

    draft_loader = None if draft_model is None else (lambda name, device, dtype: draft_model)
    proposer, draft_per_block = build_proposer(config, model, tok, device, dtype, max_model_len,
                                               draft_loader=draft_loader)
    if proposer is not None:
        proposer.faults = faults
    # (With TP each rank holds 1/N of the target's KV heads; rank 0 also the drafter's cache.)
    per_block = kv_bytes_per_block(cfg, config.block_size, dtype) // (tp.world_size if tp else 1) + draft_per_block
    num_blocks = size_kv_blocks(config, per_block, device, max_model_len)
    use_graphs = device.type == "cuda" and not config.enforce_eager
    # With CUDA graphs the cache's last block is reserved as the graphs' scratch block.
    blocks = BlockManager(num_blocks - int(use_graphs), config.block_size, config.enable_prefix_caching)
    # A single request must always fit alone (with its drafts), or it could never finish.
    max_model_len = min(max_model_len, blocks.num_blocks * config.block_size)
    capture = proposer.capture_layers if proposer is not None else ()
    graph_options = None
    if use_graphs:
        # Decode shapes (1 query) and, with speculation, verify shapes of every 1 + j queries, j <= k
        # (adaptive speculation plans fewer drafts than k; a step pads to its largest j).
        spec = config.speculative_config
        query_lens = (1,) if spec is None else verify_query_lens(spec.num_speculative_tokens, spec.adaptive)
        graph_options = dict(
            max_batch=min(config.max_num_seqs, 256), query_lens=query_lens,
            # Admission steps (a prompt chunk beside decode rows) replay a graph padded to a prefill
            # length where the step stays within PREFILL_GRAPH_TOKENS (graphs.py), instead of running
            # eagerly: ~15-30 ms of launches for the 1.5B on the H200 against ~1-5 ms padded.
            prefill_lens=PREFILL_GRAPH_LENS, prefill_max_tokens=PREFILL_GRAPH_TOKENS,
            max_blocks_per_seq=-(-max_model_len // config.block_size),
            # With TP every rank captures a shape at the same step (its collectives are in the graph).
            lazy=config.graph_capture == "lazy" or tp is not None,
        )
    runner = ModelRunner(model, num_blocks, config.block_size, device, dtype, config.seed, capture,
                         config.spec_audit_rate, graph_options, faults, tp=tp.comm if tp is not None else None)
    if tp is not None:
        tp.comm.send_setup(dict(num_blocks=num_blocks, block_size=config.block_size, graph_options=graph_options))
    if proposer is not None:
        proposer.bind(num_blocks, config.block_size, max_model_len)
    if proposer is None or not config.speculative_config.adaptive:
        step_cost = None
    elif step_cost is None:
        from verispec.spec_decode.measure import build_step_cost

        # (With TP analytic: timing the target's graphs would run rank 0 alone.)
        step_cost = build_step_cost(model, proposer, runner, device, measure=False if tp is not None else None)
    secs = time.monotonic() - t0
    log.info("engine ready in %.1fs: %d KV blocks of %d tokens", secs, num_blocks, config.block_size)
    return EngineParts(tok, cfg, model, max_model_len, blocks, runner, proposer, secs, faults, step_cost, tp)
