"""Schemathesis against the server's own OpenAPI schema: no generated request may get a 5xx."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from server_util import ServerThread
from tiny import text_model, tiny_engine

# A short context bounds every generated request's work (max_tokens can be at most 63 here).
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def srv():
    s = ServerThread(tiny_engine(text_model(), max_model_len=MAX_MODEL_LEN), "tiny").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def schema(srv):
    return schemathesis.openapi.from_url(srv.url + "/openapi.json")


def _operations(schema) -> list:
    return [r.ok() for r in schema.get_all_operations()]


def test_schema_lists_the_api(schema):
    paths = {(op.method.upper(), op.path) for op in _operations(schema)}
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
            ("GET", "/health"), ("GET", "/metrics")} <= paths


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
def test_no_server_errors(srv, schema, mode):
    calls = []
    for op in _operations(schema):
        examples = 30 if op.method.upper() == "POST" else 5

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def check(case) -> None:
            calls.append(case.operation.path)
            case.call_and_validate(base_url=srv.url, checks=[not_a_server_error], timeout=60)

        try:
            check()
        except Unsatisfiable:
            # Negative mode cannot break an operation that takes no input (e.g. GET /health).
            assert mode == schemathesis.GenerationMode.NEGATIVE and op.method.upper() == "GET", op.path
    assert calls.count("/v1/completions") >= 10 and calls.count("/v1/chat/completions") >= 10
