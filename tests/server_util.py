"""Run the real HTTP server (uvicorn, loopback only) in a background thread for tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import uvicorn

from verispec.entrypoints.server import build_app


def wait_for(cond: Callable[[], bool], timeout: float, what: str = "condition") -> None:
    """Poll `cond` until it holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.02)


class ServerThread:
    """build_app(engine, ...) served by uvicorn on a free 127.0.0.1 port until stop()."""

    def __init__(self, engine, name: str = "tiny", **app_kw) -> None:
        self.engine = engine
        self.app = build_app(engine, name, **app_kw)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        cfg = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                             timeout_graceful_shutdown=3)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def aengine(self):
        return self.app.state.aengine

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), timeout, "the server to start")
        assert self.server.started, "uvicorn failed to start"
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "server thread did not stop"

    def idle(self) -> bool:
        """No request in the engine or the server (read from the engine thread's snapshot)."""
        s = self.aengine.snapshot
        return (s["num_requests_running"] == 0 and s["num_requests_waiting"] == 0
                and s.get("num_requests_in_server", 0) == 0 and self.aengine.num_pending_adds == 0)

    def wait_blocks(self, start: int, timeout: float = 30.0) -> None:
        """Poll until the engine is idle and its free KV blocks are back to `start`."""
        wait_for(lambda: self.idle() and self.aengine.snapshot["num_free_blocks"] == start, timeout,
                 f"free KV blocks to return to {start}")
