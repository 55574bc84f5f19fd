"""Verify steps with mixed draft counts replay the (batch, 1 + k) graph: the runner pads every chunk
to 1 + k queries (ModelRunner._pad). On CPU the graph runner's capture=False mode runs the same
padded static-buffer forward eagerly, so padded and unpadded runs of the same engine must give
identical tokens and acceptance counters. Both runs use tiny.MetadataBackend (the Triton
kernel's contract in torch; the interpreter is too slow for whole engine runs): the only difference
is the padding. The kernel itself on padded chunks: test_kernels.py::test_padding_queries_before_chunk."""

from __future__ import annotations

import pytest
import torch
from parity import SPECS, STRESS, run_scenario, scenario_params, scenario_prompts
from tiny import MetadataBackend, tiny_config, tiny_engine, tiny_model

from verispec.worker.graphs import CudaGraphRunner
from verispec.worker.inputs import allocate_kv_cache

VOCAB = 512  # small, so the tiny model's outputs repeat and ngram finds drafts
K = SPECS["ngram"]["num_speculative_tokens"]


def build(graphs: bool, prefill_lens: tuple[int, ...] = (), prefill_max_tokens: int = 0):
    """An engine factory for run_scenario: a fresh tiny model on MetadataBackend; with graphs, the
    runner gets an eager (capture=False) CudaGraphRunner whose scratch block is one extra cache
    block that the BlockManager does not know about (with prefill_lens: prefill shapes too)."""

    def make(spec, async_scheduling):
        spec = {**spec, "adaptive": False} if spec else spec  # padding of mixed draft counts: fixed k
        model = tiny_model(tiny_config(vocab=VOCAB))
        model.attn_backend = MetadataBackend()
        eng = tiny_engine(model, spec=spec, async_scheduling=async_scheduling, max_num_seqs=8, **STRESS)
        if graphs:
            attach_graphs(eng, 8, prefill_lens, prefill_max_tokens)
        return eng

    return make


