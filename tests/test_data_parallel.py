"""Data parallelism in the server: N engine replicas behind one app. 64 concurrent clients (the official
openai client) get the same greedy outputs from DP=2 as from DP=1, both replicas serve, /metrics sums
the replicas, and the router sends a request to the replica with the fewest in flight."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest
from server_util import ServerThread
from tiny import text_model, tiny_engine

from verispec.config import EngineConfig
from verispec.entrypoints.replicas import ReplicaSet, merge_snapshots
from verispec.entrypoints.server import replica_configs

PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:", "# sort a list in place\n",
           "SELECT * FROM", "fn main() {", "Hello, my name is", "The quick brown fox"]
NUM_CLIENTS = 64


def test_merge_snapshots_sums_counters_and_recomputes_means():
    a = {"spec_decode_num_drafts": 2, "spec_decode_num_accepted_tokens": 3, "spec_decode_num_draft_tokens": 8,
         "spec_decode_num_request_steps": 4, "spec_decode_num_accepted_tokens_per_pos": [2, 1],
         "spec_decode_mean_acceptance_length": 2.5, "spec_decode_mean_k": 2.0, "num_free_blocks": 10}
    b = {"spec_decode_num_drafts": 6, "spec_decode_num_accepted_tokens": 3, "spec_decode_num_draft_tokens": 12,
         "spec_decode_num_request_steps": 6, "spec_decode_num_accepted_tokens_per_pos": [3, 0, 0],
         "spec_decode_mean_acceptance_length": 1.5, "spec_decode_mean_k": 2.0, "num_free_blocks": 5}
    m = merge_snapshots([a, b])
    assert m["spec_decode_num_drafts"] == 8 and m["num_free_blocks"] == 15
    assert m["spec_decode_num_accepted_tokens_per_pos"] == [5, 1, 0]
    assert m["spec_decode_mean_acceptance_length"] == 1 + 6 / 8
    assert m["spec_decode_mean_k"] == 20 / 10


class _FakeReplica:
    def __init__(self, engine=None) -> None:
        self.engine, self.on_finish, self.added = engine, None, []

    async def add(self, rid, prompt, params, ids=None):
        self.added.append(rid)

        async def stream():
            yield rid

        return stream()


def test_router_picks_the_replica_with_the_fewest_in_flight():
    fakes = [_FakeReplica(), _FakeReplica(), _FakeReplica()]
    rs = ReplicaSet(fakes)

    async def go():
        s1 = await rs.add("a", "x", None)
        s2 = await rs.add("b", "x", None)
        assert rs.in_flight == [1, 1, 0]
        async for _ in s1:  # "a" finishes: replica 0 has room again
            pass
        assert rs.in_flight == [0, 1, 0]
        await rs.add("c", "x", None)  # 0 and 2 have none in flight: 2 was given fewer so far
        await rs.add("d", "x", None)  # 0: none in flight
        assert [f.added for f in fakes] == [["a", "d"], ["b"], ["c"]]
        await s2.aclose()
        assert rs.in_flight == [1, 0, 1]

    asyncio.run(go())


def test_replica_configs_split_devices_and_refuse_missing_gpus():
    cfgs = replica_configs(EngineConfig(model="m", device="cpu", data_parallel_size=3))
    assert [(c.device, c.data_parallel_size) for c in cfgs] == [("cpu", 1)] * 3
    with pytest.raises(ValueError, match="data_parallel_size=64 needs 64 GPUs"):
        replica_configs(EngineConfig(model="m", device="cuda", data_parallel_size=64))


def _engines(n: int, model=None):
    model = model or text_model()  # one copy of the weights, a KV cache per replica
    return [tiny_engine(model, max_num_seqs=32, max_model_len=1024) for _ in range(n)]


async def _clients(url: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)

    async def one(i: int) -> str:
        r = await client.completions.create(model="tiny", prompt=PROMPTS[i % len(PROMPTS)] + f" #{i}",
                                            max_tokens=8 + i % 9, temperature=0.0)
        return r.choices[0].text

    try:
        return await asyncio.gather(*(one(i) for i in range(NUM_CLIENTS)))
    finally:
        await client.close()


def _serve(engines) -> tuple[list[str], dict, str]:
    """64 concurrent clients against a server over `engines` (a list: data-parallel replicas)."""
    srv = ServerThread(engines if len(engines) > 1 else engines[0]).start()
    try:
        texts = asyncio.run(_clients(srv.url))
        metrics = httpx.get(srv.url + "/metrics").text
        snap = srv.aengine.snapshot
        routed = getattr(srv.aengine, "num_routed", None)
    finally:
        srv.stop()
    return texts, {"snapshot": snap, "routed": routed}, metrics


def _counter(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_dp2_serves_64_concurrent_clients_like_dp1():
    want, one, _ = _serve(_engines(1))
    got, two, metrics = _serve(_engines(2))
    assert got == want
    assert all(want) and len(set(want)) > 1
    routed = two["routed"]
    assert sum(routed) == NUM_CLIENTS and min(routed) >= NUM_CLIENTS // 4, routed  # both replicas served
    # /metrics is the replicas' sum: every output token of the 64 requests, counted once.
    assert two["snapshot"]["generation_tokens"] == one["snapshot"]["generation_tokens"]
    assert _counter(metrics, "verispec:generation_tokens_total") == one["snapshot"]["generation_tokens"]


@pytest.mark.slow
def test_dp2_on_the_real_05b_serves_64_clients_like_dp1(llm05):
    model = llm05.engine.parts.model
    want, one, _ = _serve(_engines(1, model))
    got, two, _ = _serve(_engines(2, model))
    assert got == want and all(want)
    assert min(two["routed"]) >= NUM_CLIENTS // 4, two["routed"]
    assert two["snapshot"]["generation_tokens"] == one["snapshot"]["generation_tokens"]
