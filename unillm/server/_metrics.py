"""The server's Prometheus metrics, named the way vLLM names the ones that mean the same.

Latency histograms and token counters are observed as requests run; the running and waiting
gauges and the KV-cache figures are read at scrape time from the pool (``kv_stats()`` of each
loaded engine), so they are never stale and cost nothing between scrapes. Each app has a registry
of its own: two servers in one process never share counts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from unillm.server._pool import Pool

__all__ = ["Metrics"]

_LABELS = ("model_name", "backend")
# vLLM's buckets, so dashboards built for it read these the same way.
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
         40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0)  # fmt: skip
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
        960.0, 1920.0, 7680.0)  # fmt: skip


class Metrics:
    """Every metric of one server."""

    def __init__(self, pool: Pool) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "unillm:time_to_first_token_seconds", "Time to first token.", _LABELS, buckets=_TTFT, registry=r
        )
        self.itl = Histogram(
            "unillm:inter_token_latency_seconds", "Time between streamed tokens.", _LABELS, buckets=_ITL,
            registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "unillm:e2e_request_latency_seconds", "Request latency, arrival to last token.", _LABELS,
            buckets=_E2E, registry=r,
        )  # fmt: skip
        self.queue = Histogram(
            "unillm:request_queue_time_seconds", "Time a request waited for a slot.", _LABELS,
            buckets=_E2E, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter("unillm:prompt_tokens", "Prompt tokens processed.", _LABELS, registry=r)
        self.generation_tokens = Counter("unillm:generation_tokens", "Tokens generated.", _LABELS, registry=r)
        self.success = Counter(
            "unillm:request_success",
            "Requests that finished generating, by finish reason.",
            (*_LABELS, "finished_reason"),
            registry=r,
        )
        self.requests = Counter(
            "unillm:requests", "HTTP requests answered, by route and status.", ("route", "status"), registry=r
        )
        self.stalled = Counter(
            "unillm:stalled_clients",
            "Streams cut off because the client took none of its answer for write_timeout_s.",
            registry=r,
        )
        self.closed_connections = Counter(
            "unillm:closed_connections",
            "Connections closed by the server's limits, by why (header_timeout, too_many_connections, "
            "headers_too_large).",
            ("why",),
            registry=r,
        )
        r.register(_PoolCollector(pool))
        ProcessCollector(registry=r)  # process_resident_memory_bytes and the rest, where /proc is
        tree = Gauge(
            "unillm:resident_memory_bytes",
            "Resident memory of the server and the processes it started (an engine's own workers).",
            registry=r,
        )
        tree.set_function(_tree_rss)

    def labels(self, alias: str, backend: str) -> _Bound:
        return _Bound(self, alias, backend)


def _tree_rss(pid: int | None = None) -> float:
    """The resident bytes of process ``pid`` (this one) and its descendants, read from /proc; NaN
    where /proc cannot tell (macOS), so a scrape never invents a figure."""
    pid = os.getpid() if pid is None else pid
    page = os.sysconf("SC_PAGE_SIZE")
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/statm", encoding="ascii") as f:
                total += int(f.read().split()[1]) * page
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children", encoding="ascii") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError, IndexError):
            if p == pid:
                return float("nan")
    return float(total)


class _Bound:
    """The metrics of one alias, children resolved once per request (not per token)."""

    __slots__ = ("e2e", "generation_tokens", "itl", "labels", "metrics", "prompt_tokens", "queue", "ttft")

    def __init__(self, m: Metrics, alias: str, backend: str) -> None:
        self.metrics = m
        self.labels = (alias, backend)
        self.ttft = m.ttft.labels(alias, backend)
        self.itl = m.itl.labels(alias, backend)
        self.e2e = m.e2e.labels(alias, backend)
        self.queue = m.queue.labels(alias, backend)
        self.prompt_tokens = m.prompt_tokens.labels(alias, backend)
        self.generation_tokens = m.generation_tokens.labels(alias, backend)

    def finished(self, reason: str) -> None:
        self.metrics.success.labels(*self.labels, reason).inc()


class _PoolCollector:
    """Gauges read from the pool when Prometheus scrapes."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def describe(self) -> list[Any]:
        return []  # nothing until collected: the families depend on what is loaded

    def collect(self) -> Iterator[Any]:
        running = GaugeMetricFamily(
            "unillm:num_requests_running",
            "Requests the engine has (it may queue some itself).",
            labels=_LABELS,
        )
        waiting = GaugeMetricFamily(
            "unillm:num_requests_waiting", "Requests waiting in the server's queue.", labels=_LABELS
        )
        loaded = GaugeMetricFamily("unillm:model_loaded", "1 while the model is loaded.", labels=_LABELS)
        usage = GaugeMetricFamily(
            "unillm:kv_cache_usage_perc", "KV-cache usage, 1 is full (from kv_stats).", labels=_LABELS
        )
        queries = CounterMetricFamily(
            "unillm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels=_LABELS
        )
        hits = CounterMetricFamily(
            "unillm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels=_LABELS
        )
        for slot in self._pool.slots.values():
            labels = [slot.alias, slot.backend or ""]
            adm = slot.admission
            running.add_metric(labels, adm.running if adm else 0)
            waiting.add_metric(labels, adm.waiting if adm else 0)
            engine = slot.engine
            loaded.add_metric(labels, 1 if slot.loaded else 0)
            if engine is None or not slot.loaded:
                continue
            try:
                kv = engine.kv_stats()
            except Exception:  # a scrape never fails for one engine's trouble
                continue
            if kv.utilization is not None:
                usage.add_metric(labels, kv.utilization)
            if kv.prefix_cache_queries is not None and kv.prefix_cache_hits is not None:
                queries.add_metric(labels, kv.prefix_cache_queries)
                hits.add_metric(labels, kv.prefix_cache_hits)
        yield from (running, waiting, loaded, usage, queries, hits)
