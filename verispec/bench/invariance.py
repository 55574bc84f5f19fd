"""`verispec bench invariance`: does a request's greedy output depend on the batch it runs in, or on
speculation?

The same prompts run greedily (no EOS stop, `output_len` tokens each): first plain decoding at batch 1
(max_num_seqs=1, one request at a time), the reference; then every (method, batch size) asked for, all
prompts submitted at once with max_num_seqs = the batch size. Each row counts the requests whose tokens
differ from the reference and where they first differ. The engine runs in the bench's --dtype with its
--batch-invariant setting, so one call measures one mode (bf16, float32, bf16 + batch_invariant) on any
prompts file; nothing is timed beyond one wall clock per row (the runs are not warmed up).

loops (e.g. ["sync", "async"]): every cell runs in each loop, one row per (cell, loop); the reference is
plain decoding at batch 1 in the first loop, and every later loop's row is also compared with the first
loop's row of the same cell: its tokens, and its acceptance counters (num_drafts, num_draft_tokens,
num_accepted_tokens, accepted per position), which must be identical too. None: one loop, the bench's.
The reference cell runs in the first loop only when "none" is not among the methods (a call that
measures speculative methods alone).

Row keys: method, batch_size, loop ("sync" / "async"), k, num_prompts, output_tokens, wall_s, tok_s,
mismatches (requests whose tokens differ from plain decoding at batch 1), first_mismatch (the earliest
differing token index over them, or None), mismatched ([request index, its first differing index] pairs),
acceptance_rate (spec methods: accepted / drafted), num_drafts, counters (the four acceptance counters of
the run), output_hashes (per request, the first 8 hex digits of the sha256 of its token ids: rows of
separate calls, e.g. processes run side by side, compare through them); rows of a later loop also loop_mismatches (requests whose tokens differ from the first loop's
same cell), loop_mismatched and counters_match (True when the counters equal the first loop's) with
counters_diff (the counters that differ: {name: [first loop's, this loop's]}).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from verispec.bench.drive import drive, free_memory, greedy, make_engine
from verispec.bench.models import BenchModel, load_draft
from verispec.bench.report import Column
from verispec.bench.spec import bench_prompt_ids, first_mismatch, random_drafter, spec_config
from verispec.spec_decode.dflash_model import DFlashConfig

COLUMNS: list[Column] = [
    ("method", "method", "s"), ("batch_size", "batch", "d"), ("mismatches", "mismatch", "d"),
    ("num_prompts", "of", "d"), ("first_mismatch", "first at", "d"), ("acceptance_rate", "accept", ".4f"),
    ("tok_s", "tok/s", ".1f"), ("loop", "loop", "s"), ("loop_mismatches", "vs 1st loop", "d"),
    ("counters_match", "same counters", "s"),
]
LOOPS = {"sync": False, "async": True}  # loop name -> EngineConfig.async_scheduling
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos")
PEER_COLUMNS: list[Column] = []


def compare(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """mismatches, first_mismatch and mismatched ([index, first differing token]) of outputs vs reference."""
    mismatched = [[i, f] for i, (o, r) in enumerate(zip(outputs, reference, strict=True))
                  if (f := first_mismatch(o, r)) is not None]
    return {"mismatches": len(mismatched), "first_mismatch": min((f for _, f in mismatched), default=None),
            "mismatched": mismatched}


def output_hash(token_ids: list[int]) -> str:
    """The first 8 hex digits of the sha256 of a request's token ids (as comma-separated decimals)."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:8]


def compare_loops(row: dict, first: dict) -> dict:
    """A later loop's row against the first loop's row of the same cell: loop_mismatches, loop_mismatched,
    counters_match and counters_diff."""
    tokens = compare(row.pop("_outputs"), first["_outputs"])
    diff = {c: [first["counters"][c], row["counters"][c]] for c in COUNTERS
            if first["counters"][c] != row["counters"][c]}
    return {"loop_mismatches": tokens["mismatches"], "loop_mismatched": tokens["mismatched"],
            "counters_match": not diff, "counters_diff": diff}


def check_loops(loops: list[str] | None, loop_batch_sizes: list[int] | None = None) -> None:
    """ValueError for an empty, unknown or repeated loop name, or loop_batch_sizes without loops."""
    if loop_batch_sizes is not None and not loops:
        raise ValueError("loop_batch_sizes (--loop-batch-sizes) needs loops (--loops)")
    if loops is None:
        return
    bad = [name for name in loops if name not in LOOPS]
    if bad or not loops or len(set(loops)) != len(loops):
        raise ValueError(f"loops must be distinct names of {list(LOOPS)}, got {loops}")


