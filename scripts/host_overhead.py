"""Host overhead per engine step, measured on a tiny random-weight model (CPU is fine).

The model is so small (2 layers, hidden 64, vocabulary 512) that its compute hardly matters; the
time spent inside the model's forward and logits (and in the torch reference attention's index
building, which the GPU path does not run) is measured separately and subtracted, so "host" is
what the engine itself costs per step: scheduling, input building, launching the verification /
sampling ops, collect, detokenizing, outputs. Times are CPU time of the main thread (the machine
may be shared; torch runs on one thread), best of --repeats runs.

    PYTHONPATH=$PWD python3 scripts/host_overhead.py [--steps 200] [--batch-sizes 1,64] [--profile CASE]
        [--output-kind cumulative|final_only] [--loops sync,async] [--cases decode,ngram4]
        [--no-gc-freeze] [--gc-threshold N] [--prompt-len 64]

"gc ms" is the cyclic garbage collector's share of a step (CPU time between gc.callbacks' start and
stop, wherever a collection struck, the forward included), "gen2 ms" the full collections' share of
it; "gc n" counts collections per step (gen0/gen1/gen2). The engine freezes the collector at start-up
as LLM and the server do, unless --no-gc-freeze; --gc-threshold sets the gen0 threshold for the timed
steps only (Python's default: 700).

--output-kind final_only is what LLM.generate asks for (no per-step RequestOutputs); cumulative
(the default) is what a streaming consumer (the server, `verispec generate`, bench latency and spec,
bench throughput --stream-outputs) gets.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from tiny import tiny_config, tiny_engine, tiny_model  # noqa: E402

from verispec import SamplingParams  # noqa: E402
from verispec.attention import reference  # noqa: E402
from verispec.sampling_params import RequestOutputKind  # noqa: E402
from verispec.worker import inputs  # noqa: E402


class ForwardTimer:
    """Accumulates CPU time spent in the model's forward, its logits and the reference attention
    indices (model compute, which the GPU runs in kernels)."""

    def __init__(self, model) -> None:
        self.seconds = 0.0
        self._restore = (model, reference.build_reference_indices)
        model.forward = self._timed(model.forward)
        model.compute_logits = self._timed(model.compute_logits)
        # The reference backend's prepare_metadata (the runner) and build_batch (proposers) build them.
        inputs.build_reference_indices = reference.build_reference_indices = self._timed(reference.build_reference_indices)

    def _timed(self, fn):
        def timed(*a, **kw):
            t = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.thread_time() - t

        return timed

    def close(self) -> None:
        model, ref = self._restore
        del model.forward, model.compute_logits  # back to the class's methods
        inputs.build_reference_indices = reference.build_reference_indices = ref


def prompts(batch: int, length: int) -> list[list[int]]:
    """Prompts with repeats, so prompt lookup finds drafts."""
    g = torch.Generator().manual_seed(batch)
    out = []
    for _ in range(batch):
        motif = torch.randint(10, 500, (8,), generator=g).tolist()
        out.append((motif * (length // 8 + 1))[:length])
    return out


class GCTimer:
    """CPU time and count of the cyclic GC's collections, per generation, while installed."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.counts = [0, 0, 0]
        self._t = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.thread_time()
        else:
            self.seconds[info["generation"]] += time.thread_time() - self._t
            self.counts[info["generation"]] += 1

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


