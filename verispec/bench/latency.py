"""`verispec bench latency`: per batch size, time to first token, time per output token and decode speed.

All requests of a batch are submitted at once with `input_len` random prompt tokens and generate exactly
`output_len` tokens (greedy, no EOS stop); every engine step is timed with the GPU synchronized.

Row keys: batch_size, ttft_ms_p50, ttft_ms_p99 (over requests and iterations), tpot_ms_p50, tpot_ms_p99 (per
decode step: step time / tokens each sequence gained), step_ms_p50, decode_tok_s (output tokens of decode steps /
their time), mem_frac, flop_frac, hw_frac, hw_bound (decode steps), acceptance_rate and mean_acceptance_length
(with --speculative-config). Peer rows: peer, batch_size, ttft_ms, tpot_ms, decode_tok_s, hw_frac, ratio
(verispec decode_tok_s / peer's) or error.
"""

from __future__ import annotations

from verispec.bench.drive import drive, free_memory, greedy, make_engine, pct
from verispec.bench.hardware import decode_steps, hardware_use, step_flops
from verispec.bench.models import BenchModel
from verispec.bench.prompts import random_prompts
from verispec.bench.report import Column

COLUMNS: list[Column] = [
    ("batch_size", "batch", "d"), ("ttft_ms_p50", "TTFT p50 ms", ".2f"), ("ttft_ms_p99", "TTFT p99 ms", ".2f"),
    ("tpot_ms_p50", "TPOT p50 ms", ".3f"), ("tpot_ms_p99", "TPOT p99 ms", ".3f"),
    ("decode_tok_s", "decode tok/s", ".1f"), ("mean_acceptance_length", "acc len", ".2f"), ("hw", "hw%", "s"),
]
PEER_COLUMNS: list[Column] = [
    ("peer", "peer", "s"), ("batch_size", "batch", "d"), ("ttft_ms", "TTFT ms", ".2f"), ("tpot_ms", "TPOT ms", ".3f"),
    ("decode_tok_s", "decode tok/s", ".1f"), ("hw", "hw%", "s"), ("ratio", "verispec/peer", ".2f"),
]


def _row(bm: BenchModel, batch: int, runs: list) -> dict:
    ttft, tpot, step_ms, dec = [], [], [], []
    for run in runs:
        ttft += [t * 1e3 for t in run.ttft_s]
        for s in run.steps:
            if not s.prefill and s.new_tokens:
                dec.append(s)
                step_ms.append(s.seconds * 1e3)
                tpot.append(s.seconds * 1e3 * s.num_seqs / s.new_tokens)
    secs = sum(s.seconds for s in dec)
    row = {
        "batch_size": batch, "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
        "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p99": pct(tpot, 99), "step_ms_p50": pct(step_ms, 50),
        "decode_tok_s": sum(s.new_tokens for s in dec) / secs if secs else 0.0,
        **hardware_use(bm.config, bm.elem_bytes, dec, secs, step_flops(bm.config, dec), bm.step_weight_bytes),
    }
    drafts = sum(r.spec["num_drafts"] for r in runs)
    if drafts:
        acc = sum(r.spec["num_accepted_tokens"] for r in runs)
        row["acceptance_rate"] = acc / max(sum(r.spec["num_draft_tokens"] for r in runs), 1)
        row["mean_acceptance_length"] = 1 + acc / drafts
    return row


def run_latency(bm: BenchModel, batch_sizes: list[int], input_len: int, output_len: int,
                spec: dict | None = None, peer: str | None = None, compile_peer: bool = True,
                num_iters: int = 3, warmup: int = 1, draft: tuple | None = None) -> dict:
    """Measure every batch size with one engine (sized for the largest); returns the result dict."""
    vocab = bm.config.vocab_size
    biggest = max(batch_sizes)
    sizing = random_prompts(biggest, input_len, output_len, vocab)
    engine = make_engine(bm, spec, biggest, [p.token_ids for p in sizing], [output_len] * biggest, draft)
    rows = []
    for b in batch_sizes:
        runs = []
        for it in range(warmup + num_iters):
            ps = random_prompts(b, input_len, output_len, vocab, seed=1000 * b + it)
            n = output_len if it >= warmup else min(output_len, 8)
            run = drive(engine, [p.token_ids for p in ps], [greedy(n)] * b, bm.device)
            if it >= warmup:
                runs.append(run)
        rows.append(_row(bm, b, runs))
    del engine
    free_memory()
    peers = []
    if peer == "hf":
        peers = _hf_rows(bm, batch_sizes, input_len, output_len, compile_peer, rows)
    return {"rows": rows, "peers": peers}


def _hf_rows(bm: BenchModel, batch_sizes: list[int], input_len: int, output_len: int, compile_peer: bool,
             rows: list[dict]) -> list[dict]:
    from verispec.bench.peers import hf_latency, hf_model, hf_modes

    hf = hf_model(bm.model)
    out = []
    for mode in hf_modes(compile_peer):
        for b, row in zip(batch_sizes, rows, strict=True):
            ps = random_prompts(b, input_len, output_len, bm.config.vocab_size, seed=7)
            r = hf_latency(hf, [p.token_ids for p in ps], output_len, mode)
            if "error" not in r:
                steps = decode_steps(b, input_len, output_len, r["tpot_s"])
                secs = r["tpot_s"] * (output_len - 1)
                r.update(hardware_use(bm.config, bm.elem_bytes, steps, secs, step_flops(bm.config, steps)))
                r.update(ttft_ms=r["ttft_s"] * 1e3, tpot_ms=r["tpot_s"] * 1e3,
                         ratio=row["decode_tok_s"] / r["decode_tok_s"] if r["decode_tok_s"] else None)
            out.append({"batch_size": b, **r})
    del hf
    return out
