"""Training data for DFlash drafters: prompts mined from Python sources (train/prompts.py),
responses from the target through verispec itself, and the target's hidden states by teacher forcing.

Generation runs jobs (prompt ids, temperature, seed) in priority order: every prompt's first
response (greedy by default), then the extra responses (sampled, seeded). The engine is refilled in
bursts so that most steps are pure decode steps (those replay CUDA graphs; a step that also
prefills runs eagerly). Sequences (prompt ids, response ids, prompt group, temperature) can be
saved to / loaded from a JSONL file so generation and training can run as separate commands.
Features live in one device tensor; sequences past the memory budget are dropped whole.
"""

from __future__ import annotations

import ast
import gzip
import json
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from verispec.core.placeholder import PLACEHOLDER
from verispec.core.sampling_params import SamplingParams
from verispec.models.qwen2 import CausalLM
from verispec.train.prompts import CHAT_INSTRUCTIONS, humaneval_names, mine_functions
from verispec.worker.inputs import SeqChunk, allocate_kv_cache, build_batch

INSTRUCTIONS = CHAT_INSTRUCTIONS


@dataclass
class Sample:
    tokens: torch.Tensor  # [T] long, prompt + response
    feats: torch.Tensor  # [T, n_layers * H] target features
    prompt_len: int
    group: int = 0  # the prompt's index: responses to one prompt share it
    greedy: bool = True  # the response is the target's greedy output


class Seq(NamedTuple):
    """One generated sequence: prompt ids, response ids, prompt group, sampling temperature."""

    prompt: list[int]
    response: list[int]
    group: int = 0
    temperature: float = 0.0


@dataclass
class GenJob:
    """One response to generate."""

    prompt: list[int]
    group: int
    temperature: float
    seed: int | None
    top_p: float = 1.0
    max_tokens: int | None = None  # None: generate()'s max_new_tokens
    stop_token_ids: tuple[int, ...] = ()


def humaneval_entry_points() -> set[str]:
    """Names of the functions HumanEval defines (excluded from the training prompts)."""
    return humaneval_names()


def mine_stdlib_functions(limit: int, seed: int = 0, max_chars: int = 1500) -> list[str]:
    """Up to `limit` stubs (signature + docstring) of stdlib functions, deterministic for a seed."""
    return [s.text for s in mine_functions(["stdlib"], limit, seed, max_chars)]


