"""`verispec bench structured`: the cost of structured outputs, tok/s with and without a JSON schema, per
batch size and speculative method (none, ngram, self, draft_model).

For each batch size b and method one engine runs two modes on the same prompts, alternating, `repeats`
times each after a warm-up of both: "json" (greedy under the schema: the grammar mask applies when
sampling and when verifying drafts; a request ends when its grammar does, or at max_tokens) and "free"
(greedy, no schema, ignore_eos). Every free request's max_tokens is the length of the same prompt's JSON
output under method none at the same b, so both modes generate the same number of tokens per request and
the batch shrinks the same way; tok/s is output tokens / wall time, as in bench spec. Greedy decoding under
a grammar is lossless too: every method's JSON tokens must equal none's (mismatches are counted).

Each JSON output that ended with its grammar (not at max_tokens) is parsed and validated against the
schema with `jsonschema` when it is installed (else only parsed: `validator` says which).

Row keys: method, mode, batch_size, k, num_prompts, output_tokens, wall_s, tok_s, runs (every run's tok/s),
speedup (over none in the same mode and batch size), vs_free (json rows: tok/s / the free row's),
acceptance_rate, mean_acceptance_length, mean_k, num_steps, mismatches, first_mismatch; json rows also
finished (outputs ended by the grammar), valid (of those), truncated (ended at max_tokens), refused (tokens
the engine's grammar refused: a bug if ever > 0), validator.
"""

from __future__ import annotations

import json
from pathlib import Path

from verispec.bench.drive import drive, free_memory, make_engine
from verispec.bench.models import BenchModel, load_draft
from verispec.bench.prompts import Prompt, dataset_prompts, random_prompts
from verispec.bench.report import Column
from verispec.bench.spec import _diff, _row, median_row, spec_config
from verispec.core.sampling_params import SamplingParams
from verispec.core.structured import StructuredOutputsParams

COLUMNS: list[Column] = [
    ("method", "method", "s"), ("mode", "mode", "s"), ("batch_size", "batch", "d"), ("tok_s", "tok/s", ".1f"),
    ("runs", "runs tok/s", "range"), ("vs_free", "json/free", ".3f"), ("speedup", "speedup", ".2f"),
    ("mean_k", "mean k", ".2f"), ("acceptance_rate", "accept", ".3f"), ("output_tokens", "out tok", "d"),
    ("mismatches", "mismatch", "d"), ("finished", "finished", "d"), ("valid", "valid", "d"),
    ("refused", "refused", "d"),
]
PEER_COLUMNS: list[Column] = []
METHODS = ("none", "ngram", "self", "draft_model")

# A bounded answer shape for programming requests: every string and array has a maximum (at most ~1,000
# characters of content), so a greedy model ends it before max_tokens = 384 (the real 0.5B filled a looser
# version, 300-character code strings and 5 steps, past 256 tokens); a truncated output is counted as such.
DEFAULT_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 48},
        "language": {"enum": ["python", "javascript", "typescript", "c", "c++", "rust", "go", "java", "bash",
                              "sql", "other"]},
        "steps": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object",
            "properties": {"description": {"type": "string", "maxLength": 80},
                           "code": {"type": "string", "maxLength": 160}},
            "required": ["description", "code"], "additionalProperties": False}},
        "complexity": {"enum": ["O(1)", "O(log n)", "O(n)", "O(n log n)", "O(n^2)", "other"]},
        "tests": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 40}},
    },
    "required": ["title", "language", "steps", "complexity", "tests"],
    "additionalProperties": False,
}
DEFAULT_INSTRUCTION = ("Answer as one short JSON object: a title, the language, at most three steps (each a "
                       "one-line description and a short code snippet), the time complexity and up to three "
                       "test names.")


def load_schema(path: str | None) -> dict:
    """The JSON schema of a file (DEFAULT_SCHEMA for None), checked at once: a ValueError names the problem
    (bad JSON, not a schema, xgrammar missing) before any model loads."""
    if path is None:
        schema = DEFAULT_SCHEMA
    else:
        try:
            schema = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--schema {path}: {e}") from None
    StructuredOutputsParams(json=schema)  # validates (and needs xgrammar)
    return schema


