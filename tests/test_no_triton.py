"""A plain install (no triton) works on the CPU: importing the package's entry points, building engines
and generating never imports triton. Run in a subprocess whose import system refuses triton, as if it
were not installed; only the CUDA path (models/kernel_path.enable_triton) may import it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CODE = r'''
import importlib.abc
import sys


class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: a plain install has no triton)")
        return None


sys.meta_path.insert(0, NoTriton())

import verispec.engine.engine
import verispec.entrypoints.cli
import verispec.entrypoints.llm
import verispec.spec_decode.dflash
import verispec.worker.graphs
from verispec import LLM, SamplingParams
from tiny import run_all, tiny_engine

assert LLM is verispec.entrypoints.llm.LLM
params = SamplingParams(max_tokens=8, temperature=0.0)
prompts = [[11, 12, 13, 14, 11, 12, 13], [5, 6, 7]]
for spec in (None, {"method": "ngram", "num_speculative_tokens": 3}, {"method": "self", "num_speculative_tokens": 2}):
    outs = run_all(tiny_engine(spec=spec), prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8], spec
loaded = sorted(m for m in sys.modules if m == "triton" or m.startswith("triton."))
assert not loaded, loaded
print("no triton: ok")
'''


def test_cpu_engine_never_imports_triton():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    res = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no triton: ok" in res.stdout