def attach_graphs(eng, max_batch: int, prefill_lens: tuple[int, ...] = (), prefill_max_tokens: int = 0) -> None:
    """Give eng's runner an eager (capture=False) CudaGraphRunner at decode / verify query lengths 1 and 1 + K
    (and prefill shapes), whose scratch block is one extra cache block the BlockManager does not know about."""
    r, model = eng.runner, eng.runner.model
    c = model.config
    num_blocks = r.kv_caches[0].shape[1] // r.block_size
    r.kv_caches = allocate_kv_cache(c.num_layers, num_blocks + 1, r.block_size, c.num_kv_heads, c.head_dim,
                                    torch.float32, "cpu")
    r.graphs = CudaGraphRunner(model, r.kv_caches, max_batch=max_batch, query_lens=(1, 1 + K), block_size=r.block_size,
                               max_blocks_per_seq=-(-eng.max_model_len // r.block_size), capture=False,
                               faults=eng.faults, capture_layers=r.capture_layers, prefill_lens=prefill_lens,
                               prefill_max_tokens=prefill_max_tokens)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_padded_verify_matches_unpadded(async_scheduling):
    """ngram at batch > 1 (mixed draft counts, 0..k), greedy and seeded sampled requests, under
    preemption and chunked prefill: same tokens and counters with and without padding, and the
    padded run really replayed padded verify steps."""
    prompts, params = scenario_prompts(vocab_hi=VOCAB - 12), scenario_params(32)
    plain = run_scenario(build(False), "ngram", async_scheduling, prompts, params)
    padded = run_scenario(build(True), "ngram", async_scheduling, prompts, params)
    assert padded[0] == plain[0]
    assert padded[1] == plain[1]
    assert plain[1]["spec_decode_num_drafts"] > 0
    assert 0 < plain[1]["spec_decode_num_accepted_tokens"] < plain[1]["spec_decode_num_draft_tokens"]
    r = padded[3].runner
    assert r.padded_steps >= 5 and r.graph_steps > r.padded_steps  # several padded replays (10 in this scenario)
    assert plain[3].runner.graph_steps == 0


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    """A DFlash drafter fitted a little to the tiny target (build()'s model: the same seed and shapes)."""
    from tiny import greedy_continuation, trained_tiny_drafter

    from verispec.spec_decode.dflash import save_drafter

    model = tiny_model(tiny_config(vocab=VOCAB))
    ps = scenario_prompts(vocab_hi=VOCAB - 12)
    seqs = list(zip(ps, greedy_continuation(model, ps, 24), strict=True))
    drafter, _ = trained_tiny_drafter(model, seqs, block_size=4, mask_id=VOCAB - 1, steps=40, lr=2e-2, anchors=16)
    path = tmp_path_factory.mktemp("padding_dflash")
    save_drafter(drafter, path, torch.float32)
    return path


@pytest.mark.parametrize("method", ["none", "ngram", "dflash"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_padded_prefill_matches_eager(method, async_scheduling, drafter_dir):
    """Admission steps (prompt chunks of up to 13 tokens beside decode and verify rows) replay the
    prefill shapes (query 8 or 16, at most 64 tokens) with every chunk padded: same tokens and counters
    as the engine without graphs, and prefill-length replays really happened (and none past the budget).
    DFlash reads the padded step's captured target features by the step's token offsets."""
    prompts, params = scenario_prompts(vocab_hi=VOCAB - 12), scenario_params(32)
    if method == "dflash":
        method = {**SPECS["dflash"], "model": str(drafter_dir)}
    plain = run_scenario(build(False), method, async_scheduling, prompts, params)
    seen: list[tuple[int, int]] = []

    def make(spec, async_sched):
        eng = build(True, prefill_lens=(8, 16), prefill_max_tokens=64)(spec, async_sched)
        g = eng.runner.graphs
        orig = g.run

        def run(input_ids, positions, meta, num_seqs, query_len, placeholders=None):
            out = orig(input_ids, positions, meta, num_seqs, query_len, placeholders)
            if out is not None:
                seen.append((g.padded_batch(num_seqs), query_len))
            return out

        g.run = run
        return eng

    padded = run_scenario(make, method, async_scheduling, prompts, params)
    assert padded[0] == plain[0]
    assert padded[1] == plain[1]
    prefill = [(b, q) for b, q in seen if q > 1 + K]
    assert len(prefill) >= 3 and {q for _, q in prefill} <= {8, 16}
    assert all(b * q <= 64 for b, q in prefill)
    assert padded[3].runner.eager_steps < plain[3].runner.eager_steps


@pytest.mark.parametrize(("method", "async_scheduling"), [("none", False), ("ngram", True), ("dflash", True)],
                         ids=["none-sync", "ngram-async", "dflash-async"])
def test_split_admission_steps_match_eager(method, async_scheduling, drafter_dir):
    """An admission step that no graph fits whole (its prompt chunk, padded together with every decode
    row, is past a 16-token prefill budget) replays as two graphs: the decode / verify rows, then the
    prompt chunks (batch.split_for_graphs). Same tokens and counters as the engine without graphs, and
    split replays really happened; the captured features DFlash reads are the two parts' in step order."""
    prompts, params = scenario_prompts(vocab_hi=VOCAB - 12), scenario_params(32)
    if method == "dflash":
        method = {**SPECS["dflash"], "model": str(drafter_dir)}
    plain = run_scenario(build(False), method, async_scheduling, prompts, params)
    split = run_scenario(build(True, prefill_lens=(8, 16), prefill_max_tokens=16), method, async_scheduling,
                         prompts, params)
    assert split[0] == plain[0]
    assert split[1] == plain[1]
    r = split[3].runner
    assert r.split_steps >= 3 and r.graph_steps > r.split_steps


@pytest.mark.parametrize(("method", "async_scheduling"), [("none", True), ("ngram", False)],
                         ids=["none-async", "ngram-sync"])
def test_split_preferred_to_padding_every_row(method, async_scheduling, monkeypatch):
    """With the split's cost at 0 tokens, admission steps that one prefill graph fits (query 8 or 16, at
    most 64 tokens) but only by padding the decode / verify rows before the prompt chunk to its length
    replay as two graphs instead (batch.split_is_cheaper): same tokens and counters as the engine without
    graphs, split replays happened, and no step padded such a row to a prefill length."""
    import verispec.worker.batch as batch
    import verispec.worker.runner as runner

    monkeypatch.setattr(batch, "SPLIT_COST_TOKENS", 0)
    prompts, params = scenario_prompts(vocab_hi=VOCAB - 12), scenario_params(32)
    plain = run_scenario(build(False), method, async_scheduling, prompts, params)
    one_graph: list[int] = []  # per step padded to a prefill length as one graph: rows before its first chunk

    def build_host_batch(sched, block_size, graph_fit=None, split=False):
        hb = batch.build_host_batch(sched, block_size, graph_fit, split)
        if hb.split is None and max(hb.query_lens) > 1 + K:
            rows = sched.scheduled
            one_graph.append(next((i for i, s in enumerate(rows) if s.num_new_tokens - s.num_draft_tokens > 1), 0))
        return hb

    monkeypatch.setattr(runner, "build_host_batch", build_host_batch)
    split = run_scenario(build(True, prefill_lens=(8, 16), prefill_max_tokens=64), method, async_scheduling,
                         prompts, params)
    assert split[0] == plain[0]
    assert split[1] == plain[1]
    assert split[3].runner.split_steps >= 3
    assert one_graph and not any(one_graph)  # (steps of prompt chunks only: padded as one graph, as before)


def test_split_point():
    """split_for_graphs: the rows before the first prompt chunk, each part at the query length its graph
    replays; no split where the step starts with a prompt chunk or a part fits no graph."""
    from types import SimpleNamespace

    from verispec.worker.batch import split_for_graphs

    def rows(*spec):  # (new tokens, drafts) per row
        return [SimpleNamespace(num_new_tokens=n, num_draft_tokens=k) for n, k in spec]

    def fit(num_seqs, longest):  # graphs of query 1 and 4 at any batch, 16 up to 2 rows
        return next((q for q in (1, 4, 16) if q >= longest and (q < 16 or num_seqs <= 2)), None)

    assert split_for_graphs(rows((1, 0), (4, 3), (1, 0), (9, 0)), fit) == (3, 4, 16)
    assert split_for_graphs(rows((1, 0), (1, 0), (12, 0), (3, 0)), fit) == (2, 1, 16)
    assert split_for_graphs(rows((9, 0), (1, 0)), fit) is None  # a prompt chunk first
    assert split_for_graphs(rows((1, 0), (9, 0), (9, 0), (9, 0)), fit) is None  # 3 chunks: no graph
    assert split_for_graphs(rows((1, 0), (20, 0)), fit) is None  # longer than any graph


def test_prefill_shapes_within_budget():
    """The runner's shapes: every batch at the decode / verify lengths, a prefill length only where
    batch * length fits prefill_max_tokens; padded_query_len picks the shortest shape that fits."""
    model = tiny_model(tiny_config(vocab=VOCAB))
    model.attn_backend = MetadataBackend()
    c = model.config
    kv = allocate_kv_cache(c.num_layers, 8, 4, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    g = CudaGraphRunner(model, kv, max_batch=8, query_lens=(1, 3), block_size=4, max_blocks_per_seq=6,
                        capture=False, prefill_lens=(2, 8, 16, 128), prefill_max_tokens=32)
    assert g.prefill_lens == (8, 16)  # 2 is no longer than a verify length, 128 is past the budget
    assert sorted(g.shapes()) == sorted([(b, q) for q in (1, 3) for b in (1, 2, 4, 8)]
                                        + [(1, 8), (2, 8), (4, 8), (1, 16), (2, 16)])
    assert g.padded_query_len(3, 2) == 3
    assert g.padded_query_len(3, 5) == 8  # batch 4 x 8 = 32 tokens
    assert g.padded_query_len(3, 9) is None  # batch 4 x 16 = 64 > 32
    assert g.padded_query_len(2, 9) == 16
    assert g.padded_query_len(1, 17) is None


class _ReplayByRerun:
    """Stands in for a captured CUDA graph on the CPU: replay() reruns the forward into the
    tensors the capture returned (what a real replay writes)."""

    def __init__(self, runner: CudaGraphRunner, b: int, q: int, outs: list[torch.Tensor]) -> None:
        self.runner, self.b, self.q, self.outs = runner, b, q, outs

    def replay(self) -> None:
        hidden, captured = self.runner._forward((self.b, self.q))
        for dst, src in zip(self.outs, [hidden, *captured], strict=True):
            dst.copy_(src)


def test_lazy_capture_on_first_use(monkeypatch):
    """lazy=True: each shape is captured once, on the first run() that needs it, before that run's
    inputs are staged (the capture clobbers the static buffers with padding rows); the replay then
    equals the eager padded forward."""
    from verispec.worker.inputs import SeqChunk, build_batch

    def fake_capture(self, key, error_mode):
        assert error_mode == "thread_local"
        b, q = key
        self._pad(key)  # as the real capture: padding rows only
        hidden, captured = self._forward(key)
        self.graphs[key] = (_ReplayByRerun(self, b, q, [hidden, *captured]), hidden, captured)

    monkeypatch.setattr(CudaGraphRunner, "_capture", fake_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    model = tiny_model(tiny_config(vocab=VOCAB))
    model.attn_backend = MetadataBackend()
    c = model.config
    kv = allocate_kv_cache(c.num_layers, 12, 4, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    for t in kv:
        t.normal_()
    lazy = CudaGraphRunner(model, kv, max_batch=4, query_lens=(1, 3), block_size=4, max_blocks_per_seq=6,
                           capture_layers=(0,), capture=False)
    lazy.lazy = True  # capture=True needs CUDA; the fake capture above stands in for it
    eager = CudaGraphRunner(model, kv, max_batch=4, query_lens=(1, 3), block_size=4, max_blocks_per_seq=6,
                            capture_layers=(0,), capture=False)
    for n, q, seed in ((3, 3, 1), (3, 3, 2), (1, 1, 3), (2, 3, 4)):
        g = torch.Generator().manual_seed(seed)
        chunks = [SeqChunk(torch.randint(0, VOCAB, (q,), generator=g).tolist(), 5 + i, [3 * i, 3 * i + 1, 3 * i + 2])
                  for i in range(n)]
        ids, pos, meta = build_batch(chunks, 4, torch.device("cpu"), with_reference=False)
        before = [t.clone() for t in kv]
        want = eager.run(ids, pos, meta, n, q)
        want = (want.hidden, want.captured[0])
        for t, b in zip(kv, before, strict=True):
            t.copy_(b)
        got = lazy.run(ids, pos, meta, n, q)
        torch.testing.assert_close(got.hidden, want[0], atol=0, rtol=0)
        torch.testing.assert_close(got.captured[0], want[1], atol=0, rtol=0)
    assert sorted(lazy.graphs) == [(1, 1), (2, 3), (4, 3)]  # (4, 3) captured once for two runs


@pytest.mark.parametrize("n,b,q,width", [(3, 4, 1, 2), (2, 4, 3, 5), (1, 1, 1, 6), (4, 4, 3, 1)])
def test_stage_kernel_matches_torch_copies(n, b, q, width):
    """kernels/graph_inputs.py (one kernel per replay on CUDA; the interpreter here) writes the static
    buffers exactly as the torch copies and padding fills do, whatever the buffers held before."""
    from verispec.kernels.graph_inputs import stage_graph_inputs

    runners = _two_runners(max_batch=4)
    g = torch.Generator().manual_seed(n * 10 + q)
    t = n * q
    src = (torch.randint(0, VOCAB, (t,), generator=g), torch.randint(0, 20, (t,), generator=g),
           torch.randint(0, 44, (t,), generator=g), torch.arange(n + 1, dtype=torch.int32) * q,
           torch.randint(q, 24, (n,), generator=g, dtype=torch.int32),
           torch.randint(0, 11, (n, width), generator=g, dtype=torch.int32))
    bufs = [(r.input_ids, r.positions, r.slot_mapping, r.query_start_loc, r.seq_lens, r.block_tables) for r in runners]
    for buf in bufs[1]:
        buf.fill_(-7)  # stale values the kernel must overwrite
    runners[0]._stage(src[0], src[1], _meta_of(src), n, b, q)
    stage_graph_inputs(src, bufs[1], n, b, q, runners[1].scratch_block, 4)
    rows = (b * q, b * q, b * q, b + 1, b, b)
    for name, want, got, m in zip(("ids", "positions", "slots", "qsl", "seq_lens", "tables"), *bufs, rows,
                                  strict=True):
        assert torch.equal(got[:m], want[:m]), name


def _two_runners(max_batch: int) -> list[CudaGraphRunner]:
    """Two uncaptured graph runners over one tiny model (block size 4, query lengths 1 and 3)."""
    model = tiny_model(tiny_config(vocab=VOCAB))
    model.attn_backend = MetadataBackend()
    kv = allocate_kv_cache(model.config.num_layers, 12, 4, model.config.num_kv_heads, model.config.head_dim,
                           torch.float32, "cpu")
    return [CudaGraphRunner(model, kv, max_batch=max_batch, query_lens=(1, 3), block_size=4, max_blocks_per_seq=6,
                            capture=False) for _ in range(2)]


def _meta_of(src):
    from verispec.core.attention_metadata import AttentionMetadata

    return AttentionMetadata(slot_mapping=src[2], query_start_loc=src[3], seq_lens=src[4], block_tables=src[5],
                             max_query_len=1, max_seq_len=24, block_size=4)


@pytest.mark.parametrize("n,b,q,num_ph", [(3, 4, 1, 2), (2, 4, 3, 5), (40, 48, 3, 90), (1, 1, 1, 0)])
def test_stage_kernel_fills_placeholders(n, b, q, num_ph):
    """With placeholders (more than one scan block of 64 in the third case), the kernel writes the
    static buffers and the step's own ids exactly as the torch gather followed by the copies."""
    from verispec.kernels.graph_inputs import stage_graph_inputs

    runners = _two_runners(max_batch=48)
    g = torch.Generator().manual_seed(n + num_ph)
    t = n * q
    ids = torch.randint(0, VOCAB, (t,), generator=g)
    pos_t = torch.randperm(t, generator=g)[:num_ph].sort().values
    ids[pos_t] = -1  # what the host knows at a placeholder
    flat = torch.randint(0, VOCAB, (2 * t + 3,), generator=g)
    src_t = torch.randint(0, flat.shape[0], (num_ph,), generator=g)
    rest = (torch.randint(0, 20, (t,), generator=g), torch.randint(0, 44, (t,), generator=g),
            torch.arange(n + 1, dtype=torch.int32) * q, torch.randint(q, 24, (n,), generator=g, dtype=torch.int32),
            torch.randint(0, 11, (n, 3), generator=g, dtype=torch.int32))
    ids_a, ids_b = ids.clone(), ids.clone()
    runners[0]._stage(ids_a, rest[0], _meta_of((ids_a, *rest)), n, b, q, (pos_t, src_t, flat))
    bufs = [(r.input_ids, r.positions, r.slot_mapping, r.query_start_loc, r.seq_lens, r.block_tables) for r in runners]
    for buf in bufs[1]:
        buf.fill_(-7)
    stage_graph_inputs((ids_b, *rest), bufs[1], n, b, q, runners[1].scratch_block, 4, (pos_t, src_t, flat))
    want = ids.clone()
    want[pos_t] = flat[src_t]
    assert torch.equal(ids_a, want) and torch.equal(ids_b, want)
    for name, w, got, m in zip(("ids", "positions", "slots", "qsl", "seq_lens", "tables"), *bufs,
                               (b * q, b * q, b * q, b + 1, b, b), strict=True):
        assert torch.equal(got[:m], w[:m]), name


def test_stage_kernel_without_writeback_leaves_the_step_ids():
    """The graph_stage_no_writeback fault's kernel: the static ids get the placeholders' values, the
    step's own ids keep the placeholders (what the verifier then reads as drafts)."""
    from verispec.kernels.graph_inputs import stage_graph_inputs

    runner = _two_runners(max_batch=4)[0]
    n, b, q = 2, 4, 3
    ids = torch.tensor([5, -1, -1, 7, -1, 9])
    pos_t, src_t, flat = torch.tensor([1, 2, 4]), torch.tensor([0, 2, 1]), torch.tensor([100, 101, 102])
    rest = (torch.arange(6), torch.arange(6), torch.tensor([0, 3, 6], dtype=torch.int32),
            torch.tensor([3, 4], dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32))
    bufs = (runner.input_ids, runner.positions, runner.slot_mapping, runner.query_start_loc, runner.seq_lens,
            runner.block_tables)
    for writeback, want_step in ((True, [5, 100, 102, 7, 101, 9]), (False, [5, -1, -1, 7, -1, 9])):
        step = ids.clone()
        stage_graph_inputs((step, *rest), bufs, n, b, q, runner.scratch_block, 4, (pos_t, src_t, flat),
                           writeback=writeback)
        assert runner.input_ids[:6].tolist() == [5, 100, 102, 7, 101, 9]
        assert step.tolist() == want_step


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["none", "ngram"])
def test_split_admission_steps_on_cuda(method):
    """On CUDA (float32, where a row's result does not depend on the step's shape): batch 16 with
    prompts of 130-250 tokens admitted while others decode, so an admission step padded whole would be
    16 x 256 tokens, past the 2,048-token prefill budget, and replays as two graphs instead (the staging
    kernel over the second part's shifted offsets). Same tokens as the eager engine."""
    import random

    from tiny import real_tokenizer, run_all

    from verispec import SamplingParams
    from verispec.config import EngineConfig, SpeculativeConfig
    from verispec.engine.builder import assemble_parts
    from verispec.engine.engine import LLMEngine
    from verispec.models.kernel_path import enable_triton

    model = tiny_model(tiny_config(vocab=VOCAB)).to("cuda")
    enable_triton(model)
    rng = random.Random(5)
    prompts = [[rng.randrange(10, VOCAB - 12) for _ in range(rng.randrange(130, 250))] for _ in range(24)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(8, 40), ignore_eos=True) for _ in prompts]
    spec = None if method == "none" else {**SPECS["ngram"]}

    def run(eager: bool):
        cfg = EngineConfig(model="tiny", device="cuda", dtype="float32", max_num_batched_tokens=512,
                           num_gpu_blocks=1024, max_num_seqs=16, async_scheduling=True, enforce_eager=eager,
                           speculative_config=SpeculativeConfig.from_dict(spec))
        eng = LLMEngine(cfg, assemble_parts(cfg, real_tokenizer(), model, torch.device("cuda"), torch.float32))
        return [o.outputs[0].token_ids for o in run_all(eng, prompts, params)], eng.runner

    (graphed, runner), (eager, _) = run(False), run(True)
    assert graphed == eager
    assert runner.split_steps >= 3


def test_private_rows_are_one_copy_of_the_captured_rows():
    """A replay's captured rows come back as column views of one [t, sum of widths] copy (one copy
    kernel per step, not one per layer), equal to the static buffers' first t rows and not aliasing them
    (the next replay rewrites those); DFlash finds the joined tensor (one gather per context forward)."""
    from verispec.spec_decode.dflash import _joined
    from verispec.worker.graphs import private_rows

    static = [torch.randn(8, 6) for _ in range(5)]
    rows = private_rows(static, 5)
    want = [s[:5].clone() for s in static]
    for s in static:
        s.fill_(0.0)  # the next replay
    assert all(torch.equal(r, w) for r, w in zip(rows, want, strict=True))
    joined = _joined(rows)
    assert joined is not None and joined.shape == (5, 30) and torch.equal(joined, torch.cat(want, dim=-1))
    assert _joined(want) is None and _joined(rows[1:]) is None  # separate copies; not starting at column 0
    assert len(private_rows(static[:1], 3)) == 1 and private_rows(static[:1], 3)[0].shape == (3, 6)


def test_admission_steps_on_the_real_05b_replay_split_as_eager(llm05, monkeypatch):
    """The real 0.5B (float32, the plain-torch attention with the Triton kernel's contract): requests admitted
    beside running ngram verify rows (3 seats, 4 prompts of 7-22 tokens, at most 24 tokens a step) replay as two
    graphs, the decode / verify rows then the prompt chunks, wherever one prefill graph would pad the rows to a
    chunk's length (SPLIT_COST_TOKENS 0): the same tokens and acceptance counters as the engine without graphs.
    With the rule before session 30 (one padded graph whenever one fits) no step splits here."""
    from test_real_model_spec import CODE_PROMPTS

    import verispec.worker.batch as batch
    from verispec import SamplingParams

    model, tok = llm05.engine.parts.model, llm05.tokenizer
    monkeypatch.setattr(batch, "SPLIT_COST_TOKENS", 0)
    monkeypatch.setattr(model, "attn_backend", MetadataBackend())  # (restored after the test)
    prompts = [tok.encode(p) for p in CODE_PROMPTS]
    assert sorted(len(p) for p in prompts)[-1] > 16  # a chunk longer than a verify row, shorter than the budget
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": K, "adaptive": False}

    def make(graphs: bool):
        eng = tiny_engine(model, spec=spec, max_num_seqs=3, num_gpu_blocks=40, block_size=16,
                          max_num_batched_tokens=24, max_model_len=256, async_scheduling=False)
        if graphs:
            attach_graphs(eng, 4, (8, 16, 32), 128)
        return eng

    def run(eng):
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", None, params, p)
        done = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return [done[f"r{i}"] for i in range(len(prompts))], eng.get_metrics()

    eager, eager_m = run(make(False))
    eng = make(True)
    split, split_m = run(eng)
    assert split == eager
    keys = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
            "spec_decode_num_accepted_tokens_per_pos")
    assert {k: split_m[k] for k in keys} == {k: eager_m[k] for k in keys}
    assert eager_m["spec_decode_num_drafts"] > 0
    assert eng.runner.split_steps >= 1 and eng.runner.graph_steps > eng.runner.split_steps
