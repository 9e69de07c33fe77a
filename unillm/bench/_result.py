"""A result: one JSON document per run, under a versioned schema, and what reads it back.

Layout (``schema`` = ``SCHEMA``)::

    {"schema": "unillm.bench/1", "partial": false,
     "metadata": {model, weights, engine, unillm_version, hardware, workload, date},
     "target": {"kind": "engine" | "http", ...},
     "output_lengths": {"enforced": ..., "how": ...}, "prompt_lengths_exact": ...,
     "levels": [{"kind", "value", "partial", "summary": {...}, "memory": {...}, "kv": {...},
                 "cost_per_1m_output_tokens", "records": [per-request records]}]}

``summary`` is recomputed from ``records`` on read, so a file's figures always follow the
definitions in ``unillm.bench._metrics`` (and a hand-edited summary cannot disagree with its data).
An embedding benchmark's result (``unillm.bench._embed``) says ``"task": "embed"``: its levels are
batch sizes, its records ``embed`` calls, and it has no ``output_lengths``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unillm.bench._meta import BenchError, WorkloadMismatch, check_metadata
from unillm.bench._metrics import RequestRecord, summarize, summarize_embed
from unillm.bench._workload import BenchWorkload, EmbedWorkload

if TYPE_CHECKING:
    from unillm._plan._estimate import Plan
    from unillm.bench._runner import Level

__all__ = ["SCHEMA", "build_result", "compare", "read_result", "version_changes", "write_result"]

SCHEMA = "unillm.bench/1"


def _plan_dict(plan: Plan | None) -> dict[str, Any] | None:
    if plan is None:
        return None
    return {
        "weights_bytes": plan.weights_bytes,
        "kv_bytes": plan.kv_bytes,
        "overhead_bytes": plan.overhead_bytes,
        "total_bytes": plan.total_bytes,
        "fits": plan.fits,
        "decode_tokens_per_s_ceiling": plan.decode_tokens_per_s_ceiling,
    }


def _kv_summary(level: Level) -> dict[str, Any]:
    before, after = level.kv_before or {}, level.kv_after or {}
    q0, q1 = before.get("prefix_cache_queries"), after.get("prefix_cache_queries")
    h0, h1 = before.get("prefix_cache_hits"), after.get("prefix_cache_hits")
    rate = None
    if q0 is not None and q1 is not None and h0 is not None and h1 is not None and q1 > q0:
        rate = (h1 - h0) / (q1 - q0)
    cap = after.get("capacity_tokens")
    peak = level.kv_peak_used_tokens
    return {
        "capacity_tokens": cap,
        "peak_used_tokens": peak,
        "peak_usage": level.kv_peak_usage
        if level.kv_peak_usage is not None
        else (peak / cap if peak is not None and cap else None),
        "prefix_cache_queries": (q1 - q0) if q0 is not None and q1 is not None else None,
        "prefix_cache_hits": (h1 - h0) if h0 is not None and h1 is not None else None,
        "prefix_hit_rate": rate,
        "before": level.kv_before,
        "after": level.kv_after,
    }


def build_result(
    *,
    metadata: dict[str, Any],
    target: dict[str, Any],
    workload: BenchWorkload,
    levels: Sequence[Level],
    output_enforcement: str,
    prompt_lengths_exact: bool,
    plans: Sequence[Plan | None] = (),
    partial: bool = False,
    price_per_hour: float | None = None,
) -> dict[str, Any]:
    """The result document of a run (not yet checked: ``write_result`` checks)."""
    price = price_per_hour if price_per_hour is not None else workload.price_per_hour
    out_levels = []
    for n, level in enumerate(levels):
        summary = level.summary(workload)
        plan = _plan_dict(plans[n] if n < len(plans) else None)
        peak = level.peak_rss_bytes
        engine_peak = summary["engine_peak_memory_bytes"]
        tps = summary["output_tokens_per_s"]
        out_levels.append(
            {
                "kind": level.kind,
                "value": level.value,
                "partial": level.partial,
                "started": level.started,
                "peak_in_flight": level.peak_in_flight,
                "summary": summary,
                "memory": {
                    "peak_rss_bytes": peak,
                    "engine_peak_bytes": engine_peak,
                    "plan": plan,
                    "plan_over_peak_rss": plan["total_bytes"] / peak if plan and peak else None,
                },
                "kv": _kv_summary(level),
                "cost_per_1m_output_tokens": (price / 3600.0 / tps * 1e6)
                if price is not None and tps
                else None,
                "records": [r.to_dict() for r in level.records],
            }
        )
    return {
        "schema": SCHEMA,
        "partial": partial or any(lv.partial for lv in levels),
        "metadata": metadata,
        "target": target,
        "output_lengths": {
            "enforced": output_enforcement.startswith("ignore_eos"),
            "how": output_enforcement,
        },
        "prompt_lengths_exact": prompt_lengths_exact,
        "price_per_hour": price,
        "levels": out_levels,
    }


def write_result(result: dict[str, Any], path: str | Path) -> Path:
    """Write ``result`` as JSON to ``path``; raises ``IncompleteResult`` (and writes nothing)
    when its metadata is incomplete."""
    if result.get("schema") != SCHEMA:
        raise BenchError(f"not a {SCHEMA} result (schema {result.get('schema')!r})")
    check_metadata(result.get("metadata") or {})
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=1, sort_keys=False, default=str) + "\n", encoding="utf-8")
    return p


def read_result(path: str | Path) -> dict[str, Any]:
    """A result written by ``write_result``, its summaries recomputed from its records."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchError(f"cannot read the result {str(p)!r}: {exc}") from exc
    schema = data.get("schema") if isinstance(data, dict) else None
    if schema != SCHEMA:
        raise BenchError(f"{str(p)!r} is not a {SCHEMA} result (schema {schema!r})")
    if data.get("task") == "embed":  # unillm.bench._embed's: levels of batch sizes
        _embed_levels(data)
        return data
    workload = BenchWorkload(**data["metadata"]["workload"])
    for level in data["levels"]:
        records = [RequestRecord.from_dict(r) for r in level["records"]]
        level["summary"] = summarize(records, workload.slo, wall_s=level["summary"]["wall_s"])
    return data


