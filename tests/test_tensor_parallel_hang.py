"""A hung tensor-parallel rank (SIGSTOP: alive, silent) ends the engine with a RankFailure once the
collective timeout passes, never a hang; then a killed rank 0 takes its ranks with it. Slow (a group of
its own, ~20 s): -m slow."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from verispec import SamplingParams
from verispec.config import EngineConfig
from verispec.core.parallel import RankFailure
from verispec.engine.engine import LLMEngine

QWEN05 = "qwen2.5-coder-0.5b-instruct"
TIMEOUT = 6.0


@pytest.mark.slow
def test_hung_rank_fails_the_step_after_the_timeout(qwen05_path):
    eng = LLMEngine(EngineConfig(model=QWEN05, device="cpu", dtype="float32", max_model_len=512,
                                 num_gpu_blocks=64, gc_freeze=False, async_scheduling=False,
                                 tensor_parallel_size=2, distributed_timeout=TIMEOUT))
    proc = eng.parts.tp.procs[0]
    try:
        eng.add_request("a", "def f(x):", SamplingParams(temperature=0.0, max_tokens=2))
        while eng.has_unfinished_requests():
            eng.step()
        os.kill(proc.pid, signal.SIGSTOP)
        eng.add_request("b", "def g(x):", SamplingParams(temperature=0.0, max_tokens=2))
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match=rf"did not answer within distributed_timeout={TIMEOUT:g}s"):
            while eng.has_unfinished_requests():
                eng.step()
        assert TIMEOUT - 1 < time.monotonic() - t0 < TIMEOUT + 10
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        eng.shutdown()


@pytest.mark.slow
def test_ranks_exit_when_rank_0_is_killed(qwen05_path, tmp_path):
    script = tmp_path / "tp_parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from verispec.config import EngineConfig
        from verispec.engine.engine import LLMEngine
        if __name__ == "__main__":
            eng = LLMEngine(EngineConfig(model="{QWEN05}", device="cpu", dtype="float32", max_model_len=512,
                                         num_gpu_blocks=64, gc_freeze=False, tensor_parallel_size=2))
            print(eng.parts.tp.procs[0].pid, flush=True)
            time.sleep(600)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait(10)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            try:  # gone, or a zombie (it no longer runs)
                with open(f"/proc/{child}/stat") as f:
                    if f.read().split()[2] == "Z":
                        break
            except FileNotFoundError:
                break
            time.sleep(0.1)
        else:
            os.kill(child, signal.SIGKILL)
            raise AssertionError("rank 1 still runs 30 s after rank 0 was killed")
    finally:
        if parent.poll() is None:
            parent.kill()


@pytest.mark.slow
def test_rank_killed_in_the_middle_of_a_generate(qwen05_path):
    """Killed while the steps run (its collectives in flight): the next collective fails at once."""
    import threading

    eng = LLMEngine(EngineConfig(model=QWEN05, device="cpu", dtype="float32", max_model_len=512,
                                 num_gpu_blocks=64, gc_freeze=False, tensor_parallel_size=2,
                                 distributed_timeout=120.0))
    proc = eng.parts.tp.procs[0]
    try:
        for i in range(4):
            eng.add_request(f"r{i}", "def f(x):", SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        eng.step()
        threading.Timer(1.0, os.kill, (proc.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match=r"tensor-parallel rank 1 \(pid \d+\) was killed by signal 9"):
            while eng.has_unfinished_requests():
                eng.step()
        assert time.monotonic() - t0 < 20  # the kill at 1 s, then one failed collective (not the 120 s timeout)
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_a_script_without_the_main_guard_fails_fast_and_says_why(qwen05_path, tmp_path):
    """spawn re-runs an unguarded script in the rank process, which dies there: rank 0 says so at once
    (not after distributed_timeout)."""
    script = tmp_path / "unguarded.py"
    script.write_text(f'from verispec import LLM\nLLM("{QWEN05}", device="cpu", tensor_parallel_size=2, '
                      'max_model_len=512, gc_freeze=False)\n')
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert res.returncode != 0
    assert "exited with code 1 before joining the group" in res.stderr and "__main__" in res.stderr, res.stderr[-2000:]
    assert time.monotonic() - t0 < 60
