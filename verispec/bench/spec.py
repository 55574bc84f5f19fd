"""`verispec bench spec`: speculative decoding methods against no speculation, on HumanEval prompts.

For each batch size and method (none, ngram, self, draft_model, dflash), greedy generation of `output_len` tokens per
prompt (no EOS stop), all prompts submitted at once with max_num_seqs = batch size. Batch size b runs
max(num_prompts, waves * b) requests (num_prompts capped at the prompts there are), cycling through them: with waves >= 2 a
queue refills every slot a finished request frees, so a row is a steady-state throughput (with one wave the
run lasts as long as its slowest request, and tokens a speculating request gains early buy nothing). Greedy speculation is
lossless, so every method's tokens must equal no speculation's at the same batch size; mismatches are counted,
not fatal (bf16 on a GPU may flip a near-tie between batch shapes). Each (batch size, method) runs `repeats`
times on one engine after a warm-up run of the same workload; the row is the median run by tok/s. With
repeats > 1 the runs are interleaved (interleave=True, the default): every method's engine of a batch size
stays alive and each round runs every method once, each round starting at the next method, so that drift over
the minutes of a sweep (session 15: single batch-64 runs of two engines moved 10-15% either way) falls on
every method alike; the speedup is then the median of the rounds' paired ratios (speedup_runs). The
adaptive policy restarts its probe clock when a run starts on the idle engine, so every run makes the
warm-up's plans, and its steps have the shapes the warm-up compiled. Speculation pins k unless adaptive=True
(the engine picks 0..k drafts per request per step; experimental, off by default).

Row keys: method, batch_size, k, adaptive, num_prompts, output_tokens, wall_s, tok_s, runs (every run's tok/s),
speedup (over none at the same batch size, measured in this process on the same prompts), speedup_runs (each
run's tok/s over none's run of the same round), acceptance_rate,
mean_acceptance_length (1 + accepted / drafts), acceptance_per_pos (k fractions of drafts accepted at each
position), num_drafts, mean_k (drafts per request-step: the policy's mean k, k itself when pinned), num_steps,
mismatches (prompts whose tokens differ from none's), first_mismatch (earliest differing token index, or None),
graph_steps / split_steps / eager_steps (the run's target steps by how they ran: one graph replay, two, eagerly),
preemptions (requests preempted for KV blocks), mem_frac, flop_frac, hw_frac, hw_bound.
Peer rows (batch 1): peer, tok_s, output_tokens, ratio (verispec's matching method / peer), mismatches
(against verispec's none at batch 1), or error.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from verispec.bench.drive import drive, free_memory, greedy, make_engine
from verispec.bench.hardware import hardware_use, useful_flops
from verispec.bench.models import BenchModel, load_draft
from verispec.bench.prompts import Prompt, dataset_prompts, random_prompts
from verispec.bench.report import Column
from verispec.spec_decode.dflash_model import DFlashConfig

COLUMNS: list[Column] = [
    ("method", "method", "s"), ("batch_size", "batch", "d"), ("tok_s", "tok/s", ".1f"),
    ("runs", "runs tok/s", "range"), ("speedup", "speedup", ".2f"), ("mean_k", "mean k", ".2f"),
    ("acceptance_rate", "accept", ".3f"),
    ("mean_acceptance_length", "acc len", ".2f"), ("acceptance_per_pos", "per position", ".2f"),
    ("mismatches", "mismatch", "d"), ("hw", "hw%", "s"),
]
PEER_COLUMNS: list[Column] = [
    ("peer", "peer", "s"), ("tok_s", "tok/s", ".1f"), ("ratio", "verispec/peer", ".2f"),
    ("mismatches", "mismatch", "d"),
]
METHODS = ("none", "ngram", "self", "draft_model", "dflash")
# Which verispec method each HF peer is compared with.
PEER_MATCH = {"hf eager": "none", "hf static+compile": "none", "hf assisted": "draft_model",
              "hf prompt lookup": "ngram"}


def spec_config(method: str, k: int, draft_model: str | None, dflash_model: str | None = None,
                adaptive: bool = False) -> dict | None:
    """The speculative_config dict of a bench method name."""
    if method == "none":
        return None
    common = {"num_speculative_tokens": k, "adaptive": adaptive}
    if method == "dflash":
        if not dflash_model:
            raise ValueError("method dflash needs --dflash-model")
        return {"method": "dflash", "model": dflash_model, **common}
    if method == "draft_model":
        if not draft_model:
            raise ValueError("method draft_model needs --draft-model")
        return {"method": "draft_model", "model": draft_model, **common}
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: one of {', '.join(METHODS)}")
    return {"method": method, **common}


def random_drafter(bm: BenchModel, out_dir: str) -> str:
    """An untrained DFlash drafter (block 16, 2 layers) for the bench's target, saved to out_dir."""
    from verispec.spec_decode.dflash import save_drafter
    from verispec.spec_decode.dflash_model import DFlashDrafter, new_config
    from verispec.train.data import pick_mask_token

    vocab = bm.config.vocab_size
    mask = pick_mask_token(bm.tokenizer, vocab) if bm.has_tokenizer else vocab - 1
    cfg = new_config(bm.model, bm.setup.model, mask)
    drafter = DFlashDrafter(cfg)
    drafter.init_weights(seed=bm.setup.seed)
    save_drafter(drafter, out_dir, bm.dtype)
    return out_dir


