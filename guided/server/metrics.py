"""Prometheus metrics of a server: the engine's and the admission queue's gauges and counters,
latency histograms from finished requests. One registry per instance (tests start several apps)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from guided.outputs import RequestOutput

if TYPE_CHECKING:
    from guided.server.admission import Admission
    from guided.serving.client import EngineClient

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                    160.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                 1.0, 2.5)
_COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                    5.0, 10.0, 30.0)


class _EngineCollector(Collector):
    """Reads the engine's cumulative totals at scrape time: the counters are exactly the engine's
    own (no delta bookkeeping that could drift), the gauges are the current state."""

    def __init__(self, engine: EngineClient):
        self._engine = engine

    def collect(self):
        s = self._engine.stats()
        gauges = [
            ("guided_kv_blocks_total", "KV cache blocks in the pool", s.kv_blocks_total),
            ("guided_kv_blocks_in_use", "KV blocks referenced by live requests",
             s.kv_blocks_in_use),
            ("guided_requests_running", "Requests in the running batch", s.num_running),
            ("guided_requests_waiting", "Requests waiting (grammar, admission, preempted)",
             s.num_waiting),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [
            ("guided_prompt_tokens", "Prompt tokens processed", s.prompt_tokens_total),
            ("guided_generation_tokens", "Tokens generated", s.generation_tokens_total),
            ("guided_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
             s.prefix_cache_queries_total),
            ("guided_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
             s.prefix_cache_hit_tokens_total),
            ("guided_jump_forward_tokens", "Tokens appended by jump-forward",
             s.jump_forward_tokens_total),
            ("guided_forward_passes", "Model forward passes", s.forward_passes_total),
            ("guided_preemptions", "Requests preempted", s.preemptions_total),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        finished = CounterMetricFamily("guided_requests", "Finished requests by finish reason",
                                       labels=["finish_reason"])
        for reason, count in sorted(s.requests_finished_total.items()):
            finished.add_metric([reason], count)
        yield finished
        queries, hits = self._engine.compile_queries, self._engine.compile_hits
        yield CounterMetricFamily("guided_grammar_cache_queries", "Constraint compile requests",
                                  value=queries)
        yield CounterMetricFamily("guided_grammar_cache_hits",
                                  "Constraint compiles served from the grammar cache", value=hits)
        yield GaugeMetricFamily("guided_grammar_cache_hit_rate",
                                "Fraction of compile requests served from the cache",
                                value=hits / queries if queries else 0.0)


class ServerMetrics:
    def __init__(self, engine: EngineClient, admission: Admission):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        Gauge("guided_requests_queued", "Engine requests waiting in the server's admission queue",
              registry=self.registry).set_function(lambda: admission.num_waiting)
        Gauge("guided_requests_admitted", "Engine requests holding an admission slot",
              registry=self.registry).set_function(lambda: admission.in_flight)

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=self.registry)

        self.compile_seconds = hist("guided_grammar_compile_seconds",
                                    "Constraint compile time per request", _COMPILE_BUCKETS)
        self.ttft = hist("guided_time_to_first_token_seconds", "Arrival to first token",
                         _LATENCY_BUCKETS)
        self.tpot = hist("guided_time_per_output_token_seconds",
                         "Mean time between output tokens after the first", _TPOT_BUCKETS)
        self.latency = hist("guided_request_latency_seconds", "Arrival to finish",
                            _LATENCY_BUCKETS)

    def observe_finished(self, out: RequestOutput) -> None:
        """Feed the histograms from one finished request (thread-safe: EngineClient's reader
        thread calls it)."""
        m = out.metrics
        if m.compile_seconds is not None:
            self.compile_seconds.observe(m.compile_seconds)
        if m.ttft is not None:
            self.ttft.observe(max(m.ttft, 0.0))
        if m.finished_time is not None:
            self.latency.observe(max(m.finished_time - m.arrival_time, 0.0))
            num_tokens = len(out.token_ids)
            if m.first_token_time is not None and num_tokens > 1:
                self.tpot.observe(max(m.finished_time - m.first_token_time, 0.0)
                                  / (num_tokens - 1))
