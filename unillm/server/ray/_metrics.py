"""The replicas' metrics: gathered at the ingress's ``/metrics`` with a ``replica`` label on every
series, and exported through Ray's metrics agent to the cluster's Prometheus.

The ingress asks every live replica for its report (``Replica.record_routing_stats``: the KV
cache's fill, prefix hits and the same exposition ``unillm serve``'s ``/metrics`` gives) at each
scrape, and every ``stats_period_s`` for the router. For Ray's export, each
replica sets one ``ray.serve.metrics.Gauge`` per series it has (Serve adds the deployment, replica
and application tags): counters and histogram buckets arrive as gauges holding their running totals,
which Prometheus's ``rate()`` reads as it reads counters."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

__all__ = [
    "DECISIONS", "REPORTS", "SEEN", "RayExport", "decisions", "gathered", "pull", "pull_decisions",
    "relabeled",
]  # fmt: skip

_NAME = re.compile(r"[^a-zA-Z0-9_]")


def relabeled(texts: dict[str, str]) -> str:
    """One exposition from several replicas' (name -> text): every sample labelled ``replica``."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Any] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = s.labels if "replica" in s.labels else {**s.labels, "replica": replica}
                families.setdefault(family.name, _empty(family))
                families[family.name].samples.append(s._replace(labels=labels))
    return _exposition(list(families.values()))


def _exposition(families: list[Any]) -> str:
    """The Prometheus text of metric families built here (not a registry's own metrics)."""
    from prometheus_client import CollectorRegistry, generate_latest

    class _Collected:
        def collect(self) -> Iterator[Any]:
            yield from families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collected())  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def _empty(family: Any) -> Any:
    from prometheus_client import Metric

    return Metric(family.name, family.documentation, family.type, family.unit)


REPORTS: dict[str, dict[str, Any]] = {}
"""The latest report of each model replica of this process's application (replica id -> report),
refreshed by :func:`pull`; the router reads each replica's ``kv_usage`` here."""


SEEN: dict[str, int] = {"replicas": 0}
"""How many model replicas this process's prefix router can send to (Serve tells it as they come
and go; a router just started may not know them all yet)."""

DECISION_KINDS = ("prefix", "overflow", "new", "load")
DECISIONS: Counter[str] = Counter()
"""What this process's prefix routers decided, request by request (``decisions`` says it as
``unillm:ray_router_decisions_total``): ``prefix``, to the replica holding the prompt's prefix;
``overflow``, passed over from it for load or a full KV cache; ``new``, a prefix seen for the first
time; ``load``, no prefix to route by."""


async def _reports(app: str, deployment: str, timeout_s: float) -> dict[str, dict[str, Any]]:
    """Every live replica of ``deployment`` in application ``app``, asked for its report (its
    ``record_routing_stats``) now: replica id -> report. A replica that does not answer within
    ``timeout_s`` (dying, busy loading) is left out."""
    import asyncio

    import ray

    mine = f"SERVE_REPLICA::{app}#{deployment}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(mine)]

    async def one(name: str) -> tuple[str, dict[str, Any] | None]:
        try:
            actor = ray.get_actor(name, namespace="serve")
            return name.removeprefix(mine), await asyncio.wait_for(
                actor.record_routing_stats.remote(), timeout_s
            )
        except Exception:  # gone between the listing and the call, or too slow
            return name.removeprefix(mine), None

    return {k: v for k, v in await asyncio.gather(*(one(n) for n in names)) if isinstance(v, dict)}


async def pull(app: str, timeout_s: float = 5.0) -> dict[str, dict[str, Any]]:
    """Ask every live model replica of application ``app`` for its report (KV use, prefix hits,
    metrics) now; the answers replace ``REPORTS``."""
    found = await _reports(app, "UnillmModel", timeout_s)
    REPORTS.clear()
    REPORTS.update(found)
    return found


async def pull_decisions(app: str, timeout_s: float = 5.0) -> tuple[Counter[str], int]:
    """The decisions of application ``app``'s direct routers (the ``UnillmRouter`` replicas, each
    reporting its process's ``DECISIONS`` and ``SEEN``), summed, and the fewest replicas any of
    them can send to."""
    total: Counter[str] = Counter()
    seen: list[int] = []
    for report in (await _reports(app, "UnillmRouter", timeout_s)).values():
        total.update(report.get("decisions") or {})
        seen.append(int(report.get("replicas") or 0))
    return total, min(seen, default=0)


def gathered(reports: dict[str, dict[str, Any]]) -> str:
    """The exposition of every replica's report, each sample labelled with its replica."""
    texts = {name: r["metrics"] for name, r in reports.items() if isinstance(r.get("metrics"), str)}
    return relabeled(texts)


def decisions(counts: Counter[str] | None = None, replicas: int | None = None) -> str:
    """The exposition of prefix routers' decisions and of the replicas they see: ``counts`` and
    ``replicas``, by default this process's (``DECISIONS``, ``SEEN``)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    family = CounterMetricFamily(
        "unillm:ray_router_decisions",
        "Requests the prefix router sent: prefix (to its prefix's replica), overflow (passed over "
        "from it for load or a full KV cache), new (a prefix first seen), load (no prefix).",
        labels=["decision"],
    )
    for what in DECISION_KINDS:
        family.add_metric([what], float((DECISIONS if counts is None else counts)[what]))
    seen = GaugeMetricFamily(
        "unillm:ray_router_replicas",
        "Model replicas the prefix router can send to (the fewest, over several routers).",
        value=float(SEEN["replicas"] if replicas is None else replicas),
    )
    return _exposition([family, seen])


class RayExport:
    """Sets Ray gauges from a replica's registry (``push``), one per sample name."""

    def __init__(self) -> None:
        self._gauges: dict[tuple[str, tuple[str, ...]], Any] = {}

    def push(self, text: str) -> int:
        """Export every sample of ``text``; returns how many were set."""
        from prometheus_client.parser import text_string_to_metric_families
        from ray.serve.metrics import Gauge

        n = 0
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_created"):  # when a series began: nothing to chart
                    continue
                name = "unillm_" + _NAME.sub("_", s.name.removeprefix("unillm:"))
                keys = tuple(sorted(s.labels))
                gauge = self._gauges.get((name, keys))
                if gauge is None:
                    description = family.documentation or family.name
                    gauge = self._gauges[(name, keys)] = Gauge(name, description=description, tag_keys=keys)  # type: ignore[arg-type]
                gauge.set(float(s.value), tags=dict(s.labels))
                n += 1
        return n