def measure(model, batch: int, async_scheduling: bool, spec: dict | None, steps: int, profile: bool = False,
            output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE, gc_freeze: bool = True,
            gc_threshold: int | None = None, prompt_len: int = 64) -> dict:
    eng = tiny_engine(
        model, spec={k: v for k, v in spec.items() if k != "k0"} if spec else None, async_scheduling=async_scheduling, max_num_seqs=max(batch, 1),
        max_num_batched_tokens=4096, num_gpu_blocks=batch * ((prompt_len + steps * 6) // 16 + 4) + 16,
        gc_freeze=gc_freeze,
    )
    if not gc_freeze:
        gc.unfreeze()  # an earlier engine's freeze (runs of this script alternate) stays out of this one
    if spec is not None and spec.get("k0"):  # adaptive, planned at k = 0 every step: a plain decode step's work
        from host_profile import pin_plain  # (scripts/, beside this one)

        pin_plain(eng)
    params = SamplingParams(temperature=0.0, max_tokens=steps * 5 + 64, ignore_eos=True, output_kind=output_kind)
    for i, p in enumerate(prompts(batch, prompt_len)):
        eng.add_request(f"r{i}", None, params, p)
    for _ in range(5 + -(-batch * prompt_len // 4096)):  # prefill (4096 tokens a step) and warm-up
        eng.step()
    warm = eng.get_metrics()
    timer = None if profile else ForwardTimer(eng.runner.model)
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    thresholds = gc.get_threshold()
    if gc_threshold is not None:
        gc.set_threshold(gc_threshold, *thresholds[1:])
    gct = GCTimer()
    t0 = time.thread_time()
    for _ in range(steps):
        eng.step()
    total = time.thread_time() - t0
    gct.close()
    gc.set_threshold(*thresholds)
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats(SORT).print_stats(45)
        return {}
    timer.close()
    gen = eng.get_metrics()
    return {"total_ms": 1e3 * total / steps, "forward_ms": 1e3 * timer.seconds / steps,
            "host_ms": 1e3 * (total - timer.seconds) / steps,
            "accepted": gen["spec_decode_num_accepted_tokens"] - warm["spec_decode_num_accepted_tokens"],
            "drafts": gen["spec_decode_num_draft_tokens"] - warm["spec_decode_num_draft_tokens"], "gc_ms": 1e3 * sum(gct.seconds) / steps,
            "gc2_ms": 1e3 * gct.seconds[2] / steps,
            "gc_n": [c / steps for c in gct.counts]}


SORT = "cumulative"
CASES = {"decode": None, "ngram4": {"method": "ngram", "num_speculative_tokens": 4},
         # k = 4 pinned (no adaptive policy): every step drafts, as on the GPU where drafts pay
         "ngram4-pin": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
         "self4": {"method": "self", "num_speculative_tokens": 4},
         # adaptive, but planned at k = 0 every step (the host work a speculative engine adds to decode steps)
         "ngram4-k0": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": True, "k0": True},
         "self4-k0": {"method": "self", "num_speculative_tokens": 4, "adaptive": True, "k0": True}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=64,
                    help="prompt tokens per request (a repeated 8-token motif; max_model_len allowing)")
    ap.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    ap.add_argument("--profile", default=None, help="cProfile one case, e.g. sync/decode/1")
    ap.add_argument("--sort", default="cumulative", help="cProfile sort key (cumulative, tottime, ...)")
    ap.add_argument("--output-kind", default="cumulative", choices=["cumulative", "final_only"])
    ap.add_argument("--loops", default="sync,async")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--no-gc-freeze", action="store_true", help="engines without gc.freeze at start-up")
    ap.add_argument("--gc-threshold", type=int, default=None, help="gen0 GC threshold during the timed steps")
    args = ap.parse_args()
    global SORT
    SORT = args.sort
    kind = RequestOutputKind[args.output_kind.upper()]
    torch.set_num_threads(1)
    model = tiny_model(tiny_config(vocab=512))
    if args.profile:
        loop, case, batch = args.profile.split("/")
        measure(model, int(batch), loop == "async", CASES[case], args.steps, profile=True, output_kind=kind,
                prompt_len=args.prompt_len)
        return
    gc_kw = dict(gc_freeze=not args.no_gc_freeze, gc_threshold=args.gc_threshold, prompt_len=args.prompt_len)
    print(f"output kind: {kind.name}; gc.freeze at start-up: {gc_kw['gc_freeze']}; "
          f"gen0 threshold: {args.gc_threshold or gc.get_threshold()[0]}")
    print(f"{'loop':6} {'case':10} {'batch':>5} {'step ms':>8} {'forward ms':>10} {'host ms':>8} "
          f"{'host us/req':>11} {'drafts/step':>11} {'acc/step':>8} {'gc ms':>6} {'gen2 ms':>7} {'gc n (gen0/1/2)':>16}")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        for case in args.cases.split(","):
            for loop in args.loops.split(","):
                runs = [measure(model, batch, loop == "async", CASES[case], args.steps, output_kind=kind,
                                **gc_kw) for _ in range(args.repeats)]
                r = min(runs, key=lambda x: x["host_ms"])
                n = "/".join(f"{c:.2f}" for c in r["gc_n"])
                print(f"{loop:6} {case:10} {batch:5d} {r['total_ms']:8.3f} {r['forward_ms']:10.3f} {r['host_ms']:8.3f} "
                      f"{1e3 * r['host_ms'] / batch:11.1f} {r['drafts'] / args.steps:11.1f} "
                      f"{r['accepted'] / args.steps:8.1f} {r['gc_ms']:6.3f} {r['gc2_ms']:7.3f} {n:>16}",
                      flush=True)


if __name__ == "__main__":
    main()
