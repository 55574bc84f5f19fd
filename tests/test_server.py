"""The OpenAI-compatible server, served for real (uvicorn on loopback) around a tiny random-weight engine."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from server_util import ServerThread, wait_for
from tiny import real_tokenizer, text_model, tiny_engine

from verispec.sampling_params import SamplingParams

PROMPT = "def fibonacci(n):"
CHAT = [{"role": "user", "content": "Write hello world in Python."}]
SPEC_NAMES = (
    "verispec:spec_decode_num_drafts_total", "verispec:spec_decode_num_draft_tokens_total",
    "verispec:spec_decode_num_accepted_tokens_total", "verispec:spec_decode_num_accepted_tokens_per_pos_total",
    "verispec:spec_decode_audit_mismatches_total",
)


@pytest.fixture(scope="module")
def model():
    return text_model()


@pytest.fixture(scope="module")
def srv(model):
    s = ServerThread(tiny_engine(model), "tiny").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline(model):
    """A second engine on the same weights, driven directly (the offline path)."""
    eng = tiny_engine(model)

    def run(prompt: str, **kw) -> tuple[str, list[int], str]:
        eng.add_request("ref", prompt, SamplingParams(**kw))
        final = None
        while eng.has_unfinished_requests():
            for out in eng.step():
                final = out
        c = final.outputs[0]
        return c.text, c.token_ids, c.finish_reason

    run.engine = eng
    return run


def sse_events(resp: httpx.Response) -> list:
    """Parse an SSE body into JSON objects, with the literal "[DONE]" last."""
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---- happy paths ---------------------------------------------------------------------------------------
def test_completion_matches_offline_engine_and_usage(client, offline, srv):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    text, ids, reason = offline(PROMPT, max_tokens=12, temperature=0.0)
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == reason
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "tiny"
    n_prompt = len(srv.engine.tokenizer.encode(PROMPT))
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == len(ids)
    assert r.usage.total_tokens == n_prompt + len(ids)


def test_prompt_forms_agree(client):
    ref = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    ids = real_tokenizer().encode(PROMPT)
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0).choices[0].text == ref
    assert client.completions.create(model="tiny", prompt=[PROMPT], max_tokens=6, temperature=0).choices[0].text == ref


def test_completion_stream_equals_non_stream(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_matches_offline_and_streams(client, offline, srv):
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0)
    prompt = srv.engine.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    text, ids, reason = offline(prompt, max_tokens=10, temperature=0.0)
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == text and r.choices[0].finish_reason == reason
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.usage.prompt_tokens == len(srv.engine.tokenizer.encode(prompt))
    assert r.usage.completion_tokens == len(ids)
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=10, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason


def test_stop_string(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    tok = real_tokenizer()
    ids = tok.encode(full)
    stop = tok.decode(ids[4:6]).strip() or tok.decode(ids[4:6])
    assert stop and stop in full
    want = full[: full.index(stop)]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks) == want


def test_seed_reproducible(client):
    def gen(seed: int) -> str:
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0,
                                         seed=seed).choices[0].text

    a, b, c = gen(1234), gen(1234), gen(4321)
    assert a == b
    assert a != c  # 8 tokens sampled from ~150k: a different seed practically never repeats them


def test_n_and_logprobs(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=1.0, seed=7, n=2,
                                  logprobs=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices) == 10
    for c in r.choices:
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
        assert all(1 <= len(t) <= 3 for t in c.logprobs.top_logprobs)
    ch = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, logprobs=True, top_logprobs=3)
    content = ch.choices[0].logprobs.content
    assert len(content) == ch.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == ch.choices[0].message.content


# ---- other endpoints -----------------------------------------------------------------------------------
def test_models_health_metrics(client, srv):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(srv.url + "/health").status_code == 200
    wait_for(srv.idle, 30, "an idle engine")
    before = srv.aengine.snapshot["generation_tokens"]
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    wait_for(srv.idle, 30, "the snapshot after the request")  # published with its last step's counters
    text = httpx.get(srv.url + "/metrics").text
    for name in SPEC_NAMES + ("verispec:time_to_first_token_seconds_bucket", "verispec:num_requests_waiting",
                              "verispec:kv_cache_usage_perc", "verispec:request_success_total"):
        assert name in text, name
    line = next(x for x in text.splitlines() if x.startswith("verispec:generation_tokens_total"))
    assert float(line.split()[-1]) == before + 3  # exactly this request's tokens


def test_api_key(model):
    s = ServerThread(tiny_engine(model), "tiny", api_key="s3cret").start()
    try:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(s.url + "/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200
        ok = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    finally:
        s.stop()


# ---- bad input -----------------------------------------------------------------------------------------
_C, _CH = "/v1/completions", "/v1/chat/completions"
BAD = [
    (_C, b"{", 400, "not valid JSON"),
    (_C, b"[]", 400, "should be an object"),
    (_C, b'{"prompt": 5}', 400, "prompt"),
    (_C, b'{"max_tokens": 3}', 400, "prompt: Field required"),
    (_C, b'{"prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
    (_C, b'{"prompt": "x", "max_tokens": "many"}', 400, "max_tokens"),
    (_C, b'{"prompt": "x", "max_tokens": 100000000}', 400, "maximum context length"),
    (_C, b'{"prompt": "x", "temperature": -1}', 400, "temperature"),
    (_C, b'{"prompt": "x", "top_p": 0}', 400, "top_p"),
    (_C, b'{"prompt": "x", "n": 0}', 400, "n:"),
    (_C, b'{"prompt": "x", "seed": 1e400}', 400, "seed"),
    (_C, b'{"prompt": "x", "seed": 99999999999999999999999999}', 400, "seed"),
    (_C, b'{"prompt": "x", "stop": [""]}', 400, "stop"),
    (_C, b'{"prompt": "x", "logprobs": 50}', 400, "logprobs"),
    (_C, b'{"prompt": "x", "repetition_penalty": 1e-300}', 400, "repetition_penalty"),
    (_C, b'{"prompt": "x", "min_tokens": 9, "max_tokens": 3}', 400, "min_tokens"),
    (_C, b'{"prompt": ""}', 400, "prompt: String should have at least 1 character"),
    (_C, b'{"prompt": []}', 400, "prompt: "),
    (_C, b'{"prompt": [-1]}', 400, "greater than or equal to 0"),
    (_C, b'{"prompt": [999999999]}', 400, "prompt_token_ids must be integers in [0, 151936)"),
    (_C, b'{"prompt": ["a", "b"]}', 400, "at most 1 item"),
    (_C, json.dumps({"prompt": "hello " * 5000}).encode(), 400, "maximum context length"),
    (_C, '{"prompt": "\xff\xfe"}'.encode("latin-1"), 400, "UTF-8"),
    (_C, b'{"prompt": "x", "model": "gpt-9"}', 404, "does not exist"),
    (_CH, b'{"messages": []}', 400, "messages"),
    (_CH, b'{"messages": "hi"}', 400, "messages"),
    (_CH, b'{"messages": [{"role": "wizard", "content": "x"}]}', 400, "role"),
    (_CH, b'{"messages": [{"role": "user"}]}', 400, "content"),
    (_CH, b'{"messages": [{"role": "user", "content": 3}]}', 400, "content"),
    (_CH, b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', 400, "logprobs"),
    (_CH, b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}', 400,
     "max_completion_tokens"),
    ("/v1/nothing", b"{}", 404, "Not Found"),
]


@pytest.mark.parametrize("path,body,status,needle", BAD, ids=[f"{i}" for i in range(len(BAD))])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_input(http, path, body, status, needle, stream):
    if stream and body.startswith(b"{") and body.endswith(b"}") and len(body) > 2:
        body = body[:-1] + b', "stream": true}'
    r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle in err["message"], err


@pytest.mark.parametrize("top_k", [0, -1, 1, 5, -2, -7, 1.5])
def test_top_k_validated_as_in_python(http, top_k):
    """HTTP and Python agree on top_k: what SamplingParams accepts is a 200, what it refuses a 400 naming
    top_k (vLLM: 0 and -1 both mean off)."""
    try:
        SamplingParams(top_k=top_k)
        python_ok = True
    except ValueError:
        python_ok = False
    r = http.post(_C, json={"prompt": "x", "max_tokens": 1, "top_k": top_k})
    assert r.status_code == (200 if python_ok else 400), r.text
    if not python_ok:
        assert "top_k" in r.json()["error"]["message"] and r.json()["error"]["param"] == "top_k"
    assert python_ok == (top_k in (0, -1, 1, 5))


def test_body_too_large(http):
    r = http.post(_C, json={"prompt": "x" * (9 * 2**20)})
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]


def test_overloaded_queue(srv, http, client):
    serving = srv.app.state.serving
    old, serving.max_queue = serving.max_queue, 0
    try:
        r = http.post(_C, json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded"
    finally:
        serving.max_queue = old
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens == 2


# ---- aborts free KV blocks -----------------------------------------------------------------------------
def test_closed_stream_aborts_and_frees_blocks(srv):
    wait_for(srv.idle, 30, "an idle engine")
    start = srv.aengine.snapshot["num_free_blocks"]
    aborted = srv.aengine.num_aborted
    body = {"prompt": PROMPT * 20, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.url + _C, json=body, timeout=30) as r:
        assert r.status_code == 200
        got = 0
        for ln in r.iter_lines():
            got += ln.startswith("data: ")
            if got >= 3:
                break
        assert srv.engine.blocks.num_free_blocks < start  # the request holds blocks now
    srv.wait_blocks(start, timeout=30)
    assert srv.aengine.num_aborted == aborted + 1


def test_client_timeout_aborts_non_streamed_request(srv):
    wait_for(srv.idle, 30, "an idle engine")
    start = srv.aengine.snapshot["num_free_blocks"]
    aborted = srv.aengine.num_aborted
    body = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + _C, json=body, timeout=httpx.Timeout(30, read=1.0))
    srv.wait_blocks(start, timeout=30)
    assert srv.aengine.num_aborted == aborted + 1


def test_logprobs_stay_finite_json(client):
    # top_k=1 rules every other token out (-inf logprob); the response must still be valid JSON.
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=1.0,
                                  logprobs=3, extra_body={"top_k": 1})
    for top in r.choices[0].logprobs.top_logprobs:
        assert len(top) >= 2 and all(-1e4 <= v <= 0 for v in top.values())


def test_shutdown_with_stream_in_flight(model):
    s = ServerThread(tiny_engine(model), "tiny").start()
    start = s.engine.blocks.num_free_blocks
    seen, ended = [], threading.Event()

    def reader() -> None:
        body = {"prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", s.url + _C, json=body, timeout=60) as r:
                for line in r.iter_lines():
                    seen.append(line)
        except httpx.HTTPError:
            pass  # the server cut the stream at its graceful-shutdown deadline
        ended.set()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    wait_for(lambda: len(seen) >= 3, 30, "the stream to start")
    s.stop(timeout=30)  # what uvicorn does on SIGTERM
    assert ended.wait(30)
    assert not s.aengine.is_alive
    assert not s.engine.has_unfinished_requests()
    assert s.engine.blocks.num_free_blocks == start


def test_engine_failure_is_contained(model):
    """An engine exception fails the requests in flight with an OpenAI-style 500; the server keeps serving."""
    s = ServerThread(tiny_engine(model), "tiny").start()
    try:
        start = s.engine.blocks.num_free_blocks
        real_step, calls = s.engine.step, []

        def failing_step():
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected failure")
            return real_step()

        s.engine.step = failing_step
        with httpx.Client(base_url=s.url, timeout=60) as h:
            r = h.post(_C, json={"prompt": PROMPT, "max_tokens": 5})
            assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
            r = h.post(_C, json={"prompt": PROMPT, "max_tokens": 5})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
            assert h.get("/health").status_code == 200
        s.wait_blocks(start)
    finally:
        s.stop()
