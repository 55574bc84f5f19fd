"""Many concurrent streaming clients against the real server: every request completes or fails cleanly,
none hangs, /health answers throughout, and every KV block comes back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

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

    # 200 MB of KV; no gc.freeze: the server's objects and the engine reference each other, and with the
    # engine frozen that cycle (the model) outlived the module.
    return LLM("qwen2.5-coder-0.5b-instruct", device="cpu", max_model_len=1024, num_gpu_blocks=512, gc_freeze=False)


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


# ---- large bodies next to small streams ----------------------------------------------------------------
SENDER = Path(__file__).with_name("big_body_sender.py")
# A small streamed request: 64 tokens, ~0.5 s on the tiny model on this 2-core machine. Reading four 5 MB bodies
# still stalls the engine thread for a fixed ~0.1-0.2 s (the GIL is shared: h11, the JSON parse), so requests of
# 12 tokens (~0.08 s) come out ~2x slower while the bodies arrive (docs/ARCHITECTURE.md, known gaps).
SMALL_TOKENS = 64


async def _small_stream(http: httpx.AsyncClient) -> float:
    """One small streamed completion; its latency, first byte sent to [DONE]."""
    t0 = time.monotonic()
    body = {"prompt": "def f():", "max_tokens": SMALL_TOKENS, "ignore_eos": True, "temperature": 0.0, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) == SMALL_TOKENS + 1
    return time.monotonic() - t0


async def _waves(url: str, num_waves: int | None, until: threading.Event | None) -> tuple[list[float], list[float]]:
    """Waves of 4 concurrent small streams, with /health polled throughout: `num_waves` of them, or (until)
    waves until the event is set. Returns (small latencies, /health latencies)."""
    small, health, stop = [], [], asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        async def poll() -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                assert (await http.get("/health")).status_code == 200
                health.append(time.monotonic() - t0)
                with contextlib.suppress(TimeoutError):  # ~500 polls a second: enough that the p99
                    await asyncio.wait_for(stop.wait(), 0.002)  # is a percentile, not the one slowest poll

        poller = asyncio.create_task(poll())
        wave = 0
        while (num_waves is not None and wave < num_waves) or (until is not None and not until.is_set()):
            small += await asyncio.gather(*(_small_stream(http) for _ in range(4)))
            wave += 1
        stop.set()
        await poller
    return small, health


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


@pytest.mark.parametrize("path, num_bytes", [("/v1/completions", 5 * 2**20), ("/v1/chat/completions", 5 * 2**20),
                                             ("/v1/chat/completions", 400_000)],
                         ids=["completion-5MB", "chat-5MB", "chat-400KB-tokenized"])
def test_large_bodies_do_not_stall_small_streams(tiny_srv, path, num_bytes):
    """4 concurrent large bodies (from another process, as real clients are) while small requests stream:
    /health stays fast and the small requests take at most 1.5x what they take without the large bodies,
    measured in the same test, alternating rounds. Every large body gets its 400: each is longer than the
    tiny model's 4096-token context; a 400 KB one is rendered and tokenized in full before it is refused."""
    limit = tiny_srv.engine.max_model_len
    assert num_bytes < tiny_srv.app.state.max_body_bytes
    proc = subprocess.Popen([sys.executable, str(SENDER), tiny_srv.url, path, "4", str(num_bytes)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert "ready" in json.loads(proc.stdout.readline())
        wait_for(tiny_srv.idle, 30, "an idle engine")
        asyncio.run(_waves(tiny_srv.url, 1, None))  # warm-up
        base, loaded, health = [], [], []
        for _ in range(3):
            small, _ = asyncio.run(_waves(tiny_srv.url, 2, None))
            base += small
            done = threading.Event()
            answers: list = []

            def collect(answers: list = answers, done: threading.Event = done) -> None:
                answers.append(json.loads(proc.stdout.readline()))
                done.set()

            reader = threading.Thread(target=collect, daemon=True)
            reader.start()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            small, polls = asyncio.run(_waves(tiny_srv.url, None, done))  # waves until all 4 are answered
            reader.join(60)
            loaded += small
            health += polls
            assert [a["status"] for a in answers[0]] == [400] * 4, answers[0]
            for a in answers[0]:
                msg = a["body"]["error"]["message"]
                assert f"maximum context length is {limit} tokens" in msg, msg
    finally:
        proc.stdin.close()
        proc.wait(30)
    assert _p99(health) < 0.100, sorted(health)[-5:]
    usual, under_load = statistics.median(base), statistics.median(loaded)
    assert under_load <= 1.5 * usual, (usual, under_load)
