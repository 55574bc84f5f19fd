"""`verispec bench invariance`: does a request's greedy output depend on the batch it runs in, or on
speculation?

The same prompts run greedily (no EOS stop, `output_len` tokens each): first plain decoding at batch 1
(max_num_seqs=1, one request at a time), the reference; then every (method, batch size) asked for, all
prompts submitted at once with max_num_seqs = the batch size. Each row counts the requests whose tokens
differ from the reference and where they first differ. The engine runs in the bench's --dtype with its
--batch-invariant setting, so one call measures one mode (bf16, float32, bf16 + batch_invariant) on any
prompts file; nothing is timed beyond one wall clock per row (the runs are not warmed up).

Row keys: method, batch_size, k, num_prompts, output_tokens, wall_s, tok_s, mismatches (requests whose
tokens differ from plain decoding at batch 1), first_mismatch (the earliest differing token index over
them, or None), mismatched ([request index, its first differing index] pairs), acceptance_rate (spec
methods: accepted / drafted), num_drafts.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from verispec.bench.drive import drive, free_memory, greedy, make_engine
from verispec.bench.models import BenchModel, load_draft
from verispec.bench.report import Column
from verispec.bench.spec import bench_prompt_ids, first_mismatch, random_drafter, spec_config
from verispec.spec_decode.dflash_model import DFlashConfig

COLUMNS: list[Column] = [
    ("method", "method", "s"), ("batch_size", "batch", "d"), ("mismatches", "mismatch", "d"),
    ("num_prompts", "of", "d"), ("first_mismatch", "first at", "d"), ("acceptance_rate", "accept", ".4f"),
    ("tok_s", "tok/s", ".1f"),
]
PEER_COLUMNS: list[Column] = []


def compare(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """mismatches, first_mismatch and mismatched ([index, first differing token]) of outputs vs reference."""
    mismatched = [[i, f] for i, (o, r) in enumerate(zip(outputs, reference, strict=True))
                  if (f := first_mismatch(o, r)) is not None]
    return {"mismatches": len(mismatched), "first_mismatch": min((f for _, f in mismatched), default=None),
            "mismatched": mismatched}


def run_invariance(bm: BenchModel, methods: list[str], batch_sizes: list[int], output_len: int = 128,
                   k: int = 4, prompts_file: str | None = None, num_prompts: int = 32, chat: bool = False,
                   draft_model: str | None = None, dflash_model: str | None = None, adaptive: bool = False,
                   draft_overrides: dict | None = None) -> dict:
    """Plain decoding at batch 1, then every (method, batch size): {"rows", "peers": [], "prompts"}.
    adaptive=False pins k (drafts every step: the most verify shapes)."""
    if num_prompts < 1 or output_len < 1:
        raise ValueError("num_prompts and output_len must be >= 1")
    for m in methods:
        spec_config(m, k, draft_model, dflash_model or "given", adaptive)  # unknown / incomplete methods fail here
    ids, source = bench_prompt_ids(bm, prompts_file, num_prompts, output_len, chat)
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
        engine = make_engine(bm, spec_config(method, mk, draft_model, dflash_model, adaptive), b, ids,
                             [output_len] * len(ids), draft)
        run = drive(engine, ids, params, bm.device)
        del engine
        free_memory()
        if reference is None:
            reference = run.outputs
        n_out = sum(len(o) for o in run.outputs)
        row = {"method": method, "batch_size": b, "k": mk if method != "none" else 0, "num_prompts": len(ids),
               "output_tokens": n_out, "wall_s": run.wall_s, "tok_s": n_out / run.wall_s,
               "num_drafts": run.spec["num_drafts"], **compare(run.outputs, reference)}
        if method != "none":
            row["acceptance_rate"] = run.spec["num_accepted_tokens"] / max(run.spec["num_draft_tokens"], 1)
        rows.append(row)
        print(f"  {method:12} batch {b:3}: {row['mismatches']:3}/{len(ids)} differ from plain batch 1 "
              f"(first at {row['first_mismatch']}), accept {row.get('acceptance_rate', float('nan')):.4f}", flush=True)
    if tmp is not None:
        tmp.cleanup()
    return {"rows": rows, "peers": [], "prompts": source}
