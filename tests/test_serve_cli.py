"""`verispec serve` as a user starts it: the real 0.5B behind the real command line, one start-up line that
says what runs, a clean exit on SIGINT."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
from server_util import wait_for

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_serve_logs_one_start_up_line(qwen05_local, tmp_path):
    port = _free_port()
    err = tmp_path / "stderr.txt"
    cmd = [sys.executable, "-m", "verispec.entrypoints.cli", "serve", "qwen2.5-coder-0.5b-instruct",
           "--device", "cpu", "--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks", "40",
           "--port", str(port), "--served-model-name", "q05",
           "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    with open(err, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_for(lambda: _healthy(f"http://127.0.0.1:{port}") or proc.poll() is not None, 120, "the server")
        assert proc.poll() is None, err.read_text()
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
    text = err.read_text()
    assert rc == 0, text
    lines = [ln for ln in text.splitlines() if "max_model_len" in ln]
    assert len(lines) == 1, text
    line = lines[0]
    for part in ("model q05 (qwen2.5-coder-0.5b-instruct)", "device cpu", "dtype float32", "max_model_len 256",
                 "KV blocks 40 x 16 tokens", '"method":"ngram"', '"num_speculative_tokens":3',
                 f"http://127.0.0.1:{port}"):
        assert part in line, (part, line)
    assert "Traceback" not in text
