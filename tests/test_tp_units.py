"""Tensor parallelism without processes: the shards of a tiny model, run by N threads over an in-process
stand-in for the collectives, give the unsharded model's logits (uneven vocabulary, tied embeddings,
Qwen3's q/k norms, Llama without biases); a step message survives its round trip; a RankFailure stops
the server's engine for good (503 with the reason, on /health too)."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch
from server_util import ServerThread, wait_for
from tiny import text_model, tiny_config, tiny_engine, tiny_model

from verispec.core.attention_metadata import AttentionMetadata
from verispec.core.parallel import RankFailure
from verispec.distributed.shard import check_tensor_parallel, shard_model, vocab_rows
from verispec.worker.inputs import SeqChunk, allocate_kv_cache, build_batch
from verispec.worker.step_message import pack_step, unpack_step


class ThreadGroup:
    """N threads as the ranks of one group: each collective meets at a barrier (core.parallel.TensorParallel)."""

    def __init__(self, n: int) -> None:
        self.n, self.barrier, self.slots = n, threading.Barrier(n, timeout=30), [None] * n

    def rank(self, r: int):
        group = self

        class Rank:
            rank, world_size = r, group.n

            def _meet(self, x):
                group.slots[r] = x.clone()
                group.barrier.wait()
                parts = list(group.slots)
                group.barrier.wait()
                return parts

            def all_reduce(self, x):
                parts = self._meet(x)
                x.copy_(sum(parts[1:], parts[0]))  # (a real all-reduce may sum in another order)
                return x

            def all_gather(self, x):
                return torch.cat(self._meet(x), dim=-1)

            def send_step(self, message):
                raise AssertionError("not used here")

        return Rank()


def _forward(model, prompts: list[list[int]]) -> torch.Tensor:
    c = model.config
    kv_heads = model.model.layers[0].self_attn.num_kv_heads
    kv = allocate_kv_cache(c.num_layers, 8 * len(prompts), 16, kv_heads, c.head_dim, torch.float32, "cpu")
    chunks = [SeqChunk(p, 0, list(range(8 * i, 8 * i + 8))) for i, p in enumerate(prompts)]
    ids, pos, meta = build_batch(chunks, 16, torch.device("cpu"))
    hidden, _ = model(ids, pos, meta, kv)
    return model.compute_logits(hidden)


@pytest.mark.parametrize("arch, vocab, tied, n", [("qwen2", 4097, False, 2), ("qwen3", 4096, True, 2),
                                                   ("llama", 1001, False, 2), ("qwen2", 4096, False, 1)])
def test_shards_over_threads_give_the_unsharded_logits(arch, vocab, tied, n):
    import dataclasses

    cfg = dataclasses.replace(tiny_config(arch, vocab=vocab), tie_word_embeddings=tied)
    prompts = [[5, 17, 1000, 3, 999], [42, 7], [vocab - 1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
    want = _forward(tiny_model(cfg), prompts)
    group, out = ThreadGroup(n), [None] * n

    def rank(r: int) -> None:
        model = shard_model(tiny_model(cfg), group.rank(r))
        assert model.model.embed_tokens.weight.shape[0] == vocab_rows(vocab, n)
        assert model.model.layers[0].self_attn.num_heads == cfg.num_heads // n
        out[r] = _forward(model, prompts)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for got in out:
        assert got.shape == want.shape == (sum(map(len, prompts)), vocab)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sizes_that_do_not_divide_are_refused():
    cfg = tiny_config()  # 4 heads, 2 KV heads, MLP 128
    check_tensor_parallel(cfg, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide the model's 2 KV heads"):
        check_tensor_parallel(cfg, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's 4 attention heads"):
        check_tensor_parallel(cfg, 3)
    with pytest.raises(ValueError, match="shards qwen2, llama, qwen3 models, not 'gemma3'"):
        check_tensor_parallel(tiny_config("gemma3"), 2)


def test_step_message_round_trip():
    ids = torch.tensor([11, 12, 13, 14, 15])
    pos = torch.tensor([0, 1, 2, 7, 8])
    meta = AttentionMetadata(slot_mapping=torch.tensor([16, 17, 18, 39, 40]),
                             query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32),
                             seq_lens=torch.tensor([3, 9], dtype=torch.int32),
                             block_tables=torch.tensor([[1, 0], [2, 3]], dtype=torch.int32),
                             max_query_len=3, max_seq_len=9, block_size=16)
    for rows, has in ((torch.tensor([2, 4]), True), (None, True), (None, False)):
        msg = pack_step(ids, pos, meta, rows, has)
        buf = torch.cat([msg, torch.full((7,), -5)])  # the received buffer is larger than the message
        got = unpack_step(buf, 16, host_lists=True)
        assert got.ids.tolist() == ids.tolist() and got.positions.tolist() == pos.tolist()
        assert got.meta.slot_mapping.tolist() == meta.slot_mapping.tolist()
        assert got.meta.query_start_loc.dtype == torch.int32 and got.meta.query_start_loc.tolist() == [0, 3, 5]
        assert got.meta.block_tables.tolist() == [[1, 0], [2, 3]] and got.meta.seq_lens.tolist() == [3, 9]
        assert (got.meta.max_query_len, got.meta.max_seq_len, got.num_seqs) == (3, 9, 2)
        assert got.has_logits is has
        assert (got.logit_rows.tolist() if got.logit_rows is not None else None) == (
            rows.tolist() if rows is not None and has else None)
        assert (got.query_lens, got.seq_lens, got.tables) == ([3, 2], [3, 9], [[1, 0], [2, 3]])


def test_a_rank_failure_stops_the_server_engine_with_a_503():
    eng = tiny_engine(text_model())

    def lost(*a, **k):
        raise RankFailure("tensor-parallel rank 1 (pid 4242) was killed by signal 9; the engine cannot go on")

    srv = ServerThread(eng).start()
    try:
        eng.step = lost
        body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 4}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and "killed by signal 9" in r.json()["error"]["message"], r.text
        wait_for(lambda: not srv.aengine.is_alive, 10, "the engine thread to stop")
        h = httpx.get(srv.url + "/health", timeout=10)
        assert h.status_code == 503 and "killed by signal 9" in h.json()["status"]
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)  # later requests: at once, same reason
        assert r.status_code == 503 and "killed by signal 9" in r.json()["error"]["message"], r.text
    finally:
        srv.stop()
