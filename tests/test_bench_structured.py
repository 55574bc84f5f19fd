"""`verispec bench structured` end to end on a tiny random-weight model with the real Qwen tokenizer (CPU
float32): both modes per method, equal token counts, JSON outputs that end with their grammar validated
independently (jsonschema), speculation lossless under the grammar; and its checks before anything loads."""

from __future__ import annotations

import json

import pytest

from verispec.bench.structured import DEFAULT_SCHEMA, check_output, load_schema
from verispec.entrypoints.cli import main as cli

SHAPES = '{"hidden_size":64,"intermediate_size":128,"num_layers":2,"num_heads":4,"num_kv_heads":2,"head_dim":16}'
# Top-level enum: '"yes"' or '"no"' then EOS (no free whitespace), so even random weights end it.
SHORT_SCHEMA = {"enum": ["yes", "no", "maybe"]}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_check_output_validates_independently():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 3}}, "required": ["n"]}
    assert check_output('{"n": 2}', schema) == (True, "jsonschema")
    assert check_output('{"n": 7}', schema) == (False, "jsonschema")  # parses, but breaks the bound
    assert check_output('{"n": 2', schema) == (False, "json.loads")
    doc = {"title": "Merge intervals", "language": "python",
           "steps": [{"description": "sort by start", "code": "a.sort()"}], "complexity": "O(n log n)",
           "tests": ["test_empty"]}
    assert check_output(json.dumps(doc), DEFAULT_SCHEMA)[0]
    assert not check_output(json.dumps({**doc, "language": "cobol"}), DEFAULT_SCHEMA)[0]


def test_bad_schema_fails_before_the_model_loads(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "object", "properties": {"a": {"type": "integer", "minimum": "zero"}}}')
    argv = ["bench", "structured", "--model", str(tmp_path / "missing.gguf"), "--device", "cpu"]
    assert cli([*argv, "--schema", str(bad)]) == 2
    assert "not a valid JSON schema" in capsys.readouterr().err
    (tmp_path / "nojson.json").write_text("{oops")
    assert cli([*argv, "--schema", str(tmp_path / "nojson.json")]) == 2
    assert "nojson.json" in capsys.readouterr().err
    assert load_schema(None) == DEFAULT_SCHEMA
    with pytest.raises(ValueError, match="missing.json"):
        load_schema(str(tmp_path / "missing.json"))
    with pytest.raises(SystemExit):
        cli([*argv, "--methods", "none,dflash"])


def test_bench_structured_rows(tmp_path, qwen05_path):
    schema, prompts, out = tmp_path / "s.json", tmp_path / "p.jsonl", tmp_path / "r.json"
    schema.write_text(json.dumps(SHORT_SCHEMA))
    prompts.write_text('{"prompt": "Is 7 prime?"}\n{"prompt": "Is the sky green?"}\n')
    assert cli(["bench", "structured", "--model", str(qwen05_path), "--random-weights", "--device", "cpu",
                "--dtype", "float32", "--model-overrides", SHAPES, "--schema", str(schema), "--prompts",
                str(prompts), "--chat", "--batch-sizes", "1,2", "--num-prompts", "2", "--max-tokens", "16",
                "--repeats", "2", "--methods", "none,self", "--no-adaptive", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["kind"] == "structured" and res["schema"] == SHORT_SCHEMA and res["prompts"].endswith("(chat template)")
    rows = {(r["method"], r["mode"], r["batch_size"]): r for r in res["rows"]}
    assert set(rows) == {(m, mode, b) for m in ("none", "self") for mode in ("free", "json") for b in (1, 2)}
    for (method, mode, b), r in rows.items():
        free, js = rows[(method, "free", b)], rows[(method, "json", b)]
        assert free["output_tokens"] == js["output_tokens"] == rows[("none", "json", b)]["output_tokens"]
        assert r["mismatches"] == 0 and len(r["runs"]) == 2
        if mode == "json":
            assert (r["finished"], r["valid"], r["truncated"], r["refused"]) == (2, 2, 0, 0)
            assert r["validator"] == "jsonschema" and r["vs_free"] == pytest.approx(r["tok_s"] / free["tok_s"])
            assert 2 * 2 <= r["output_tokens"] <= 2 * 6  # '"yes"' / '"no"' / '"maybe"' and EOS, per prompt
        if method == "self":  # pinned k: speculation really ran, and the target drafting for itself is exact
            assert r["k"] == 4 and r["mean_k"] > 0 and r["num_drafts"] > 0
