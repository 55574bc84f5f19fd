"""`verispec bench serve`: concurrent streaming clients against a running OpenAI-compatible server.

Measures, per request, time to first token (TTFT), time per output token after the first (TPOT), the gaps
between streamed chunks (ITL) and end-to-end latency, and overall output tokens per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # httpx is imported where it is used, so the CLI's parser builds without it
    import httpx

DEFAULT_PROMPTS = [
    "def fibonacci(n):", "Write a Python function that reverses a linked list.", "class LRUCache:",
    "# Parse a CSV file and print the sum of the second column\n", "SELECT name, COUNT(*) FROM orders",
    "fn main() {", "Explain what a mutex is in one paragraph.", "import numpy as np\n\ndef softmax(x):",
]


@dataclass
class _Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)


def percentiles(values: list[float], ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """Mean and nearest-rank percentiles (p50/p90/p99) of `values`; zeros for an empty list."""
    if not values:
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in ps}}
    s = sorted(values)
    out = {"mean": sum(s) / len(s)}
    for p in ps:
        k = max(0, min(len(s) - 1, -(-p * len(s) // 100) - 1))
        out[f"p{p}"] = s[k]
    return out


async def _one(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> _Result:
    import httpx

    res = _Result()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    last = None
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                res.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    res.error = str(ev["error"].get("message"))
                    return res
                if ev.get("usage"):
                    res.output_tokens = ev["usage"]["completion_tokens"]
                if any(c.get("text") for c in ev.get("choices", [])):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - t0
    res.ok = last is not None
    if res.ok and res.output_tokens == 0:  # no usage chunk: count chunks (a lower bound with speculation)
        res.output_tokens = len(res.itl) + 1
    if not res.ok:
        res.error = "no tokens streamed"
    return res


async def _run(base_url: str, model: str | None, prompts: list[str], concurrency: int, num_requests: int,
               max_tokens: int, api_key: str | None, timeout: float) -> tuple[list[_Result], float, str]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout,
                                 limits=limits) as http:
        if model is None:
            r = await http.get("/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        sem = asyncio.Semaphore(concurrency)

        async def job(i: int) -> _Result:
            async with sem:
                return await _one(http, model, prompts[i % len(prompts)], max_tokens)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(job(i) for i in range(num_requests)))
        return list(results), time.perf_counter() - t0, model


def run_bench_serve(base_url: str, model: str | None, prompts: list[str] | None = None, concurrency: int = 8,
                    num_requests: int = 64, max_tokens: int = 128, api_key: str | None = None,
                    timeout: float = 600.0) -> dict:
    """Run the benchmark; returns the numbers (seconds; throughput in tokens or requests per second)."""
    if concurrency < 1 or num_requests < 1 or max_tokens < 1:
        raise ValueError("concurrency, num_requests and max_tokens must be >= 1")
    prompts = list(prompts or DEFAULT_PROMPTS)
    results, duration, model = asyncio.run(
        _run(base_url, model, prompts, concurrency, num_requests, max_tokens, api_key, timeout))
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "base_url": base_url, "model": model, "concurrency": concurrency, "num_requests": num_requests,
        "max_tokens": max_tokens, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
        "duration_s": duration, "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / duration if duration > 0 else 0.0,
        "request_per_s": len(ok) / duration if duration > 0 else 0.0,
        "ttft_s": percentiles([r.ttft for r in ok]), "tpot_s": percentiles(tpot),
        "itl_s": percentiles([x for r in ok for x in r.itl]), "e2e_s": percentiles([r.e2e for r in ok]),
    }


def format_report(res: dict) -> str:
    """A small table of the results."""
    lines = [
        f"model {res['model']} at {res['base_url']}: {res['completed']}/{res['num_requests']} requests ok "
        f"({res['failed']} failed), concurrency {res['concurrency']}, max_tokens {res['max_tokens']}",
        f"duration {res['duration_s']:.2f}s, output {res['output_tokens']} tokens, "
        f"{res['output_tok_per_s']:.1f} tok/s, {res['request_per_s']:.2f} req/s",
        f"{'metric (ms)':12} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}",
    ]
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        v = res[key]
        lines.append(f"{label:12} " + " ".join(f"{v[k] * 1000:9.1f}" for k in ("mean", "p50", "p90", "p99")))
    lines += [f"error: {e}" for e in res["errors"]]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `verispec bench serve`."""
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--concurrency", type=int, default=8, help="clients streaming at once")
    p.add_argument("--num-requests", type=int, default=64, help="requests in all")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (ignore_eos)")
    p.add_argument("--prompt-file", default=None, help="one prompt per line (default: built-in prompts)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--json", default=None, help="write the numbers to this file")


def main(argv: list[str] | None = None) -> int:
    """Parse `argv`, run, print the table, optionally write --json."""
    p = argparse.ArgumentParser(prog="verispec bench serve")
    add_arguments(p)
    a = p.parse_args(argv)
    prompts = None
    if a.prompt_file:
        with open(a.prompt_file, encoding="utf-8") as f:
            prompts = [ln.rstrip("\n").replace("\\n", "\n") for ln in f if ln.strip()]
    res = run_bench_serve(a.url, a.model, prompts, a.concurrency, a.num_requests, a.max_tokens, a.api_key)
    print(format_report(res))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)
    return 0 if res["completed"] else 1
