"""worker/graphs.capture_graph keeps Python's cyclic garbage collector off for the length of a CUDA graph
capture, and restores it afterwards, also when the captured forward raises (session 20: a collection inside a
capture ran a dead engine's CUDA destructors and broke the capture). The CUDA calls are replaced by fakes
that record the collector's state, so this runs on any machine; the GPU gates (tests/test_real_model_spec.py
on CUDA) exercise the real capture."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from verispec.worker import graphs


class _FakeStream:
    def wait_stream(self, other) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's stream and graph calls as no-ops; returns the list of gc states seen inside a capture."""
    seen: list[bool] = []

    @contextlib.contextmanager
    def graph(g, pool=None, capture_error_mode="global"):
        seen.append(gc.isenabled())
        yield

    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    return seen


@pytest.mark.parametrize("enabled", [True, False])
def test_collector_off_during_capture_and_restored(fake_cuda, enabled):
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        states = []
        _, out = graphs.capture_graph(lambda: states.append(gc.isenabled()) or 7, pool=None)
        assert out == 7
        assert states == [enabled, False]  # the warm-up runs as the caller had it; the capture runs with it off
        assert fake_cuda == [False]
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_collector_restored_when_the_capture_raises(fake_cuda):
    was = gc.isenabled()
    gc.enable()
    calls = []

    def forward():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("capture failed")

    try:
        with pytest.raises(RuntimeError, match="capture failed"):
            graphs.capture_graph(forward, pool=None)
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
