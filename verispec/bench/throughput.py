"""`verispec bench throughput`: many sequences at once, total and output tokens per second.

Workloads: "random" (nano-vllm's recipe: 256 sequences, input and output lengths uniform in 100..1024, random
token ids, fixed seed), "humaneval" (HumanEval prompts, `output_len` tokens each) and, with `num_seqs`, the
llama.cpp batched comparison: N sequences of 128 random prompt tokens generating 256 tokens each (other
lengths via sweep_input_len / sweep_output_len, then without the llama.cpp column).
Every sequence runs to its max_tokens (ignore_eos); sampling is greedy unless `temperature` > 0.

What is repeated: each point (a sweep's N, or the one recipe / HumanEval workload) builds one engine, warms
it up with a short run (4 tokens per sequence), then submits the whole workload `repeats` times on that
same engine (prefix caching off: no repeat reuses an earlier one's KV; seeds repeat, so tokens do too). The
row's figures are the median run's (median_run); `runs` lists every run's output tok/s. Requests ask for
FINAL_ONLY outputs, as LLM.generate does (`outputs: "final"`), unless stream=True (`"stream"`: every step's
outputs, as a streaming server builds them).

Row keys: workload, num_seqs, prompt_tokens, output_tokens, wall_s, total_tok_s, output_tok_s, num_steps,
mem_frac, flop_frac, hw_frac, hw_bound (all of the median run), runs, outputs, and for the sweep
llamacpp_tok_s (published) and vs_llamacpp (the median run's output tok/s / llamacpp_tok_s).
Peer rows (sweep only, one run each): peer, num_seqs, output_tok_s, decode_tok_s, ratio (verispec output_tok_s
/ peer's).
"""

from __future__ import annotations

from pathlib import Path

from verispec.bench.drive import RunResult, drive, free_memory, make_engine
from verispec.bench.hardware import hardware_totals, useful_flops
from verispec.bench.models import BenchModel
from verispec.bench.peers import PUBLISHED
from verispec.bench.prompts import Prompt, dataset_prompts, nano_vllm_recipe, random_prompts
from verispec.bench.report import Column
from verispec.core.sampling_params import SamplingParams

COLUMNS: list[Column] = [
    ("workload", "workload", "s"), ("num_seqs", "seqs", "d"), ("prompt_tokens", "prompt tok", "d"),
    ("output_tokens", "output tok", "d"), ("wall_s", "wall s", ".2f"), ("total_tok_s", "total tok/s", ".1f"),
    ("output_tok_s", "output tok/s", ".1f"), ("runs", "runs tok/s", "range"), ("hw", "hw%", "s"),
    ("llamacpp_tok_s", "llama.cpp", ".0f"),
    ("vs_llamacpp", "vs llama.cpp", ".2f"),
]
PEER_COLUMNS: list[Column] = [
    ("peer", "peer", "s"), ("num_seqs", "seqs", "d"), ("output_tok_s", "output tok/s", ".1f"),
    ("ratio", "verispec/peer", ".2f"),
]
SWEEP_INPUT, SWEEP_OUTPUT = 128, 256


def _params(prompts: list[Prompt], temperature: float, seed: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, max_tokens=p.max_tokens, ignore_eos=True,
                           seed=seed + i if temperature > 0 else None) for i, p in enumerate(prompts)]


def median_run(runs: list[dict]) -> dict:
    """The median of repeated runs by output tok/s, plus `runs` (every run's output tok/s, in run order).

    The median is a run that happened (for an even count the slower of the two middle ones), so its wall_s,
    tok/s and hw figures agree with each other. Raises ValueError for no runs, or runs whose token counts
    differ (then they did not do the same work)."""
    if not runs:
        raise ValueError("median_run needs at least one run")
    if len({(r["prompt_tokens"], r["output_tokens"]) for r in runs}) != 1:
        raise ValueError("repeated runs emitted different token counts")
    mid = sorted(runs, key=lambda r: r["output_tok_s"])[(len(runs) - 1) // 2]
    return {**mid, "runs": [r["output_tok_s"] for r in runs]}


def _figures(bm: BenchModel, run: RunResult) -> dict:
    """One run's row figures: tokens, wall time, tok/s, steps and hardware fractions."""
    n_prompt, n_out = sum(run.prompt_lens), sum(len(o) for o in run.outputs)
    flops = useful_flops(bm.config, zip(run.prompt_lens, (len(o) for o in run.outputs), strict=True))
    return {
        "prompt_tokens": n_prompt, "output_tokens": n_out, "wall_s": run.wall_s,
        "total_tok_s": (n_prompt + n_out) / run.wall_s, "output_tok_s": n_out / run.wall_s,
        "num_steps": run.num_steps,
        **hardware_totals(bm.config, bm.elem_bytes, run.num_steps, run.context_tokens, run.wall_s, flops,
                           bm.step_weight_bytes),
    }


def _measure(bm: BenchModel, name: str, prompts: list[Prompt], temperature: float, max_num_seqs: int,
             repeats: int = 3, stream: bool = False) -> dict:
    """One point: one engine, a warm-up run, then the workload `repeats` times; the median run's row."""
    ids = [bm.encode(p) for p in prompts]
    engine = make_engine(bm, None, max_num_seqs, ids, [p.max_tokens for p in prompts])
    warm = min(len(ids), max_num_seqs)
    drive(engine, ids[:warm], [SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True)] * warm,
          bm.device, stream)
    params = _params(prompts, temperature, bm.setup.seed)
    runs = [_figures(bm, drive(engine, ids, params, bm.device, stream)) for _ in range(repeats)]
    del engine
    free_memory()
    return {"workload": name, "num_seqs": len(prompts), **median_run(runs),
            "outputs": "stream" if stream else "final"}


