"""The config chain: EngineConfig / SpeculativeConfig are frozen and checked in one place; LLM(...) takes
exactly their fields (an unknown keyword is a TypeError, raised before any load); the generate / serve / bench
flags are made from the same fields, with help and defaults, and bad values end the command at once."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verispec.config import DEFAULT_MODEL, EngineConfig, SpeculativeConfig
from verispec.entrypoints.args import engine_config_from_args, engine_fields

ROOT = Path(__file__).resolve().parents[1]

# One bad value per EngineConfig field: a new field needs its entry here (and gets checked).
BAD = {
    "model": "",
    "device": "gpu",
    "dtype": "float8",
    "speculative_config": {"method": "magic"},
    "async_scheduling": "yes",
    "enable_prefix_caching": 1,
    "max_num_seqs": 0,
    "max_model_len": 1,
    "max_num_batched_tokens": -5,
    "block_size": 0,
    "num_gpu_blocks": 0,
    "gpu_memory_utilization": 1.5,
    "seed": 1.5,
    "spec_audit_rate": -0.1,
    "enforce_eager": "no",
    "graph_capture": "some",
    "gc_freeze": "yes",
    "quantization": "awq",
    "tensor_parallel_size": 0,
    "data_parallel_size": "2",
    "distributed_timeout": 0,
    "batch_invariant": 0,
}


@pytest.fixture
def no_load(monkeypatch):
    """Make any model load (or engine build) fail the test: errors must come before it."""
    from verispec.engine import engine as engine_mod
    from verispec.loader import model_loader

    def boom(*a, **k):
        raise AssertionError("the model was loaded before the bad argument was reported")

    monkeypatch.setattr(engine_mod, "build_engine_parts", boom)
    monkeypatch.setattr(model_loader, "load_model", boom)


def test_unknown_llm_keyword_is_a_type_error_before_any_load(no_load):
    from verispec.entrypoints.llm import LLM

    t0 = time.monotonic()
    with pytest.raises(TypeError, match="not_an_option"):
        LLM("qwen2.5-coder-0.5b-instruct", device="cpu", not_an_option=1)
    with pytest.raises(TypeError, match="'enforce_eagre'.*did you mean 'enforce_eager'"):
        LLM("qwen2.5-coder-0.5b-instruct", device="cpu", enforce_eagre=True)
    assert time.monotonic() - t0 < 2.0


def test_llm_takes_exactly_the_config_fields():
    import inspect

    from verispec.entrypoints.llm import LLM

    params = list(inspect.signature(LLM).parameters.values())
    assert [p.name for p in params] == EngineConfig.field_names()
    assert params[0].name == "model" and params[0].default == DEFAULT_MODEL
    assert {p.name: p.default for p in params} == {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert "extra" not in EngineConfig.field_names()
    with pytest.raises(TypeError, match="extra"):
        EngineConfig.from_kwargs({"extra": {}}, caller="LLM()")


def test_every_field_has_help_and_a_bad_value():
    fields = dataclasses.fields(EngineConfig)
    assert set(BAD) == {f.name for f in fields}, "add the new field's bad value to BAD"
    for f in [*fields, *dataclasses.fields(SpeculativeConfig)]:
        assert f.metadata["help"], f.name


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_value_names_the_field(name, no_load):
    from verispec.entrypoints.llm import LLM

    with pytest.raises(ValueError, match=name):
        EngineConfig(**{name: BAD[name]})
    kw = {"device": "cpu", name: BAD[name]} if name != "device" else {name: BAD[name]}
    with pytest.raises(ValueError, match=name):
        LLM(**kw)  # before any load (no_load)


def test_every_contract_option_is_implemented(no_load):
    """No option of the contract is refused as "not supported yet" at a valid value any more."""
    EngineConfig(quantization="gguf", tensor_parallel_size=2, data_parallel_size=2, batch_invariant=True)


def test_batch_invariant_needs_cuda(no_load):
    """batch_invariant=True is a config value like any other, and on a device without the CUDA kernels
    a ValueError naming it, before anything loads."""
    from verispec.engine.builder import resolve_config
    from verispec.entrypoints.llm import LLM

    assert EngineConfig(batch_invariant=True).batch_invariant is True
    with pytest.raises(ValueError, match="batch_invariant=True needs CUDA"):
        resolve_config(EngineConfig(device="cpu", batch_invariant=True))
    with pytest.raises(ValueError, match="batch_invariant=True needs CUDA"):
        LLM(device="cpu", batch_invariant=True)
    assert resolve_config(EngineConfig(device="cpu", batch_invariant=False)).batch_invariant is False


def test_configs_are_frozen_and_hashable():
    cfg = EngineConfig(model="m", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert isinstance(cfg.speculative_config, SpeculativeConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_num_seqs = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.speculative_config.num_speculative_tokens = 5
    same = EngineConfig(model="m", speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    assert cfg == same and hash(cfg) == hash(same) and len({cfg, same}) == 1
    with pytest.raises(ValueError, match="max_num_seqs"):
        dataclasses.replace(cfg, max_num_seqs=0)  # a copy is checked too
    assert EngineConfig(**cfg.as_kwargs()) == cfg


def test_speculative_config_adaptive_and_keys():
    sc = SpeculativeConfig.from_dict({"method": "ngram"})
    assert sc.adaptive is True  # the contract's default (../shared/CONTRACT.md)
    assert SpeculativeConfig.from_dict({"method": "ngram", "adaptive": False}).adaptive is False
    with pytest.raises(ValueError, match="adaptive"):
        SpeculativeConfig.from_dict({"method": "ngram", "adaptive": "sometimes"})
    assert SpeculativeConfig.from_dict({"model": "d"}).method == "draft_model"  # vLLM: a model implies it
    with pytest.raises(ValueError, match="unknown keys"):
        SpeculativeConfig.from_dict({"method": "ngram", "k": 2})


def test_engine_resolves_auto_values():
    from verispec.engine.builder import resolve_config

    cfg = resolve_config(EngineConfig(device="cpu"))
    assert (cfg.device, cfg.dtype, cfg.async_scheduling) == ("cpu", "float32", False)
    # GGUF files run quantized on the CPU by default (where torch has the int4 matmul); folders never do
    from verispec.loader.cpu_pack import cpu_int4_available

    assert cfg.quantization == ("gguf" if cpu_int4_available() else "none")
    assert resolve_config(EngineConfig(device="cpu", model="/some/hf_folder")).quantization == "none"
    assert resolve_config(EngineConfig(device="cpu", model="x.gguf", quantization="none")).quantization == "none"
    assert resolve_config(EngineConfig(device="cpu", model="x.gguf", quantization="gguf")).quantization == "gguf"
    assert resolve_config(EngineConfig(device="cpu", async_scheduling=True, dtype="bfloat16")).async_scheduling


def test_flags_become_the_config():
    from verispec.entrypoints.cli import build_parser

    p = build_parser()
    args = p.parse_args(["generate", "hi", "--device", "cpu", "--max-num-seqs", "8", "--no-enable-prefix-caching",
                         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                         "--enforce-eager", "--graph-capture", "all", "--no-gc-freeze"])
    cfg = engine_config_from_args(args, "generate")
    assert cfg == EngineConfig(device="cpu", max_num_seqs=8, enable_prefix_caching=False, enforce_eager=True,
                               speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                               graph_capture="all", gc_freeze=False)
    assert engine_config_from_args(p.parse_args(["generate"]), "generate") == EngineConfig()
    assert engine_config_from_args(p.parse_args(["serve", "some-model"]), "serve").model == "some-model"
    assert engine_config_from_args(p.parse_args(["serve", "--model", "m2"]), "serve").model == "m2"
    bench = p.parse_args(["bench", "latency", "--sync-scheduling", "--seed", "3"])
    from verispec.bench.main import _setup

    setup = _setup(bench)
    assert setup.engine.async_scheduling is False and setup.engine.seed == 3 and setup.model == DEFAULT_MODEL


def _cli(*argv: str, columns: int = 1000) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": str(columns)}
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "verispec.entrypoints.cli", *argv], env=env, capture_output=True,
                         text=True, timeout=60)
    return res, time.monotonic() - t0


@pytest.mark.parametrize("command", [("generate",), ("serve",), ("bench", "latency"), ("bench", "throughput")])
def test_help_lists_every_config_flag_with_its_default(command):
    res, _ = _cli(*command, "--help")
    assert res.returncode == 0, res.stderr
    blocks: dict[str, str] = {}  # option -> its help entry (the invocation line and the help under it)
    for line in res.stdout.splitlines():
        if line.startswith("  -"):
            key = line.split()[0].rstrip(",")
            blocks[key] = line
        elif line.startswith("    ") and blocks:
            blocks[key] += " " + line.strip()
    fields = engine_fields(command[0])
    assert len(fields) >= 10
    for f in fields:
        flag = "--" + f.name.replace("_", "-")
        assert f.metadata["help"].split()[0] in blocks[flag], blocks[flag]
        assert f"(default: {f.default})" in blocks[flag], blocks[flag]
    for flag in ("--quantization", "--tensor-parallel-size", "--batch-invariant", "--device", "--seed"):
        assert flag in res.stdout  # the contract's flags, on every command


def _every_option(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command, parser, action) of every option of every (sub)command."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _every_option(sub, (*path, name))
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield " ".join(path), parser, action


def test_every_option_of_every_command_has_help_and_shows_its_default():
    from verispec.entrypoints.cli import build_parser

    seen = 0
    for command, parser, action in _every_option(build_parser()):
        if action.dest in ("command", "bench_kind"):
            continue
        seen += 1
        where = f"verispec {command} {'/'.join(action.option_strings) or action.dest}"
        assert action.help, f"{where} has no help text"
        assert "%(default)" in parser.formatter_class(prog="x")._get_help_string(action) \
            or not action.option_strings, f"{where}: --help does not show its default"
    assert seen > 100


def test_version():
    import verispec

    res, _ = _cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"verispec {verispec.__version__}"


@pytest.mark.parametrize("argv, word", [
    (("generate", "--temperature", "-1"), "temperature"),
    (("serve", "--port", "99999"), "port"),
    (("serve", "--port", "0"), "port must be in [1, 65535]"),
    (("serve", "--port", "http"), "port"),
    (("serve", "--max-request-bytes", "0"), "max-request-bytes"),
    (("serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'), "num_speculative_tokens"),
    (("generate", "--top-p", "0"), "top_p"),
    (("generate", "--max-tokens", "-3"), "max_tokens"),
    (("generate", "--speculative-config", "{not json"), "speculative-config"),
    (("serve", "--speculative-config", '{"method": "magic"}'), "method"),
    (("generate", "--max-num-seqs", "0"), "max_num_seqs"),
    (("bench", "throughput", "--quantization", "int4"), "quantization"),
    (("bench", "throughput", "--tensor-parallel-size", "0"), "tensor_parallel_size"),
])
def test_bad_flags_end_at_once_with_one_line(argv, word):
    res, secs = _cli(*argv)
    assert res.returncode == 2, (res.stdout, res.stderr)
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and word in err and "Traceback" not in err, err
    assert secs < 3.0  # no torch import, no model load (about 0.2 s when the machine is idle)
