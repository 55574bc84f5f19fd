"""The step cost an engine's speculation policy uses (cost.ModeledStepCost): measured on CUDA, analytic
elsewhere.

CUDA with graphs: the target's forward is *measured* at start-up, per captured shape: for the captured
batch sizes among 1, 4, 16, 64, 256 (and the largest), at the captured query lengths among 1, 2, 3, 5,
9, 17 (and the largest: the ShapeTable interpolates the others),
a few replays of the graph over padding rows only (their K/V go to the scratch block), the median time
of each (a ShapeTable). A draft model's forward (draft_model) is measured the same way on its own
graphs; "self" reuses the target's table; a DFlash drafting step is timed whole per batch size
(its host preparation, context write, drafter and LM head: DFlashStepRunner.time_steps, a BatchTable; it
was priced as the target's forward scaled by the drafter's share of the layers, which missed its LM head
over every draft row and its host work, and so drafted where drafting lost). Times are rounded to a grid of 2^(1/16) (~4%),
so that engines built alike on one GPU usually get one table (the sync / async parity runs build two).

CPU, and CUDA without graphs: an *analytic* default (DFlash: the target's scaled by the layer share), LinearForward from the model's parameter count
and bytes and assumed device rates (DeviceRates): a forward costs launches per layer plus one read of
the weights, plus the matmul FLOPs of its tokens. It is deterministic, so two engines built alike decide
alike (the CPU parity gates compare separately built engines); it does not know the machine's speed,
only the shape of the cost, which is what the policy's comparisons need.

Host work of a step with drafts (both): an assumed constant plus a constant per sequence, and per drafter
forward the same; of a plain step: a constant per sequence, which is the step's cost where it exceeds the
forward's (DeviceRates; the CUDA figures are from the H200's step traces; CPU: none, the CPU gates'
decisions stay as they were).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from verispec.spec_decode.cost import (
    AUTOREGRESSIVE,
    BLOCK,
    HOST,
    BatchTable,
    ForwardCost,
    LinearForward,
    ModeledStepCost,
    ScaledForward,
    ShapeTable,
)

MEASURED_BATCHES = (1, 4, 16, 64, 256)
MEASURED_QUERY_LENS = (1, 2, 3, 5, 9, 17)


@dataclass(frozen=True)
class DeviceRates:
    """Assumed rates of a device kind, for the analytic costs and the host overhead."""

    mem_bytes_per_s: float
    flops_per_s: float
    launch_per_layer: float  # seconds of kernel launches / Python per layer and forward
    host_per_step: float  # the engine's host work per step with drafts (which the device waits for)
    host_per_seq: float  # ... and per sequence in it
    ngram_per_request: float  # one prompt-lookup on the host
    draft_forward_host: float  # host work of one drafter forward (inputs, launch)
    draft_forward_host_per_seq: float  # ... and per drafting sequence
    loop_per_seq: float = 0.0  # the host work per sequence of any step (bounds a plain step from below)


# CPU host figures: scripts/host_overhead.py's tiny model (an ngram step's host work over a decode step's).
CPU_RATES = DeviceRates(20e9, 1e11, 150e-6, 0.1e-3, 20e-6, 20e-6, 50e-6, 5e-6)
# Host figures: the H200's step traces. A step with drafts leaves the GPU idle for ~0.55 ms + 70 us per
# sequence (session 9's traces gave 25 us per sequence; session 16's HumanEval-chat ngram steps cost 3.9 /
# 8.7 ms at batch 16 / 64 against 3.07 / 5.76 modeled with 25, i.e. ~45 us more per sequence); a draft
# model's step adds ~65 us + 13 us per sequence per draft forward; a plain step at batch 64 takes 2.6 ms
# against a 1.72 ms forward: the overlapped loop's host work is ~40 us per sequence (docs/BENCHMARKS.md,
# session 16).
CUDA_RATES = DeviceRates(3e12, 4e14, 150e-6, 0.55e-3, 70e-6, 5e-6, 65e-6, 13e-6, loop_per_seq=40e-6)


def analytic_forward(model: torch.nn.Module, rates: DeviceRates, num_layers: int) -> LinearForward:
    """A forward of `model`: launches + one weight read, plus 2 FLOPs per parameter and token."""
    from verispec.models.layers.quant import QuantLinear, weight_nbytes

    # quantized layers (quantization="gguf") hold their weights outside the parameters
    params = sum(p.numel() for p in model.parameters()) + sum(
        m.in_features * m.out_features for m in model.modules() if isinstance(m, QuantLinear))
    nbytes = weight_nbytes(model)
    return LinearForward(rates.launch_per_layer * (num_layers + 1) + nbytes / rates.mem_bytes_per_s,
                         2.0 * params / rates.flops_per_s)


def _rounded(seconds: float) -> float:
    """seconds on a grid of 2^(1/16)."""
    if seconds <= 0:
        return 0.0
    return 2.0 ** (round(16 * math.log2(seconds)) / 16)


def measure_graphs(graphs, reps: int = 5) -> ShapeTable:
    """Time replays of a CudaGraphRunner's shapes (capturing the measured ones if they are lazy): the
    median of `reps` replays each, the device synchronized around each (a runner with capture=False
    times its eager padded forward the same way, on any device)."""
    dev = graphs.input_ids.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda *_: None)
    sizes = graphs.batch_sizes
    batches = sorted({b for b in sizes if b in MEASURED_BATCHES} | {sizes[-1]})
    qs = graphs.query_lens
    times = {}
    for q in sorted({q for q in qs if q in MEASURED_QUERY_LENS} | {qs[0], qs[-1]}):
        for b in batches:
            graphs.replay_padding(b, q)  # capture + warm up
            sync(dev)
            secs = []
            for _ in range(reps):
                t0 = time.perf_counter()
                graphs.replay_padding(b, q)
                sync(dev)
                secs.append(time.perf_counter() - t0)
            times[(b, q)] = _rounded(sorted(secs)[reps // 2])
    return ShapeTable(times, tuple(sizes), tuple(graphs.query_lens))


def measure_drafting(step, reps: int = 5) -> BatchTable:
    """Time a DFlash drafting step (dflash_step.DFlashStepRunner) at its captured batch sizes among
    MEASURED_BATCHES and the largest (without graphs: 1, 4, 16, 64 up to its rows, and its rows), each rounded
    like the target's shapes."""
    sizes = list(step.batch_sizes) or sorted({b for b in MEASURED_BATCHES if b <= step.max_rows} | {step.max_rows})
    batches = sorted({b for b in sizes if b in MEASURED_BATCHES} | {sizes[-1]})
    times = step.time_steps(batches, reps)
    return BatchTable({b: _rounded(t) for b, t in times.items()}, tuple(step.batch_sizes))