def check_output(text: str, schema: dict) -> tuple[bool, str]:
    """(whether `text` is one JSON document valid under `schema`, the validator used): jsonschema when it is
    installed, else json.loads only."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return False, "json.loads"
    try:
        import jsonschema
    except ImportError:
        return True, "json.loads"
    try:
        jsonschema.validate(doc, schema)
    except jsonschema.ValidationError:
        return False, "jsonschema"
    return True, "jsonschema"


def prompt_ids(bm: BenchModel, prompts_file: str | None, num: int, chat: bool, instruction: str) -> tuple[list, str]:
    """(token ids of `num` prompts, where they came from): text prompts get `instruction` appended and, with
    chat, the chat template (BOS where the model wants one); random token ids where random weights have no
    tokenizer (grammars then cannot compile: the engine needs the vocabulary)."""
    if not (bm.has_tokenizer or prompts_file):
        return [bm.encode(p) for p in random_prompts(num, 64, 1, bm.config.vocab_size, bm.setup.seed)], "random ids"
    ps = dataset_prompts(prompts_file, num, 1)
    source = prompts_file or "humaneval"
    texts = [f"{p.text.rstrip()}\n\n{instruction}" if p.text and instruction else p.text for p in ps]
    if chat:
        from verispec.train.data import render_prompts

        if not all(texts):
            raise ValueError("--chat needs text prompts")
        texts = render_prompts(bm.tokenizer, texts)
        source += " (chat template)"
    return [bm.encode(Prompt(t, p.token_ids if t is None else None, 1)) for t, p in zip(texts, ps, strict=True)], source


def _json_params(schema: dict, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          structured_outputs=StructuredOutputsParams(json=schema))


def _free_params(lengths: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=max(n, 1), ignore_eos=True) for n in lengths]


def run_structured(bm: BenchModel, methods: list[str], batch_sizes: list[int], max_tokens: int = 512, k: int = 4,
                   draft_model: str | None = None, prompts_file: str | None = None, num_prompts: int = 16,
                   schema: dict | None = None, chat: bool = False, instruction: str = DEFAULT_INSTRUCTION,
                   repeats: int = 3, adaptive: bool = False, draft_overrides: dict | None = None) -> dict:
    """Every (batch size, method) in both modes, `repeats` runs each (the row: the median run); returns
    {"rows", "peers": [], "prompts", "schema"}. Batch size b runs max(num_prompts, b) prompts."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ValueError(f"unknown methods {bad}: choose from {', '.join(METHODS)}")
    schema = DEFAULT_SCHEMA if schema is None else schema
    methods = ["none"] + [m for m in methods if m != "none"]
    need = max([num_prompts, *batch_sizes])
    all_ids, source = prompt_ids(bm, prompts_file, need, chat, instruction)
    if len(all_ids) < need:
        raise ValueError(f"{source} has {len(all_ids)} prompts; batch sizes {batch_sizes} need {need}")
    draft = load_draft(bm, draft_model, draft_overrides) if draft_model and "draft_model" in methods else None
    rows: list[dict] = []
    for b in batch_sizes:
        ids = all_ids[: max(num_prompts, b)]
        json_sp = [_json_params(schema, max_tokens)] * len(ids)
        base: dict[str, list[list[int]]] = {}
        lengths: list[int] = []
        for method in methods:
            engine = make_engine(bm, spec_config(method, k, draft_model, None, adaptive), b, ids,
                                 [max_tokens] * len(ids), draft)
            first = drive(engine, ids, json_sp, bm.device)  # warm-up (and, under none, the lengths)
            if method == "none":
                lengths = [len(o) for o in first.outputs]
            drive(engine, ids, _free_params(lengths), bm.device)
            refused0 = engine.get_metrics()["structured_output_refused_tokens"]
            runs: dict[str, list] = {"json": [], "free": []}
            for _ in range(repeats):  # alternating, so drift over the runs falls on both modes alike
                runs["json"].append(drive(engine, ids, json_sp, bm.device))
                runs["free"].append(drive(engine, ids, _free_params(lengths), bm.device))
            refused = engine.get_metrics()["structured_output_refused_tokens"] - refused0
            del engine
            free_memory()
            for mode in ("free", "json"):
                row, i = median_row([_row(bm, method, b, k, r) for r in runs[mode]])
                row.update(mode=mode, adaptive=adaptive if method != "none" else None)
                outs = runs[mode][i].outputs
                base.setdefault(mode, outs)
                diffs = [_diff(r.outputs, base[mode]) for r in runs[mode]]
                firsts = [f for _, f in diffs if f is not None]
                row["mismatches"], row["first_mismatch"] = max(n for n, _ in diffs), min(firsts) if firsts else None
                ref = next((r for r in rows if (r["method"], r["mode"], r["batch_size"]) == ("none", mode, b)), row)
                row["speedup"] = row["tok_s"] / ref["tok_s"]
                if mode == "json":
                    free_row = rows[-1]
                    row["vs_free"] = row["tok_s"] / free_row["tok_s"]
                    row.update(_validity(bm, outs, max_tokens, schema), refused=refused)
                rows.append(row)
                print(f"  {method:12} {mode:4} batch {b:3}: {row['tok_s']:9.1f} tok/s, {row['output_tokens']} tokens, "
                      f"{row['mismatches']} mismatches" + (f", json/free {row['vs_free']:.3f}, "
                                                           f"{row['valid']}/{row['finished']} valid"
                                                           if mode == "json" else ""), flush=True)
    return {"rows": rows, "peers": [], "prompts": source, "schema": schema}


def _validity(bm: BenchModel, outputs: list[list[int]], max_tokens: int, schema: dict) -> dict:
    """Counts of JSON outputs ended by their grammar, valid among those, and cut at max_tokens."""
    finished = [o for o in outputs if len(o) < max_tokens]
    checks = [check_output(bm.tokenizer.decode(o), schema) for o in finished] if bm.has_tokenizer else []
    return {"finished": len(finished), "valid": sum(ok for ok, _ in checks), "truncated": len(outputs) - len(finished),
            "validator": checks[0][1] if checks else None}
