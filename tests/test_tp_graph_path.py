"""The tensor-parallel step path as CUDA runs it (graph replays with padded verify steps, placeholders
filled before the broadcast, follow() on the other rank), on the CPU: two ranks as two threads of this
process (the collectives meet at a barrier, the step broadcast is a queue), each runner with the graph
runner's eager capture=False mode over its static buffers and tiny.MetadataBackend. TP=2 must give the
tokens and acceptance counters of the unsharded model on the same graph path, sync and overlapped."""

from __future__ import annotations

import queue
import threading

import pytest
import torch
from parity import SPECS, STRESS, run_scenario, scenario_params, scenario_prompts
from tiny import MetadataBackend, tiny_config, tiny_engine, tiny_model

from verispec.distributed.shard import shard_model
from verispec.worker.graphs import CudaGraphRunner
from verispec.worker.inputs import allocate_kv_cache
from verispec.worker.runner import ModelRunner

VOCAB = 501  # odd: the vocabulary shards are uneven (the last one padded)
K = SPECS["ngram"]["num_speculative_tokens"]


class ThreadRanks:
    """Rank 0 and rank 1 of a TP=2 group as threads: all-reduce / all-gather at a barrier (rank order),
    send_step through a queue that rank 1's follower thread reads."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=60)
        self.slots: list = [None, None]
        self.steps: queue.Queue = queue.Queue()

    def rank(self, r: int):
        group = self

        class Rank:
            rank, world_size = r, 2

            def _meet(self, x):
                group.slots[r] = x.clone()
                group.barrier.wait()
                parts = list(group.slots)
                group.barrier.wait()
                return parts

            def all_reduce(self, x):
                a, b = self._meet(x)
                return x.copy_(a + b)

            def all_gather(self, x):
                return torch.cat(self._meet(x), dim=-1)

            def send_step(self, message):
                group.steps.put(message.clone())

        return Rank()


def _graphs(model, kv, eng) -> CudaGraphRunner:
    return CudaGraphRunner(model, kv, max_batch=8, query_lens=(1, 1 + K), block_size=eng.runner.block_size,
                           max_blocks_per_seq=-(-eng.max_model_len // eng.runner.block_size), capture=False)


def build(tp: bool, followers: list):
    """An engine factory for run_scenario: graphs (capture=False) on every rank; tp: the model sharded
    over two thread ranks, rank 1's runner following in a thread (appended to `followers`)."""

    def make(spec, async_scheduling):
        spec = {**spec, "adaptive": False} if spec else spec
        cfg = tiny_config(vocab=VOCAB)
        group = ThreadRanks()
        m0 = shard_model(tiny_model(cfg), group.rank(0)) if tp else tiny_model(cfg)
        m0.attn_backend = MetadataBackend()
        eng = tiny_engine(m0, spec=spec, async_scheduling=async_scheduling, max_num_seqs=8, **STRESS)
        r, c = eng.runner, cfg
        num_blocks = r.kv_caches[0].shape[1] // r.block_size + 1  # + the graphs' scratch block
        kv_heads = c.num_kv_heads // (2 if tp else 1)
        r.kv_caches = allocate_kv_cache(c.num_layers, num_blocks, r.block_size, kv_heads, c.head_dim, torch.float32,
                                        "cpu")
        r.graphs = _graphs(m0, r.kv_caches, eng)
        if tp:
            r.tp = group.rank(0)
            m1 = shard_model(tiny_model(cfg), group.rank(1))
            m1.attn_backend = MetadataBackend()
            f = ModelRunner(m1, num_blocks, r.block_size, torch.device("cpu"), torch.float32, tp=group.rank(1))
            f.graphs = _graphs(m1, f.kv_caches, eng)
            errors: list = []

            def follow() -> None:
                try:
                    while (message := group.steps.get()) is not None:
                        f.follow(message)
                except BaseException as e:  # reported by the test; rank 0 then fails at its barrier
                    errors.append(e)

            t = threading.Thread(target=follow, daemon=True)
            t.start()
            followers.append((group, t, f, errors))
        return eng

    return make


@pytest.mark.parametrize("method, async_scheduling", [("ngram", False), ("ngram", True), ("none", True)])
def test_tp2_graph_path_matches_unsharded(method, async_scheduling):
    """ngram: padded verify steps; plain decoding in the overlapped loop: the previous step's tokens are
    placeholders, filled on rank 0's device before the broadcast."""
    prompts, params = scenario_prompts(vocab_hi=VOCAB - 12), scenario_params(32)
    plain = run_scenario(build(False, []), method, async_scheduling, prompts, params)
    followers: list = []
    sharded = run_scenario(build(True, followers), method, async_scheduling, prompts, params)
    group, thread, follower, errors = followers[0]
    group.steps.put(None)
    thread.join(30)
    assert not errors, errors
    assert sharded[0] == plain[0]
    assert sharded[1] == plain[1]
    r = sharded[3].runner
    if method == "ngram":
        assert plain[1]["spec_decode_num_drafts"] > 0
        assert r.padded_steps > 10  # padded verify replays ...
    assert r.graph_steps > 10
    assert follower.graph_steps == r.graph_steps and follower.eager_steps == r.eager_steps  # ... on both ranks
