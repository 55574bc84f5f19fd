"""Many concurrent streaming clients against the real server: every request completes or fails cleanly,
none hangs, /health answers throughout, and every KV block comes back."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai
import pytest
from server_util import ServerThread, wait_for
from tiny import text_model, tiny_engine

from verispec.sampling_params import SamplingParams

PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:", "# sort a list in place\n",
           "SELECT * FROM", "fn main() {", "Hello, my name is", "The quick brown fox"]


# A leaving client asks for this many tokens (ignore_eos) and disconnects after its second event: far
# more than the engine can generate before the server sees the disconnect, so every departure is an abort.
LEAVER_MAX_TOKENS = 3000


def _expected_outcome(i: int) -> str:
    return "error" if i % 11 == 0 else "left" if i % 9 == 0 else "ok"


async def _one(http: httpx.AsyncClient, i: int, max_tokens: int) -> str:
    """One client request; returns its outcome: ok | error | left."""
    rng = random.Random(i)
    chat = i % 5 == 0
    body: dict = {"max_tokens": rng.randint(1, max_tokens), "temperature": rng.choice([0.0, 0.8]),
                  "seed": i, "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    else:
        body["prompt"] = rng.choice(PROMPTS)
    leave_early = _expected_outcome(i) == "left"
    if i % 11 == 0:
        body["max_tokens"] = -3  # a bad request: must get a clean 400
    elif leave_early:
        body["max_tokens"], body["ignore_eos"] = LEAVER_MAX_TOKENS, True
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            err = r.json()["error"]
            assert r.status_code in (400, 429, 503) and err["message"], (r.status_code, err)
            return "error"
        n_data, usage, finish, done = 0, None, None, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            n_data += 1
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            for c in ev["choices"]:
                finish = c["finish_reason"] or finish
            usage = ev.get("usage") or usage
            if leave_early and n_data >= 2:
                return "left"  # closing the stream must abort the request
        assert done and finish in ("stop", "length"), (done, finish)
        assert 1 <= usage["completion_tokens"] <= body["max_tokens"], usage
        return "ok"


async def _health_poller(url: str, stop: asyncio.Event, seen: list) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10) as h:
        while not stop.is_set():
            t0 = time.monotonic()
            r = await h.get("/health")
            seen.append((r.status_code, time.monotonic() - t0))
            try:
                await asyncio.wait_for(stop.wait(), 0.1)
            except TimeoutError:
                pass


async def _load(url: str, concurrency: int, num_requests: int, max_tokens: int, per_request_s: float) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    sem = asyncio.Semaphore(concurrency)
    inflight = peak = 0

    async def job(http: httpx.AsyncClient, i: int) -> str:
        nonlocal inflight, peak
        async with sem:
            inflight += 1
            peak = max(peak, inflight)
            try:
                return await asyncio.wait_for(_one(http, i, max_tokens), per_request_s)
            finally:
                inflight -= 1

    stop, health = asyncio.Event(), []
    poller = asyncio.create_task(_health_poller(url, stop, health))
    async with httpx.AsyncClient(base_url=url, timeout=per_request_s, limits=limits) as http:
        outcomes = await asyncio.gather(*(job(http, i) for i in range(num_requests)))
    stop.set()
    await poller
    return {"outcomes": outcomes, "peak": peak, "health": health}


def run_load(srv: ServerThread, concurrency: int, num_requests: int, max_tokens: int, total_s: float) -> dict:
    """Drive the load and check the invariants; returns the raw results."""
    wait_for(srv.idle, 30, "an idle engine")
    start_blocks = srv.aengine.snapshot["num_free_blocks"]
    start_aborted = srv.aengine.num_aborted
    t0 = time.monotonic()
    res = asyncio.run(asyncio.wait_for(_load(srv.url, concurrency, num_requests, max_tokens, total_s), total_s))
    elapsed = time.monotonic() - t0
    outcomes = res["outcomes"]
    expected = [_expected_outcome(i) for i in range(num_requests)]
    assert outcomes == expected  # the queue limit (1024) is never reached, so no 503s either
    assert res["peak"] == concurrency
    assert res["health"] and all(code == 200 for code, _ in res["health"]), res["health"][:5]
    # Idle means every leaver's request is gone from the engine: aborted (the engine thread counts the
    # abort before it publishes the snapshot that shows the request gone), or run to its 3000 tokens.
    srv.wait_blocks(start_blocks, timeout=60)
    assert srv.aengine.num_aborted - start_aborted == expected.count("left") > 0
    res["elapsed"] = elapsed
    return res


@pytest.fixture(scope="module")
def tiny_srv():
    s = ServerThread(tiny_engine(text_model()), "tiny").start()
    yield s
    s.stop()


def test_load_tiny(tiny_srv):
    res = run_load(tiny_srv, concurrency=64, num_requests=200, max_tokens=8, total_s=120)
    assert res["outcomes"].count("left") == 20  # i = 9, 18, ..., 198 but 99 and 198 (bad requests: i % 11 == 0)
    metrics = httpx.get(tiny_srv.url + "/metrics").text  # /metrics reports the same exact count
    assert f'verispec:request_aborted_total{{model_name="tiny"}} {float(tiny_srv.aengine.num_aborted)}' in metrics


def test_bench_serve(tiny_srv):
    from verispec.bench.serve import format_report, percentiles, run_bench_serve

    assert percentiles([3.0, 1.0, 2.0, 4.0]) == {"mean": 2.5, "p50": 2.0, "p90": 4.0, "p99": 4.0}
    res = run_bench_serve(tiny_srv.url, None, ["a b c", "def f():"], concurrency=4, num_requests=8, max_tokens=5)
    assert res["model"] == "tiny" and res["completed"] == 8 and res["failed"] == 0
    assert res["output_tokens"] == 8 * 5  # ignore_eos: every request runs to max_tokens
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        v = res[key]
        assert 0 < v["p50"] <= v["p90"] <= v["p99"], (key, v)
    assert res["e2e_s"]["p50"] >= res["ttft_s"]["p50"] and res["output_tok_per_s"] > 0
    assert "TTFT" in format_report(res)
    bad = run_bench_serve(tiny_srv.url, "other-model", None, concurrency=2, num_requests=2, max_tokens=2)
    assert bad["completed"] == 0 and bad["failed"] == 2 and "404" in bad["errors"][0]


# ---- the real 0.5B model ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_llm(qwen05_path):
    from verispec import LLM

    return LLM("qwen2.5-coder-0.5b-instruct", device="cpu", max_model_len=1024)


def test_real_model_openai_client(real_llm):
    """A handful of requests with real weights, tokenizer and chat template; greedy output equals offline."""
    msgs = [{"role": "user", "content": "What is 2+2? Answer with just the number."}]
    ref_chat = real_llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].text
    ref_code = real_llm.generate(["def add(a, b):"], SamplingParams(temperature=0.0, max_tokens=12))[0]
    s = ServerThread(real_llm.engine, "qwen").start()
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="qwen", messages=msgs, max_tokens=8, temperature=0)
        assert r.choices[0].message.content == ref_chat
        assert "4" in r.choices[0].message.content
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="qwen", messages=msgs, max_tokens=8, temperature=0, stream=True))
        assert streamed == ref_chat
        r = c.completions.create(model="qwen", prompt="def add(a, b):", max_tokens=12, temperature=0)
        assert r.choices[0].text == ref_code.outputs[0].text
        assert r.usage.prompt_tokens == len(ref_code.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref_code.outputs[0].token_ids)
    finally:
        s.stop()


@pytest.mark.slow
def test_load_real_model(real_llm):
    s = ServerThread(real_llm.engine, "qwen").start()
    try:
        run_load(s, concurrency=64, num_requests=200, max_tokens=8, total_s=600)
    finally:
        s.stop()