def is_code_stub(text: str) -> bool:
    """Whether `text` is Python code that defines a function or class (a HumanEval-style stub), not a request."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) for n in ast.walk(tree))


def render_prompts(tokenizer, texts: list[str]) -> list[str]:
    """Chat prompts: a code stub is asked to be completed (the "chat" style, "Complete this function: ```python
    ...```"; scripts and `bench spec --chat` render HumanEval so); any other text (a natural-language
    request) is sent as the user message itself."""
    out = []
    for i, s in enumerate(texts):
        content = f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n```python\n{s}\n```" if is_code_stub(s) else s
        out.append(tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True))
    return out


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


def job_seed(seed: int, group: int, k: int) -> int:
    """A per-response sampling seed (distinct across prompts and responses)."""
    return zlib.crc32(f"{seed}/{group}/{k}".encode())


def make_jobs(prompts: list[list[int]], responses_per_prompt: int, temperature: float, extra_temperature: float,
              seed: int) -> list[GenJob]:
    """Response k of every prompt before response k+1 of any; response 0 at `temperature`, the
    extras at `extra_temperature` (each sampled response seeded)."""
    jobs = []
    for k in range(responses_per_prompt):
        t = temperature if k == 0 else extra_temperature
        jobs += [GenJob(p, g, t, job_seed(seed, g, k) if t > 0 else None) for g, p in enumerate(prompts)]
    return jobs


def generate(engine, jobs: list[GenJob], max_new_tokens: int, deadline: float, refill_below: float = 0.75,
             max_total_tokens: int | None = None) -> list[Seq]:
    """Run `jobs` in order; returns the sequences with >= 2 response tokens, in job order.

    New jobs go in when at most refill_below * max_num_seqs requests run (1.0: whenever a slot is
    free). No new job starts once the finished and running sequences may reach max_total_tokens
    (prompt + max_new_tokens counted for running ones). At the deadline unfinished responses are cut."""
    cap = engine.config.max_num_seqs
    low = max(1, int(cap * refill_below))
    latest: dict[int, list[int]] = {}
    running: dict[int, int] = {}  # job index -> its token bound
    used, nxt = 0, 0
    bar = tqdm(total=len(jobs), desc="generating", unit="seq")
    while True:
        if len(running) <= low:
            while nxt < len(jobs) and len(running) < cap:
                bound = len(jobs[nxt].prompt) + (jobs[nxt].max_tokens or max_new_tokens)
                if max_total_tokens is not None and used + sum(running.values()) + bound > max_total_tokens:
                    nxt = len(jobs)  # the feature memory is spoken for: no more jobs
                    break
                _add_job(engine, nxt, jobs[nxt], max_new_tokens)
                running[nxt] = bound
                nxt += 1
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            i = int(out.request_id[3:])
            latest[i] = resolved(out.outputs[0].token_ids)
            if out.finished and i in running:
                used += len(jobs[i].prompt) + len(latest[i])
                del running[i]
                bar.update(1)
        if time.monotonic() > deadline:
            _abort_all(engine, list(running))
            break
    bar.close()
    return [Seq(jobs[i].prompt, latest[i], jobs[i].group, jobs[i].temperature)
            for i in sorted(latest) if len(latest[i]) >= 2]


def resolved(ids: list[int]) -> list[int]:
    """The tokens before the first placeholder (the overlapped loop's not yet collected tokens)."""
    return ids[: ids.index(PLACEHOLDER)] if PLACEHOLDER in ids else ids


def _add_job(engine, i: int, job: GenJob, max_new_tokens: int) -> None:
    params = SamplingParams(temperature=job.temperature, top_p=job.top_p if job.temperature > 0 else 1.0,
                            max_tokens=job.max_tokens or max_new_tokens, seed=job.seed,
                            stop_token_ids=list(job.stop_token_ids))
    engine.add_request(f"gen{i}", None, params, job.prompt)


def _abort_all(engine, ids: list[int]) -> None:
    """Abort running jobs and let an in-flight (overlapped) step land before the cache goes."""
    for i in ids:
        engine.abort_request(f"gen{i}")
    for _ in range(4):
        if not engine.has_unfinished_requests():
            break
        engine.step()


def fit_budget(seqs, bytes_per_token: int, max_bytes: float) -> int:
    """How many leading sequences fit in max_bytes of features (later ones are dropped whole)."""
    used = 0
    for i, q in enumerate(seqs):
        used += (len(q[0]) + len(q[1])) * bytes_per_token
        if used > max_bytes:
            return i
    return len(seqs)


def feature_batches(seqs, batch_tokens: int) -> list[list[int]]:
    """Sequence indices grouped by length into forward batches of about batch_tokens tokens."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]) + len(seqs[i][1]))
    batches, cur, n = [], [], 0
    for i in order:
        t = len(seqs[i][0]) + len(seqs[i][1])
        if cur and n + t > batch_tokens:
            batches.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += t
    return batches + ([cur] if cur else [])


@torch.no_grad()
def extract_features(target: CausalLM, seqs, layers: tuple[int, ...], store_dtype, batch_tokens: int,
                     max_gb: float = 60.0) -> list[Sample]:
    """Teacher-forced target forward over prompt + response; features of `layers` at every position,
    in one [tokens, len(layers) * H] tensor. `seqs`: Seq or (prompt, response) pairs; the leading
    ones whose features fit in max_gb GiB are kept (returned in the same order)."""
    c, bs = target.config, 16
    dev, dtype = target.lm_head_weight.device, target.lm_head_weight.dtype
    seqs = [Seq(*q) for q in seqs]
    bpt = len(layers) * c.hidden_size * torch.empty((), dtype=store_dtype).element_size()
    seqs = seqs[: fit_budget(seqs, bpt, max_gb * 2**30)]
    lens = [len(q.prompt) + len(q.response) for q in seqs]
    starts = [0] * len(seqs)
    for i in range(1, len(seqs)):
        starts[i] = starts[i - 1] + lens[i - 1]
    arena = torch.empty(sum(lens), len(layers) * c.hidden_size, dtype=store_dtype, device=dev)
    for b in tqdm(feature_batches(seqs, batch_tokens), desc="target features", unit="batch"):
        toks = [seqs[i].prompt + seqs[i].response for i in b]
        chunks, next_block = [], 0
        for t in toks:
            nb = -(-len(t) // bs)
            chunks.append(SeqChunk(t, 0, list(range(next_block, next_block + nb))))
            next_block += nb
        kv = allocate_kv_cache(c.num_layers, next_block, bs, c.num_kv_heads, c.head_dim, dtype, dev)
        ids, pos, meta = build_batch(chunks, bs, dev)
        _, cap = target(ids, pos, meta, kv, layers)
        feats, off = torch.cat(cap, dim=-1), 0
        for i in b:
            arena[starts[i] : starts[i] + lens[i]] = feats[off : off + lens[i]]
            off += lens[i]
    tokens = torch.tensor([t for q in seqs for t in q.prompt + q.response], dtype=torch.long).to(dev)
    return [Sample(tokens[starts[i] : starts[i] + lens[i]], arena[starts[i] : starts[i] + lens[i]], len(q.prompt),
                   q.group, q.temperature == 0) for i, q in enumerate(seqs)]


def _open(path: Path, mode: str):
    """A text file, gzip-compressed when its name ends in .gz."""
    return gzip.open(path, mode + "t", encoding="utf-8") if Path(path).suffix == ".gz" else open(path, mode)


def save_sequences(path: Path, seqs: list[Seq], fingerprint: str) -> None:
    """JSONL (gzip when the name ends in .gz): a header line with the target fingerprint, then one
    {"prompt", "response", "group", "temperature"} per line."""
    with _open(path, "w") as f:
        f.write(json.dumps({"target_fingerprint": fingerprint, "num_sequences": len(seqs)}) + "\n")
        for q in seqs:
            q = Seq(*q)
            f.write(json.dumps({"prompt": q.prompt, "response": q.response, "group": q.group,
                                "temperature": q.temperature}) + "\n")


def load_sequences(path: Path, fingerprint: str) -> list[Seq]:
    """The sequences of save_sequences, plain or .gz (older files: one greedy response per prompt)."""
    with _open(path, "r") as f:
        head = json.loads(f.readline())
        if head.get("target_fingerprint") != fingerprint:
            raise ValueError(f"sequences in {str(path)!r} were generated by another target model")
        return [Seq(d["prompt"], d["response"], d.get("group", i), d.get("temperature", 0.0))
                for i, d in enumerate(map(json.loads, f))]
