"""Prometheus metrics for `verispec serve`, in a per-app registry.

Latency histograms are observed as requests finish; engine counters and gauges are read at scrape time from
the engine thread's latest snapshot (the engine itself is never touched from the HTTP side).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from verispec.entrypoints.async_engine import AsyncEngine, RequestStats

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)

# engine counter key -> (metric name without _total, help)
_ENGINE_COUNTERS = {
    "prompt_tokens": ("verispec:prompt_tokens", "Prompt tokens processed."),
    "generation_tokens": ("verispec:generation_tokens", "Tokens generated."),
    "num_preemptions": ("verispec:num_preemptions", "Requests preempted for lack of KV blocks."),
    "spec_decode_num_drafts": ("verispec:spec_decode_num_drafts", "Speculative draft rounds verified."),
    "spec_decode_num_draft_tokens": ("verispec:spec_decode_num_draft_tokens", "Draft tokens proposed."),
    "spec_decode_num_accepted_tokens": ("verispec:spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    "spec_decode_audit_mismatches": (
        "verispec:spec_decode_audit_mismatches", "Audited speculative steps whose output differed from plain decoding."),
}


class _EngineCollector(Collector):
    """Counters and gauges read from the engine thread's snapshot at scrape time."""

    def __init__(self, aengine: AsyncEngine, model_name: str) -> None:
        self.aengine = aengine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        snap = self.aengine.snapshot
        labels = ["model_name"]
        for key, (name, doc) in _ENGINE_COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self.model_name], float(snap.get(key, 0)))
            yield c
        per_pos = CounterMetricFamily(
            "verispec:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each draft position.",
            labels=["model_name", "position"],
        )
        for i, v in enumerate(snap.get("spec_decode_num_accepted_tokens_per_pos", [])):
            per_pos.add_metric([self.model_name, str(i)], float(v))
        yield per_pos
        aborted = CounterMetricFamily("verispec:request_aborted", "Requests aborted (client gone).", labels=labels)
        aborted.add_metric([self.model_name], float(self.aengine.num_aborted))
        yield aborted
        total = snap.get("num_total_blocks", 0) or 0
        free = snap.get("num_free_blocks", 0) or 0
        gauges = {
            "verispec:num_requests_waiting": ("Requests waiting to be scheduled.", self.aengine.num_waiting()),
            "verispec:num_requests_running": ("Requests running.", snap.get("num_requests_running", 0)),
            "verispec:kv_cache_usage_perc": ("Fraction of KV-cache blocks in use (0..1).",
                                             (1.0 - free / total) if total else 0.0),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self.model_name], float(value))
            yield g


class ServerMetrics:
    """Everything /metrics exposes for one app."""

    def __init__(self, aengine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        lab = ["model_name"]
        self.success = Counter("verispec:request_success", "Requests finished normally.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.errors = Counter("verispec:request_error", "Requests answered with an error.",
                              ["model_name", "status"], registry=self.registry)
        self.ttft = Histogram("verispec:time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("verispec:time_per_output_token_seconds", "Mean time per output token after the first.",
                              lab, buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("verispec:e2e_request_latency_seconds", "End-to-end request latency.", lab,
                             buckets=_E2E_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(aengine, model_name))

    def observe_finished(self, st: RequestStats) -> None:
        """Called by the engine thread when a request finishes."""
        m = self.model_name
        self.success.labels(m, st.finish_reason or "unknown").inc()
        self.e2e.labels(m).observe(st.e2e)
        if st.ttft is not None:
            self.ttft.labels(m).observe(st.ttft)
            if st.num_output_tokens > 1:
                self.tpot.labels(m).observe((st.e2e - st.ttft) / (st.num_output_tokens - 1))

    def observe_error(self, status: int) -> None:
        """Count a request answered with an error status."""
        self.errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        """Prometheus text exposition."""
        return generate_latest(self.registry)
