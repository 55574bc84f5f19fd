"""`verispec bench throughput`: many sequences at once, total and output tokens per second.

Workloads: "random" (nano-vllm's recipe: 256 sequences, input and output lengths uniform in 100..1024, random
token ids, fixed seed), "humaneval" (HumanEval prompts, `output_len` tokens each) and, with `num_seqs`, the
llama.cpp batched comparison: N sequences of 128 random prompt tokens generating 256 tokens each (other
lengths via sweep_input_len / sweep_output_len, then without the llama.cpp column).
Every sequence runs to its max_tokens (ignore_eos); sampling is greedy unless `temperature` > 0.

Row keys: workload, num_seqs, prompt_tokens, output_tokens, wall_s, total_tok_s, output_tok_s, num_steps,
mem_frac, flop_frac, hw_frac, hw_bound, and for the sweep llamacpp_tok_s (published) and vs_llamacpp.
Peer rows (sweep only): peer, num_seqs, output_tok_s, decode_tok_s, ratio (verispec output_tok_s / peer's).
"""

from __future__ import annotations

from verispec.bench.common import BenchModel, RunResult, drive, free_memory, make_engine
from verispec.bench.hardware import hardware_use, useful_flops
from verispec.bench.peers import PUBLISHED
from verispec.bench.prompts import Prompt, dataset_prompts, nano_vllm_recipe, random_prompts
from verispec.bench.report import Column
from verispec.sampling_params import SamplingParams

COLUMNS: list[Column] = [
    ("workload", "workload", "s"), ("num_seqs", "seqs", "d"), ("prompt_tokens", "prompt tok", "d"),
    ("output_tokens", "output tok", "d"), ("wall_s", "wall s", ".2f"), ("total_tok_s", "total tok/s", ".1f"),
    ("output_tok_s", "output tok/s", ".1f"), ("hw", "hw%", "s"), ("llamacpp_tok_s", "llama.cpp", ".0f"),
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


def _measure(bm: BenchModel, name: str, prompts: list[Prompt], temperature: float, max_num_seqs: int) -> dict:
    ids = [bm.encode(p) for p in prompts]
    outs = [p.max_tokens for p in prompts]
    engine = make_engine(bm, None, max_num_seqs, ids, outs)
    warm = min(len(ids), max_num_seqs)
    drive(engine, ids[:warm], [SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True)] * warm,
          bm.device)
    run: RunResult = drive(engine, ids, _params(prompts, temperature, bm.setup.seed), bm.device)
    del engine
    free_memory()
    n_prompt, n_out = sum(run.prompt_lens), sum(len(o) for o in run.outputs)
    flops = useful_flops(bm.config, zip(run.prompt_lens, (len(o) for o in run.outputs), strict=True))
    return {
        "workload": name, "num_seqs": len(prompts), "prompt_tokens": n_prompt, "output_tokens": n_out,
        "wall_s": run.wall_s, "total_tok_s": (n_prompt + n_out) / run.wall_s, "output_tok_s": n_out / run.wall_s,
        "num_steps": len(run.steps), **hardware_use(bm.config, bm.elem_bytes, run.steps, run.wall_s, flops),
    }


def run_throughput(bm: BenchModel, dataset: str = "random", num_seqs: list[int] | None = None,
                   output_len: int = 256, temperature: float = 0.0, prompts_file: str | None = None,
                   num_prompts: int | None = None, peer: str | None = None, compile_peer: bool = True,
                   recipe_num_seqs: int = 256, recipe_max_len: int = 1024, sweep_input_len: int = SWEEP_INPUT,
                   sweep_output_len: int = SWEEP_OUTPUT) -> dict:
    """Run the chosen workload(s); returns {"rows": [...], "peers": [...]}."""
    rows, peers = [], []
    vocab = bm.config.vocab_size
    if num_seqs:
        ref = PUBLISHED["llamacpp_1.5b_bf16_batched_tok_s"]
        for n in num_seqs:
            ps = random_prompts(n, sweep_input_len, sweep_output_len, vocab, seed=bm.setup.seed + n)
            row = _measure(bm, f"{sweep_input_len}+{sweep_output_len}", ps, temperature, max(n, 1))
            if str(n) in ref and (sweep_input_len, sweep_output_len) == (SWEEP_INPUT, SWEEP_OUTPUT):
                row["llamacpp_tok_s"] = ref[str(n)]
                row["vs_llamacpp"] = row["output_tok_s"] / ref[str(n)]
            rows.append(row)
        if peer == "hf":
            peers = _hf_sweep(bm, num_seqs, rows, compile_peer, sweep_input_len, sweep_output_len)
    elif dataset == "humaneval":
        ps = dataset_prompts(prompts_file, num_prompts, output_len)
        rows.append(_measure(bm, "humaneval", ps, temperature, 256))
    elif dataset == "random":
        ps = nano_vllm_recipe(recipe_num_seqs, recipe_max_len, recipe_max_len, vocab, bm.setup.seed)
        rows.append(_measure(bm, "nano-vllm", ps, temperature, 256))
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
