"""Prometheus metrics of one server, named as vLLM's where vLLM has them.

Invariants:
- Every metric lives on the `ServerMetrics` instance's own `CollectorRegistry`, never on
  prometheus_client's global one: two apps in one process count apart.
- Engine state (running / waiting requests, KV-cache usage and blocks, prefix-cache queries and
  hits, preemptions) is read from the latest `EngineStats` snapshot at scrape time, so `/metrics`
  never calls into the engine; request figures (tokens, latencies, finished requests) are
  recorded as the deltas reach the event loop.
"""
from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from minivllm_jax.engine.llm_engine import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    """Yields the engine-state metrics of the snapshot it was last given."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        s, labels = self.stats, [self.model_name]
        if s is None:  # before the first render
            return

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("vllm:num_requests_running", "Sequences in the running batch.", s.num_running_reqs)
        yield gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting_reqs)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = all blocks in use).", s.kv_cache_usage)
        yield gauge("minivllm:num_kv_blocks", "KV-cache blocks (one is the null block).", s.num_kv_blocks)
        yield gauge("minivllm:num_free_kv_blocks", "Free KV-cache blocks.", s.num_free_kv_blocks)
        info = GaugeMetricFamily("minivllm:engine_config_info", "The engine's weight "
                                 "quantization (none: the model dtype) and KV-cache dtype.",
                                 labels=["model_name", "quantization", "kv_cache_dtype"])
        info.add_metric([*labels, s.quantization or "none", s.kv_cache_dtype], 1)
        yield info
        yield gauge("minivllm:weight_bytes", "Bytes of the weights, all devices.", s.weight_bytes)
        yield gauge("minivllm:kv_cache_bytes", "Bytes of the KV cache, all devices.", s.kv_cache_bytes)
        yield counter("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.", s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.", s.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Preemptions.", s.num_preemptions)
        yield counter("vllm:spec_decode_num_drafts", "Draft runs verified (one per request and step).",
                      s.spec_num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", s.spec_num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      s.spec_num_accepted_tokens)


class ServerMetrics:
    """The server's metrics; all recording happens on the event loop's thread."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine = _EngineCollector(model_name)
        self.registry.register(self._engine)
        kw = dict(labelnames=["model_name"], registry=self.registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", **kw).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed.",
                                         **kw).labels(model_name)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              buckets=TTFT_BUCKETS, **kw).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between a request's "
                             "consecutive output steps.", buckets=ITL_BUCKETS, **kw).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=E2E_BUCKETS, **kw).labels(model_name)
        self._success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                                labelnames=["model_name", "finished_reason"], registry=self.registry)
        self._model_name = model_name

    def request_accepted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def tokens(self, count: int, ttft: float | None, itl: float | None) -> None:
        """`count` new tokens of one request; `ttft` when they are its first, else `itl`."""
        self.generation_tokens.inc(count)
        if ttft is not None:
            self.ttft.observe(ttft)
        if itl is not None:
            self.itl.observe(itl)

    def request_finished(self, reason: str, e2e: float) -> None:
        self._success.labels(self._model_name, reason).inc()
        self.e2e.observe(e2e)

    def render(self, stats: EngineStats) -> bytes:
        """The Prometheus text exposition, engine state as of `stats`."""
        self._engine.stats = stats
        return generate_latest(self.registry)