def run_invariance(bm: BenchModel, methods: list[str], batch_sizes: list[int], output_len: int = 128,
                   k: int = 4, prompts_file: str | None = None, num_prompts: int = 32, chat: bool = False,
                   draft_model: str | None = None, dflash_model: str | None = None, adaptive: bool = False,
                   draft_overrides: dict | None = None, loops: list[str] | None = None, copies: int = 1,
                   loop_batch_sizes: list[int] | None = None,
                   on_row: Callable[[list[dict]], None] | None = None) -> dict:
    """Plain decoding at batch 1, then every (method, batch size), in each of `loops` (None: the bench's
    loop): {"rows", "peers": [], "prompts"}. adaptive=False pins k (drafts every step: the most verify
    shapes). copies: every prompt submitted that many times (request i + j * num_prompts is a copy of
    request i), so that a batch can be larger than the prompts file; the copies are requests like any other.
    loop_batch_sizes: the batch sizes whose cells run in every loop (None: all); the others run in the
    first loop only. on_row(rows so far) after every row (e.g. to save partial results)."""
    if num_prompts < 1 or output_len < 1 or copies < 1:
        raise ValueError("num_prompts, output_len and copies must be >= 1")
    check_loops(loops, loop_batch_sizes)
    for m in methods:
        spec_config(m, k, draft_model, dflash_model or "given", adaptive)  # unknown / incomplete methods fail here
    ids, source = bench_prompt_ids(bm, prompts_file, num_prompts, output_len, chat)
    ids = ids * copies
    draft = load_draft(bm, draft_model, draft_overrides) if "draft_model" in methods else None
    tmp = None
    if "dflash" in methods and dflash_model == "random":
        tmp = tempfile.TemporaryDirectory(prefix="verispec-dflash-")
        dflash_model = random_drafter(bm, tmp.name)
    params = [greedy(output_len)] * len(ids)
    rows: list[dict] = []
    reference: list[list[int]] | None = None
    cells = [("none", 1)] + [(m, b) for m in methods for b in batch_sizes if (m, b) != ("none", 1)]
    for method, b in cells:
        mk = k
        if method == "dflash":
            mk = DFlashConfig.from_dict(json.loads((Path(dflash_model) / "config.json").read_text())).block_size - 1
        first: dict | None = None  # this cell's row in the first loop
        cell_loops = loops or [None]
        only_reference = (method, b) == ("none", 1) and "none" not in methods
        if only_reference or (loop_batch_sizes is not None and b not in loop_batch_sizes):
            cell_loops = cell_loops[:1]
        for loop in cell_loops:
            engine = make_engine(bm, spec_config(method, mk, draft_model, dflash_model, adaptive), b, ids,
                                 [output_len] * len(ids), draft, None if loop is None else LOOPS[loop])
            loop_name = "async" if engine.config.async_scheduling else "sync"
            run = drive(engine, ids, params, bm.device)
            del engine
            free_memory()
            if reference is None:
                reference = run.outputs
            row = cell_row(method, b, loop_name, mk, run, reference)
            if first is None:
                first = row
            else:
                row.update(compare_loops(row, first))
            rows.append(row)
            vs = (f"; vs {first['loop']}: {row['loop_mismatches']} differ, counters "
                  f"{'identical' if row['counters_match'] else 'DIFFER ' + json.dumps(row['counters_diff'])}"
                  if row is not first else "")
            print(f"  {method:12} batch {b:3} {loop_name:5}: {row['mismatches']:3}/{len(ids)} differ from plain "
                  f"batch 1 (first at {row['first_mismatch']}), accept {row.get('acceptance_rate', float('nan')):.4f}"
                  f"{vs}", flush=True)
            if on_row is not None:
                on_row([{key: v for key, v in r.items() if key != "_outputs"} for r in rows])
        first.pop("_outputs")
    if tmp is not None:
        tmp.cleanup()
    return {"rows": rows, "peers": [], "prompts": source}


def cell_row(method: str, batch_size: int, loop: str, k: int, run, reference: list[list[int]]) -> dict:
    """One (method, batch, loop) run as a row; its outputs ride along under "_outputs" until the loops
    are compared (compare_loops and run_invariance drop them)."""
    n_out = sum(len(o) for o in run.outputs)
    row = {"method": method, "batch_size": batch_size, "loop": loop, "k": k if method != "none" else 0,
           "num_prompts": len(reference), "output_tokens": n_out, "wall_s": run.wall_s,
           "tok_s": n_out / run.wall_s, "num_drafts": run.spec["num_drafts"],
           "counters": {c: run.spec[c] for c in COUNTERS}, **compare(run.outputs, reference),
           "output_hashes": [output_hash(o) for o in run.outputs], "_outputs": run.outputs}
    if method != "none":
        row["acceptance_rate"] = run.spec["num_accepted_tokens"] / max(run.spec["num_draft_tokens"], 1)
    return row