def build_step_cost(model: torch.nn.Module, proposer, runner, device: torch.device,
                    measure: bool | None = None) -> ModeledStepCost:
    """The step cost of an engine: its target `model` run by `runner` and its `proposer` (a Proposer;
    its class says how it drafts). measure: time runner.graphs (and a draft model's graphs); None: on
    CUDA when there are graphs, else the analytic default."""
    from verispec.spec_decode.dflash import DFlashProposer
    from verispec.spec_decode.draft_model import DraftModelProposer

    cuda = torch.device(device).type == "cuda"
    rates = CUDA_RATES if cuda else CPU_RATES
    layers = model.config.num_layers
    graphs = getattr(runner, "graphs", None)
    if measure is None:
        measure = cuda and graphs is not None
    target: ForwardCost = measure_graphs(graphs) if measure else analytic_forward(model, rates, layers)
    common = dict(target=target, overhead=rates.host_per_step, overhead_per_seq=rates.host_per_seq,
                  loop_host_per_seq=rates.loop_per_seq,
                  drafter_host=rates.draft_forward_host, drafter_host_per_seq=rates.draft_forward_host_per_seq)
    if isinstance(proposer, DraftModelProposer):
        draft = proposer.model
        if draft is model:
            fwd = target
        elif measure and proposer.graphs is not None:
            fwd = measure_graphs(proposer.graphs)
        else:
            fwd = analytic_forward(draft, rates, draft.config.num_layers)
        return ModeledStepCost(drafter_kind=AUTOREGRESSIVE, drafter_forward=fwd, catch_up=proposer.k + 1, **common)
    if isinstance(proposer, DFlashProposer):
        cfg = proposer.drafter.config
        if measure and proposer.step is not None:
            # measured: the whole drafting step, host preparation included (so no separate host term)
            fwd: ForwardCost = measure_drafting(proposer.step)
            common.update(drafter_host=0.0, drafter_host_per_seq=0.0)
        else:
            base = target.linear() if isinstance(target, ShapeTable) else target
            fwd = ScaledForward(base, (cfg.num_layers + 1) / (layers + 1))
        return ModeledStepCost(drafter_kind=BLOCK, drafter_forward=fwd, catch_up=cfg.block_size, **common)
    return ModeledStepCost(drafter_kind=HOST, host_per_request=rates.ngram_per_request, **common)
