"""Prometheus metrics of the server, exported on a separate HTTP port.

Every server owns its :class:`prometheus_client.CollectorRegistry` (several
servers in one process, as in the tests, do not collide). Names:

* ``megascore_requests_total{front,rpc,code}`` — finished calls by front (``grpc``,
  ``http``), RPC or HTTP route (``/v1/completions``) and status (the gRPC code name, or
  the HTTP status).
* ``megascore_request_latency_seconds{front,rpc}`` — call latency (per stream message
  for ScoreStream).
* ``megascore_tokens_scored_total`` — real tokens of answered requests.
* ``megascore_queue_depth`` / ``megascore_queue_tokens`` — waiting work.
* ``megascore_batch_fill_ratio`` — real tokens of a step / its token budget.
* ``megascore_padding_overhead`` — (padded - real) / padded tokens of a step.
* ``megascore_step_latency_seconds`` — one engine step on the executor.
* ``megascore_steps_total``, ``megascore_dropped_requests_total`` (cancelled or
  expired before their turn).
* ``megascore_status_not_sent_total{rpc,code}`` — failed calls whose status could not
  be sent: the call had already ended on the client's side (cancelled, deadline).
* ``megascore_model_info{model,world_size,tp,cp,ep,pp}`` — the served model and its
  parallel layout (value 1), set once the engine is attached.
* ``megascore_prefix_cache_hit_tokens_total`` / ``..._lookup_tokens_total`` — tokens
  of scored sequences read from the prefix cache / all tokens of the sequences that
  could read it; ``megascore_prefix_cache_stored_bytes`` and ``..._blocks`` — what it
  holds (``stored_bytes``: the device tier and the outputs); ``..._evictions_total`` —
  blocks dropped; ``..._host_bytes``, ``..._demotions_total``, ``..._promotions_total``
  — the host tier's blocks and the moves to and from it (docs/engine.md "Prefix
  cache"). Read from the engine at each scrape; absent without a cache.
"""

from __future__ import annotations

import logging

import prometheus_client as prom

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class ServerMetrics:
    """The server's Prometheus collectors, in their own registry."""

    def __init__(self):
        self.registry = prom.CollectorRegistry()
        r = self.registry
        self.requests = prom.Counter(
            "megascore_requests",
            "Finished calls by front, RPC or route and status",
            ["front", "rpc", "code"],
            registry=r,
        )
        self.request_latency = prom.Histogram(
            "megascore_request_latency_seconds",
            "Call latency",
            ["front", "rpc"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens_scored = prom.Counter(
            "megascore_tokens_scored", "Real tokens of answered requests", registry=r
        )
        self.queue_depth = prom.Gauge(
            "megascore_queue_depth", "Requests waiting for the engine", registry=r
        )
        self.queue_tokens = prom.Gauge(
            "megascore_queue_tokens", "Tokens waiting for the engine", registry=r
        )
        self.fill_ratio = prom.Histogram(
            "megascore_batch_fill_ratio",
            "Real tokens of a step / token budget (above 1 when its shared prompts save rows)",
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.padding_overhead = prom.Histogram(
            "megascore_padding_overhead",
            "(padded - real) / padded tokens of a step",
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.step_latency = prom.Histogram(
            "megascore_step_latency_seconds",
            "Engine step latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.steps = prom.Counter("megascore_steps", "Engine steps run", registry=r)
        self.dropped = prom.Counter(
            "megascore_dropped_requests",
            "Requests cancelled or expired while queued",
            registry=r,
        )
        self.status_not_sent = prom.Counter(
            "megascore_status_not_sent",
            "Failed calls whose status could not be sent (the call had already ended)",
            ["rpc", "code"],
            registry=r,
        )
        self.model = prom.Info(
            "megascore_model", "Served model and its parallel layout", registry=r
        )
        self._httpd = None
        self._prefix_cache = None

    def set_model(self, name: str, layout) -> None:
        """Records the served model and its :class:`megascore.api.types.ParallelLayout`."""
        self.model.info(
            {
                "model": name,
                "world_size": str(layout.world_size),
                "tp": str(layout.tensor_model_parallel_size),
                "cp": str(layout.context_parallel_size),
                "ep": str(layout.expert_model_parallel_size),
                "pp": str(layout.pipeline_model_parallel_size),
            }
        )

    def set_prefix_cache(self, stats) -> None:
        """Exports the prefix cache's counters: ``stats()`` -> the engine's
        ``prefix_cache_stats()`` dict, read at each scrape."""
        if self._prefix_cache is None:
            self._prefix_cache = _PrefixCacheCollector(stats)
            self.registry.register(self._prefix_cache)
        self._prefix_cache.stats = stats

    def set_queue(self, requests: int, tokens: int) -> None:
        """Updates the queue gauges."""
        self.queue_depth.set(requests)
        self.queue_tokens.set(tokens)

    def observe_step(self, real_tokens: int, padded_tokens: int, budget: int, seconds: float):
        """Records one engine step."""
        self.steps.inc()
        self.step_latency.observe(seconds)
        self.fill_ratio.observe(real_tokens / budget)
        if padded_tokens:
            self.padding_overhead.observe((padded_tokens - real_tokens) / padded_tokens)

    def observe_request(self, rpc: str, code: str, seconds: float, front: str = "grpc") -> None:
        """Records one finished call (or ScoreStream message) with its status: the gRPC
        code name, or for ``front="http"`` the HTTP status of route ``rpc``."""
        self.requests.labels(front=front, rpc=rpc, code=code).inc()
        self.request_latency.labels(front=front, rpc=rpc).observe(seconds)

    def start_http(self, host: str, port: int) -> int:
        """Serves ``/metrics`` on ``host:port`` from a daemon thread; returns the bound port."""
        self._httpd, _ = prom.start_http_server(port, addr=host, registry=self.registry)
        bound = self._httpd.server_port
        logger.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def stop_http(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None


class _PrefixCacheCollector:
    """The prefix cache's metrics, from the engine's counters at scrape time."""

    _NAMES = {  # stats key -> (metric, help, counter)
        "hit_tokens": ("megascore_prefix_cache_hit_tokens", "Tokens read from the cache", True),
        "lookup_tokens": (
            "megascore_prefix_cache_lookup_tokens",
            "Tokens of the sequences that could read the cache",
            True,
        ),
        "stored_bytes": ("megascore_prefix_cache_stored_bytes", "Bytes the cache holds", False),
        "blocks": ("megascore_prefix_cache_blocks", "Blocks the cache holds", False),
        "evictions": ("megascore_prefix_cache_evictions", "Blocks evicted", True),
        "host_bytes": (
            "megascore_prefix_cache_host_bytes",
            "Bytes of the blocks in the host tier",
            False,
        ),
        "demotions": ("megascore_prefix_cache_demotions", "Blocks moved to the host tier", True),
        "promotions": (
            "megascore_prefix_cache_promotions",
            "Blocks moved back from the host tier",
            True,
        ),
    }

    def __init__(self, stats):
        self.stats = stats

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for key, value in (self.stats() or {}).items():
            name, text, counter = self._NAMES[key]
            family = CounterMetricFamily if counter else GaugeMetricFamily
            yield family(name, text, value=value)