LLAMACPP_MODEL = "qwen2.5-coder-1.5b-instruct"  # the model the published llama.cpp batched figures are for


def llamacpp_reference(model: str) -> dict[str, float]:
    """llama.cpp's published batched output tok/s by sequence count, for the model they were measured on
    (the 1.5B, by registry name or file name); {} for any other model, so no false ratio is printed."""
    name = Path(model).name.removesuffix(".gguf")
    return PUBLISHED["llamacpp_1.5b_bf16_batched_tok_s"] if name == LLAMACPP_MODEL else {}


def run_throughput(bm: BenchModel, dataset: str = "random", num_seqs: list[int] | None = None,
                   output_len: int = 256, temperature: float = 0.0, prompts_file: str | None = None,
                   num_prompts: int | None = None, peer: str | None = None, compile_peer: bool = True,
                   recipe_num_seqs: int = 256, recipe_max_len: int = 1024, sweep_input_len: int = SWEEP_INPUT,
                   sweep_output_len: int = SWEEP_OUTPUT, repeats: int = 3, stream: bool = False) -> dict:
    """Run the chosen workload(s), each point `repeats` times on one engine (FINAL_ONLY outputs unless
    `stream`); returns {"rows": [...], "peers": [...]}."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    rows, peers = [], []
    vocab = bm.config.vocab_size
    if num_seqs:
        ref = llamacpp_reference(bm.setup.model)
        for n in num_seqs:
            ps = random_prompts(n, sweep_input_len, sweep_output_len, vocab, seed=bm.setup.seed + n)
            name = f"{sweep_input_len}+{sweep_output_len}"
            row = _measure(bm, name, ps, temperature, max(n, 1), repeats, stream)
            if str(n) in ref and (sweep_input_len, sweep_output_len) == (SWEEP_INPUT, SWEEP_OUTPUT):
                row["llamacpp_tok_s"] = ref[str(n)]
                row["vs_llamacpp"] = row["output_tok_s"] / ref[str(n)]
            rows.append(row)
        if peer == "hf":
            peers = _hf_sweep(bm, num_seqs, rows, compile_peer, sweep_input_len, sweep_output_len)
    elif dataset == "humaneval":
        ps = dataset_prompts(prompts_file, num_prompts, output_len)
        rows.append(_measure(bm, "humaneval", ps, temperature, 256, repeats, stream))
    elif dataset == "random":
        ps = nano_vllm_recipe(recipe_num_seqs, recipe_max_len, recipe_max_len, vocab, bm.setup.seed)
        rows.append(_measure(bm, "nano-vllm", ps, temperature, 256, repeats, stream))
    else:
        raise ValueError(f"unknown dataset {dataset!r}: random or humaneval")
    return {"rows": rows, "peers": peers}


def _hf_sweep(bm: BenchModel, num_seqs: list[int], rows: list[dict], compile_peer: bool, input_len: int,
              output_len: int) -> list[dict]:
    from verispec.bench.peers import hf_latency, hf_model, hf_modes

    hf = hf_model(bm.model)
    out = []
    for mode in hf_modes(compile_peer):
        for n, row in zip(num_seqs, rows, strict=True):
            ps = random_prompts(n, input_len, output_len, bm.config.vocab_size, seed=bm.setup.seed + n)
            r = hf_latency(hf, [p.token_ids for p in ps], output_len, mode, warmup=0)
            if "error" not in r:
                r["ratio"] = row["output_tok_s"] / r["output_tok_s"]
            out.append({"num_seqs": n, **r})
    del hf
    return out