def bench_prompt_ids(bm: BenchModel, prompts_file: str | None, num: int, output_len: int,
                     chat: bool = False) -> tuple[list[list[int]], str]:
    """(token ids of `num` prompts, where they came from): the prompts file, else HumanEval; chat renders
    text prompts as chat requests (train/data.py render_prompts); random token ids where random weights
    have no tokenizer."""
    if not (bm.has_tokenizer or prompts_file):  # random weights without the tokenizer: text cannot be encoded
        ps = random_prompts(num, 128, output_len, bm.config.vocab_size, bm.setup.seed)
        return [bm.encode(p) for p in ps], "random token ids (no tokenizer here)"
    ps = dataset_prompts(prompts_file, num, output_len)
    source = prompts_file or "humaneval"
    if chat:
        from verispec.train.data import render_prompts

        if not all(p.text for p in ps):
            raise ValueError("--chat needs text prompts")
        ps = [Prompt(t, None, p.max_tokens) for t, p in zip(render_prompts(bm.tokenizer, [p.text for p in ps]), ps,
                                                            strict=True)]
        source += " (chat template)"
    return [bm.encode(p) for p in ps], source


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's length if one is a prefix of the
    other), None if they are equal."""
    if a == b:
        return None
    return next((i for i, (s, t) in enumerate(zip(a, b, strict=False)) if s != t), min(len(a), len(b)))


def _diff(a: list[list[int]], b: list[list[int]]) -> tuple[int, int | None]:
    """(prompts whose tokens differ, earliest differing index over them)."""
    firsts = [f for x, y in zip(a, b, strict=True) if (f := first_mismatch(x, y)) is not None]
    return len(firsts), min(firsts) if firsts else None


def _row(bm: BenchModel, method: str, b: int, k: int, run) -> dict:
    n_out = sum(len(o) for o in run.outputs)
    flops = useful_flops(bm.config, zip(run.prompt_lens, (len(o) for o in run.outputs), strict=True))
    sp = run.spec
    row = {"method": method, "batch_size": b, "k": k if method != "none" else 0, "num_prompts": len(run.outputs),
           "output_tokens": n_out, "wall_s": run.wall_s, "tok_s": n_out / run.wall_s, "num_drafts": sp["num_drafts"],
           "mean_k": sp["num_draft_tokens"] / max(sp["num_request_steps"], 1), "num_steps": run.num_steps,
           "graph_steps": run.launches[0], "split_steps": run.launches[1], "eager_steps": run.launches[2],
           "preemptions": run.preemptions,
           **hardware_use(bm.config, bm.elem_bytes, run.steps, run.wall_s, flops, bm.step_weight_bytes)}
    secs = sorted(st.seconds for st in run.steps)
    if secs:  # the steps' host pace (async) or synchronized time: where a slow run loses its time
        p50 = secs[(len(secs) - 1) // 2]
        slow = [x for x in secs if x > 5 * p50]
        row.update(step_ms_p50=1e3 * p50, step_ms_p90=1e3 * secs[int(0.9 * (len(secs) - 1))],
                   step_ms_max=1e3 * secs[-1], slow_steps=len(slow), slow_s=sum(slow))
    if method != "none":
        d = max(sp["num_drafts"], 1)
        per = (sp["accepted_per_pos"] + [0] * k)[:k]
        row.update(acceptance_rate=sp["num_accepted_tokens"] / max(sp["num_draft_tokens"], 1),
                   mean_acceptance_length=1 + sp["num_accepted_tokens"] / d,
                   acceptance_per_pos=[a / d for a in per])
    return row


def write_trace(path: Path, steps: list) -> None:
    """One JSON line per step record of a run: ms, seqs, context and new tokens, prefill, the drafts and
    accepted drafts the engine committed during the step() call, the k it planned then, and how the step it
    launched ran (graph / split / eager) with its scheduled tokens (in the
    overlapped loop a step() commits the step before the one it launches, so a line's drafts belong to the
    plan of the line before it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for st in steps:
            f.write(json.dumps({"ms": round(1e3 * st.seconds, 4), "seqs": st.num_seqs, "ctx": st.context_tokens,
                                "new": st.new_tokens, "prefill": st.prefill, "drafts": st.draft_tokens,
                                "accepted": st.accepted, "k": st.planned_k, "launch": st.launch,
                                "launched_tokens": st.launched_tokens}) + "\n")


def median_row(rows: list[dict]) -> tuple[dict, int]:
    """(the median of repeated runs' rows by tok/s, its index), plus `runs` (every run's tok/s, in run
    order). The median is a run that happened (for an even count the slower middle one)."""
    if not rows:
        raise ValueError("median_row needs at least one run")
    i = sorted(range(len(rows)), key=lambda j: rows[j]["tok_s"])[(len(rows) - 1) // 2]
    return {**rows[i], "runs": [r["tok_s"] for r in rows]}, i


def run_spec(bm: BenchModel, methods: list[str], batch_sizes: list[int], output_len: int = 256, k: int = 4,
             draft_model: str | None = None, prompts_file: str | None = None, num_prompts: int = 16,
             peer: str | None = None, compile_peer: bool = True, draft_overrides: dict | None = None,
             dflash_model: str | None = None, dflash_k: int | None = None, chat: bool = False,
             repeats: int = 3, adaptive: bool = False, waves: int = 1, trace_dir: str | None = None,
             interleave: bool = True) -> dict:
    """Run every (batch size, method) `repeats` times (the row: the median run); returns {"rows", "peers",
    "prompts"}. dflash_model "random" makes an untrained drafter for the target (speed only). chat: render
    text prompts as chat requests (a code stub as "Complete this function: ...", a natural-language request
    as the user message itself: train/data.py render_prompts). adaptive=False pins k (the engine drafts k every step).
    trace_dir: each row's median run's steps go to trace_dir/METHOD_bB.jsonl (write_trace). interleave (with
    repeats > 1): every method's engine of a batch size is kept, and the repeats run in rounds of one run per
    method (each round starting at the next method), the speedup being the median of the rounds' paired ratios;
    False: one engine at a time, its repeats back to back (less memory)."""
    if repeats < 1 or waves < 1:
        raise ValueError("repeats and waves must be >= 1")

    all_ids, source = bench_prompt_ids(bm, prompts_file, max([num_prompts] + [waves * b for b in batch_sizes]),
                                       output_len, chat)
    first = min(num_prompts, len(all_ids))

    def count(b: int) -> int:  # requests of batch size b (module docstring)
        return max(first, waves * b)

    methods = ["none"] + [m for m in methods if m != "none"]
    draft = load_draft(bm, draft_model, draft_overrides) if draft_model and "draft_model" in methods else None
    tmp = None
    if "dflash" in methods and dflash_model == "random":
        tmp = tempfile.TemporaryDirectory(prefix="verispec-dflash-")
        dflash_model = random_drafter(bm, tmp.name)
    if "dflash" in methods and dflash_k is None:
        dflash_k = DFlashConfig.from_dict(json.loads((Path(dflash_model) / "config.json").read_text())).block_size - 1
    rows: list[dict] = []
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    for b in batch_sizes:
        ids = [all_ids[i % len(all_ids)] for i in range(count(b))]

        def build(method: str, b: int = b, ids: list = ids):
            mk = dflash_k if method == "dflash" else k
            engine = make_engine(bm, spec_config(method, mk, draft_model, dflash_model, adaptive), b, ids,
                                 [output_len] * len(ids), draft)
            # Warm-up: the whole workload once. Each prompt length's prefill, each query length of a
            # verify step and each shape of a mixed step may compile its own kernels on first use (on the
            # H200 a warm-up on the first b prompts left `none` at 407 tok/s instead of 773; one of 8
            # tokens per prompt left ~1 s compiles in the timed speculative runs, session 9).
            drive(engine, ids, [greedy(output_len)] * len(ids), bm.device)
            return engine

        def cost_of(engine, b: int = b) -> list[float] | None:  # the policy's step cost at b, k = 0..max
            return [round(1e3 * c, 3) for c in engine.policy.step_costs(b)] if engine.policy is not None else None

        runs: dict[str, list] = {}
        costs: dict[str, list[float] | None] = {}
        if interleave and repeats > 1:
            # Every method's engine alive at once; round r runs each of them once, starting at method r (module
            # docstring: drift over minutes and the order within a round fall on every method alike).
            engines = {method: build(method) for method in methods}
            for r in range(repeats):
                for method in methods[r % len(methods):] + methods[: r % len(methods)]:
                    runs.setdefault(method, []).append(drive(engines[method], ids, [greedy(output_len)] * len(ids),
                                                             bm.device))
            costs = {method: cost_of(e) for method, e in engines.items()}
            del engines
            free_memory()
        else:
            for method in methods:
                engine = build(method)
                runs[method] = [drive(engine, ids, [greedy(output_len)] * len(ids), bm.device) for _ in range(repeats)]
                costs[method] = cost_of(engine)
                del engine
                free_memory()
        base_rows = [_row(bm, "none", b, k, run) for run in runs["none"]]
        for method in methods:
            mk = dflash_k if method == "dflash" else k
            cost_ms = costs[method]
            method_rows = base_rows if method == "none" else [_row(bm, method, b, mk, run) for run in runs[method]]
            row, i = median_row(method_rows)
            if trace_dir is not None:
                write_trace(Path(trace_dir) / f"{method}_b{b}.jsonl", runs[method][i].steps)
            row["adaptive"] = adaptive if method != "none" else None
            row["cost_ms"] = cost_ms
            outputs[(method, b)] = runs[method][i].outputs
            base = outputs[("none", b)]
            diffs = [_diff(r.outputs, base) for r in runs[method]]  # every run, not only the median one
            firsts = [f for _, f in diffs if f is not None]
            row["mismatches"], row["first_mismatch"] = max(n for n, _ in diffs), min(firsts) if firsts else None
            # Each round's tok/s over plain decoding's in the same round (paired), and the row's speedup: their
            # median where the runs were interleaved, else the median runs' ratio.
            paired = [m["tok_s"] / n["tok_s"] for m, n in zip(method_rows, base_rows, strict=True)]
            row["speedup_runs"] = [round(x, 4) for x in paired]
            row["speedup"] = (statistics.median(paired) if interleave and repeats > 1
                              else row["tok_s"] / next(r["tok_s"] for r in rows + [row]
                                                       if r["method"] == "none" and r["batch_size"] == b))
            if method == "none" and b != batch_sizes[0]:
                first_b = outputs[("none", batch_sizes[0])]
                row["mismatches_vs_first_batch_size"] = _diff(runs[method][i].outputs[: len(first_b)],
                                                              first_b[: len(ids)])[0]
            rows.append(row)
            print(f"  {method:12} batch {b:3}: {row['tok_s']:9.1f} tok/s, mean k {row['mean_k']:.2f}, "
                  f"{row['mismatches']} mismatches, {row['num_steps']} steps (p50 {row.get('step_ms_p50', 0):.2f} ms, "
                  f"max {row.get('step_ms_max', 0):.1f} ms, {row.get('slow_steps', 0)} slow: "
                  f"{row.get('slow_s', 0):.2f} s)" + (f"; modeled step ms by k: {cost_ms}" if cost_ms else ""), flush=True)
    if tmp is not None:
        tmp.cleanup()
    peers = []
    if peer == "hf":
        peers = _hf_rows(bm, all_ids[:num_prompts], output_len, k, draft, compile_peer, rows, outputs.get(("none", 1)))
    return {"rows": rows, "peers": peers, "prompts": source}


def _hf_rows(bm: BenchModel, ids: list[list[int]], output_len: int, k: int, draft: tuple | None,
             compile_peer: bool, rows: list[dict], ref: list[list[int]] | None) -> list[dict]:
    from verispec.bench.peers import hf_model, hf_modes, hf_sequential

    hf = hf_model(bm.model)
    assistant = hf_model(draft[2]) if draft is not None else None
    modes = hf_modes(compile_peer) + (["hf assisted"] if assistant is not None else []) + ["hf prompt lookup"]
    out = []
    for mode in modes:
        r = hf_sequential(hf, ids, output_len, mode, k=k, assistant=assistant)
        if "error" not in r:
            ours = next((x for x in rows if x["method"] == PEER_MATCH[mode] and x["batch_size"] == 1), None)
            r["ratio"] = ours["tok_s"] / r["tok_s"] if ours else None
            r["compared_with"] = PEER_MATCH[mode]
            if ref is not None:
                r["mismatches"], r["first_mismatch"] = _diff(r["outputs"], ref[: len(r["outputs"])])
        out.append(r)
        print(f"  {mode:18} batch   1: {r.get('tok_s', 0):9.1f} tok/s {r.get('error', '')}", flush=True)
    return out
