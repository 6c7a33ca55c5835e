"""Prometheus metrics for /metrics: requests, tokens, TTFT and inter-token latency, and the engine's
pool occupancy by state, prefix hits by tier and preemptions, read from the latest stats snapshot."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagecli.engine.stats import EngineStats
from pagecli.serve.jobs import Job

CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # the *_created series only repeat the start time
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _EngineCollector:
    """Gauges and counters the engine already keeps, taken from its snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], EngineStats]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        stats = self._snapshot()
        blocks = GaugeMetricFamily("pagecli_kv_blocks", "KV pool blocks by state (shared is part of active).",
                                   labels=["state"])
        for state in ("free", "cached", "active", "shared"):
            blocks.add_metric([state], getattr(stats, f"blocks_{state}"))
        yield blocks
        yield GaugeMetricFamily("pagecli_requests_running", "Sequences in the running batch.", stats.num_running)
        yield GaugeMetricFamily("pagecli_requests_waiting", "Sequences waiting for the batch.", stats.num_waiting)
        hits = CounterMetricFamily("pagecli_prefix_hit_tokens", "Prompt tokens served from the prefix cache.",
                                   labels=["tier"])
        hits.add_metric(["memory"], stats.prefix_hit_tokens)
        hits.add_metric(["disk"], stats.prefix_disk_hit_tokens)
        yield hits
        yield CounterMetricFamily("pagecli_prefix_query_tokens", "Prompt tokens looked up in the prefix cache.",
                                  stats.prefix_query_tokens)
        yield CounterMetricFamily("pagecli_preemptions", "Sequences preempted for lack of blocks.",
                                  stats.num_preemptions)
        yield CounterMetricFamily("pagecli_prompt_tokens_computed", "Prompt tokens prefilled (not cached).",
                                  stats.prompt_tokens_computed)
        for name, text in (("drafts", "Draft tokens checked (--speculate)."),
                           ("accepted", "Draft tokens the model agreed with (--speculate)."),
                           ("passes", "Sequence-steps that checked drafts (--speculate)."),
                           ("tokens", "Tokens those checking passes yielded (--speculate).")):
            yield CounterMetricFamily(f"pagecli_spec_{name}", text, getattr(stats, f"spec_{name}"))


class ServerMetrics:
    """One registry per server (tests run several in one process); a JobObserver for the engine thread."""

    def __init__(self, snapshot: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("pagecli_requests", "HTTP requests answered, by endpoint and status.",
                                ["endpoint", "status"], registry=self.registry)
        self.prompt_tokens = Counter("pagecli_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=self.registry)
        self.completion_tokens = Counter("pagecli_completion_tokens", "Tokens generated.", registry=self.registry)
        self.ttft = Histogram("pagecli_time_to_first_token_seconds", "From arrival to the first token.",
                              buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.itl = Histogram("pagecli_inter_token_latency_seconds", "Between two tokens of one sequence.",
                             buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.registry.register(_EngineCollector(snapshot))  # type: ignore[arg-type]

    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # JobObserver: called on the engine thread.
    def admitted(self, job: Job) -> None:
        self.prompt_tokens.inc(job.prompt_tokens)

    def token(self, job: Job, inter_token_s: float | None) -> None:
        self.completion_tokens.inc()
        if inter_token_s is not None:
            self.itl.observe(inter_token_s)
        elif job.completion_tokens == 1 and job.ttft_s is not None:
            self.ttft.observe(job.ttft_s)

    def finished(self, job: Job) -> None:
        pass