def _embed_levels(data: dict[str, Any]) -> None:
    """An embedding result's summaries recomputed from its records (each an ``embed`` call)."""
    EmbedWorkload(**data["metadata"]["workload"])  # a bad workload fails here, as a generate one's does
    for level in data["levels"]:
        records = [RequestRecord.from_dict(r) for r in level["records"]]
        level["summary"] = summarize_embed(records, int(level["value"]), wall_s=level["summary"]["wall_s"])


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in sorted(set(a) | set(b)):
            out += _diff(a.get(key), b.get(key), f"{path}.{key}" if path else key)
        return out
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


_IGNORED_FOR_MATCH = ("name", "price_per_hour")  # labels and prices do not change what was measured


def workload_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """How two results' workloads differ (their names and prices left out)."""
    wa = {k: v for k, v in a["metadata"]["workload"].items() if k not in _IGNORED_FOR_MATCH}
    wb = {k: v for k, v in b["metadata"]["workload"].items() if k not in _IGNORED_FOR_MATCH}
    return _diff(wa, wb)


_VERSIONED = (
    ("engine", ("engine", "version")),
    ("unillm", ("unillm_version",)),
    ("model weights", ("weights", "sha256")),
    ("python", ("hardware", "python")),
    ("platform", ("hardware", "platform")),
    ("CPU", ("hardware", "cpu_model")),
)


def _get(meta: dict[str, Any], keys: Sequence[str]) -> Any:
    value: Any = meta
    for k in keys:
        value = value.get(k) if isinstance(value, dict) else None
    return value


def version_changes(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Engine, driver, model, unillm or machine changes between two runs of the same engine (rule
    10: re-test after upgrades). Runs of different engines are compared as such, not flagged."""
    ma, mb = a["metadata"], b["metadata"]
    out = []
    same_engine = _get(ma, ("engine", "name")) == _get(mb, ("engine", "name"))
    for label, keys in _VERSIONED:
        if label == "engine" and not same_engine:
            continue
        if label == "model weights" and _get(ma, ("weights", "format")) != _get(mb, ("weights", "format")):
            continue  # each engine's own format of the same weights hashes differently
        va, vb = _get(ma, keys), _get(mb, keys)
        if va != vb:
            out.append(f"{label} changed: {va} -> {vb}")
    ga = [g.get("name") for g in _get(ma, ("hardware", "gpus")) or []]
    gb = [g.get("name") for g in _get(mb, ("hardware", "gpus")) or []]
    if ga != gb:
        out.append(f"GPUs changed: {ga} -> {gb}")
    ea = {e.get("name"): e.get("version") for e in _get(ma, ("hardware", "engines")) or []}
    eb = {e.get("name"): e.get("version") for e in _get(mb, ("hardware", "engines")) or []}
    if ea != eb:
        out.append(f"installed engine builds changed: {ea} -> {eb}")
    return out


def compare(results: Sequence[dict[str, Any]], *, force: bool = False) -> list[str]:
    """Check that ``results`` can stand side by side: raises ``WorkloadMismatch`` when their
    workloads differ (unless ``force``); returns the version changes to flag."""
    if len(results) < 2:
        raise BenchError("compare needs at least two results")
    first = results[0]
    notes: list[str] = []
    for other in results[1:]:
        diffs = workload_differences(first, other)
        if diffs and not force:
            raise WorkloadMismatch(diffs)
        if diffs:
            notes.append("workloads differ (forced): " + "; ".join(diffs))
        notes += version_changes(first, other)
    return notes
