"""Drive the bench's engines: build one around the shared model, sized for a workload, step it to completion
with per-step timing, and the small helpers the bench kinds share (greedy params, percentiles)."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
import time
from dataclasses import dataclass

import torch

from verispec.bench.hardware import StepRecord
from verispec.bench.models import BenchModel
from verispec.config import SpeculativeConfig
from verispec.core.sampling_params import RequestOutputKind, SamplingParams, with_output_kind
from verispec.engine.builder import assemble_parts
from verispec.engine.engine import LLMEngine
from verispec.loader.model_loader import DTYPES

_ids = itertools.count()


def make_engine(bm: BenchModel, spec: dict | None, max_num_seqs: int, prompt_ids: list[list[int]],
                max_tokens: list[int], draft: tuple | None = None,
                async_scheduling: bool | None = None) -> LLMEngine:
    """An engine around the shared model, with just enough KV blocks and context for this workload.

    `draft` is a preloaded (tokenizer, config, model) for a draft_model spec (loaded from its name if None);
    async_scheduling: the loop (None: the bench's setting)."""
    spec_cfg = SpeculativeConfig.from_dict(spec)
    k = spec_cfg.num_speculative_tokens if spec_cfg is not None else 0
    block = bm.setup.engine.block_size
    need = [len(p) + m + k + 2 for p, m in zip(prompt_ids, max_tokens, strict=True)]
    max_len = min(block * math.ceil(max(need) / block), bm.config.max_position_embeddings)
    per_seq = sorted((math.ceil(n / block) for n in need), reverse=True)
    blocks = sum(per_seq[:max_num_seqs]) + 16
    dtype_name = next(n for n, d in DTYPES.items() if d == bm.dtype)
    cfg = dataclasses.replace(
        bm.setup.engine, device=str(bm.device), dtype=dtype_name, max_num_seqs=max_num_seqs, max_model_len=max_len,
        num_gpu_blocks=blocks, enable_prefix_caching=False, speculative_config=spec_cfg,
        graph_capture="all",  # no capture in timed runs
    )
    if async_scheduling is not None:
        cfg = dataclasses.replace(cfg, async_scheduling=async_scheduling)
    parts = assemble_parts(cfg, bm.tokenizer, bm.model, bm.device, bm.dtype, draft_model=draft, tp=bm.tp)
    return LLMEngine(cfg, parts)


def free_memory() -> None:
    """Return freed GPU memory (a dropped engine's KV cache) to the allocator's pool before the next engine.

    The engine froze the GC at start-up (setup.freeze_gc), itself included: unfreeze first, or a dropped
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
    launches: tuple[int, int, int] = (0, 0, 0)  # its target steps that replayed one graph, two (split), ran eagerly
    preemptions: int = 0  # requests preempted for KV blocks during the run


def _spec_delta(m0: dict, m1: dict) -> dict:
    per0, per1 = m0["spec_decode_num_accepted_tokens_per_pos"], m1["spec_decode_num_accepted_tokens_per_pos"]
    per0 = per0 + [0] * (len(per1) - len(per0))
    return {
        "num_drafts": m1["spec_decode_num_drafts"] - m0["spec_decode_num_drafts"],
        "num_draft_tokens": m1["spec_decode_num_draft_tokens"] - m0["spec_decode_num_draft_tokens"],
        "num_accepted_tokens": m1["spec_decode_num_accepted_tokens"] - m0["spec_decode_num_accepted_tokens"],
        "accepted_per_pos": [b - a for a, b in zip(per0, per1, strict=True)],
        "num_request_steps": m1["spec_decode_num_request_steps"] - m0["spec_decode_num_request_steps"],
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
    if engine.policy is not None:  # every run from the same policy state: it repeats the warm-up's plans
        engine.policy.reset_population()
    m0 = engine.get_metrics()
    kinds0 = _launch_counts(engine.runner)
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
    graph, split, eager = (b - a for a, b in zip(kinds0, _launch_counts(engine.runner), strict=True))
    return RunResult(wall, steps, prompt_lens, outputs, ttft, e2e, _spec_delta(m0, m1), num_steps, ctx,
                     (graph - split, split, eager), m1["num_preemptions"] - m0["num_preemptions"])


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
    carried = 0.0  # time of steps without outputs (an admission step in the overlapped loop), added to the next
    spec, drafts0, acc0 = engine.spec, engine.spec.num_draft_tokens, engine.spec.num_accepted_tokens
    runner = engine.runner
    kinds0, tokens0 = _launch_counts(runner), engine.launched_tokens  # since the last recorded step
    while engine.has_unfinished_requests():
        ts = time.perf_counter()
        engine.planned_k = 0
        outs = engine.step()
        if per_step_sync:
            sync(device)
        now = time.perf_counter()
        if not outs:
            carried += now - ts
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
            kinds = _launch_counts(runner)
            steps.append(StepRecord(now - ts + carried, len(outs), ctx, new, prefill,
                                    spec.num_draft_tokens - drafts0, spec.num_accepted_tokens - acc0, engine.planned_k,
                                    _launch_kind(kinds0, kinds), engine.launched_tokens - tokens0))
            kinds0, tokens0 = kinds, engine.launched_tokens
            carried, drafts0, acc0 = 0.0, spec.num_draft_tokens, spec.num_accepted_tokens
    return outputs, steps, ttft, e2e


def _launch_counts(runner) -> tuple[int, int, int]:
    """The runner's (graph, split, eager) step counters (zeros for a runner without them)."""
    return (getattr(runner, "graph_steps", 0), getattr(runner, "split_steps", 0), getattr(runner, "eager_steps", 0))


def _launch_kind(before: tuple[int, int, int], after: tuple[int, int, int]) -> str:
    """How the steps launched between two _launch_counts ran (a split replay counts as a graph step too)."""
    graph, split, eager = (a - b for a, b in zip(after, before, strict=True))
    return ",".join(name for name, n in (("split", split), ("graph", graph - split), ("eager", eager)) if n > 0)


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
