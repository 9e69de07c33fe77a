"""The metrics, defined once (docs/benchmarks.md sets them beside vLLM's, guidellm's and aiperf's).

Per request, from the times the harness saw (``perf_counter``, seconds):

- **TTFT** = first token's arrival - send;
- **E2E** = last chunk's arrival - send;
- **TPOT** = (E2E - TTFT) / (output tokens - 1): the first token excluded, as vLLM's ``bench serve``
  defines it; undefined (None) for a one-token output;
- **ITL** = every gap between successive chunks that carried tokens (a chunk of several tokens is
  one gap, as vLLM counts them).

Per level: requests/s and output tok/s over the level's wall time (first send to last end);
``prefill_tokens_per_s`` = sum of input tokens / sum of TTFT (how fast a request's prompt is read,
waiting included); ``decode_tokens_per_s`` = sum of (output - 1) / sum of (E2E - TTFT) (how fast
one sequence decodes); percentiles by linear interpolation between order statistics (numpy's
default, which vLLM uses); goodput = requests that succeeded and met every SLO bound given.

An embedding level (``summarize_embed``: one ``engine.embed`` call of ``batch_size`` texts per
record, not streamed) has texts/s and tokens/s over its wall time and the percentiles of a call's
latency (its E2E).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from unillm.bench._workload import SLO

__all__ = ["PERCENTILES", "RequestRecord", "Stats", "percentile", "stats", "summarize", "summarize_embed"]

PERCENTILES = (50, 90, 95, 99)


@dataclass(slots=True)
class RequestRecord:
    """What one request did, as the harness saw it. Times are seconds since the level began."""

    index: int
    send: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens each of those chunks carried
    end: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    output_asked: int = 0
    cached_tokens: int | None = None
    engine_peak_memory: int | None = None
    error: str | None = None  # the exception's type name
    error_message: str | None = None
    streamed: bool = True

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def ttft(self) -> float | None:
        if not self.ok or not self.streamed or not self.chunk_times:
            return None
        return self.chunk_times[0] - self.send

    @property
    def e2e(self) -> float | None:
        return None if not self.ok or self.end is None else self.end - self.send

    @property
    def tpot(self) -> float | None:
        ttft, e2e = self.ttft, self.e2e
        if ttft is None or e2e is None or self.output_tokens < 2:
            return None
        return (e2e - ttft) / (self.output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [t[i] - t[i - 1] for i in range(1, len(t))] if self.ok and self.streamed else []

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**{k: v for k, v in data.items() if k in cls.__slots__})  # type: ignore[attr-defined]


def percentile(values: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile of ``values`` by linear interpolation (numpy's default); None if empty."""
    if not values:
        return None
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


@dataclass(frozen=True)
class Stats:
    """Mean and percentiles of one latency, in seconds (None when nothing was measured)."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p95: float | None
    p99: float | None
    min: float | None
    max: float | None


def stats(values: Iterable[float]) -> Stats:
    """``Stats`` of ``values``."""
    xs = list(values)
    if not xs:
        return Stats(0, None, None, None, None, None, None, None)
    pct = {p: percentile(xs, p) for p in PERCENTILES}
    return Stats(len(xs), sum(xs) / len(xs), pct[50], pct[90], pct[95], pct[99], min(xs), max(xs))


def _meets(r: RequestRecord, slo: SLO) -> bool:
    if not r.ok:
        return False
    checks = ((slo.ttft_ms, r.ttft), (slo.tpot_ms, r.tpot), (slo.e2e_ms, r.e2e))
    for bound, value in checks:
        if bound is None:
            continue
        if value is None:
            # a bound on TPOT cannot fail a one-token output; a TTFT bound fails unmeasured
            if bound is slo.tpot_ms and r.output_tokens < 2:
                continue
            return False
        if value * 1000.0 > bound:
            return False
    return True


def summarize(records: Sequence[RequestRecord], slo: SLO, *, wall_s: float | None = None) -> dict[str, Any]:
    """The level's figures from its records (see the module docstring for each definition)."""
    done = [r for r in records if r.ok]
    if wall_s is None:
        wall_s = _wall_s(records)
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.input_tokens for r in done)
    ttfts = [x for r in done if (x := r.ttft) is not None]
    decode_time = sum(
        (r.e2e or 0.0) - (r.ttft or 0.0) for r in done if r.ttft is not None and r.output_tokens > 1
    )
    decode_tokens = sum(r.output_tokens - 1 for r in done if r.ttft is not None and r.output_tokens > 1)
    good = sum(1 for r in records if _meets(r, slo))
    per_s = (lambda n: n / wall_s) if wall_s > 0 else (lambda n: None)
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    peaks = [r.engine_peak_memory for r in done if r.engine_peak_memory is not None]
    return {
        "requests": len(records),
        "completed": len(done),
        "errors": dict(Counter(r.error for r in records if r.error is not None)),
        "wall_s": wall_s,
        "requests_per_s": per_s(len(done)),
        "output_tokens": out_tokens,
        "input_tokens": in_tokens,
        "output_tokens_per_s": per_s(out_tokens),
        "input_tokens_per_s": per_s(in_tokens),
        "prefill_tokens_per_s": (sum(r.input_tokens for r in done if r.ttft is not None) / sum(ttfts))
        if ttfts and sum(ttfts) > 0
        else None,
        "decode_tokens_per_s": decode_tokens / decode_time if decode_time > 0 else None,
        "ttft": stats(ttfts).__dict__,
        "tpot": stats(x for r in done if (x := r.tpot) is not None).__dict__,
        "itl": stats(x for r in done for x in r.itl).__dict__,
        "e2e": stats(x for r in done if (x := r.e2e) is not None).__dict__,
        "goodput": {
            "slo": slo.model_dump(),
            "good": good,
            "share": good / len(records) if records else None,
            "requests_per_s": per_s(good),
        },
        "output_len_mismatches": sum(1 for r in done if r.output_asked and r.output_tokens != r.output_asked),
        "cached_prompt_tokens": sum(cached) if cached else None,
        "engine_peak_memory_bytes": max(peaks) if peaks else None,
    }


def _wall_s(records: Sequence[RequestRecord]) -> float:
    """First send to last end of the requests that ended (0 when none did)."""
    ends = [r.end for r in records if r.ok and r.end is not None]
    return (max(ends) - min(r.send for r in records)) if ends else 0.0


def summarize_embed(
    records: Sequence[RequestRecord], batch_size: int, *, wall_s: float | None = None
) -> dict[str, Any]:
    """An embedding level's figures: each record one call of ``batch_size`` texts."""
    done = [r for r in records if r.ok]
    if wall_s is None:
        wall_s = _wall_s(records)
    texts = batch_size * len(done)
    tokens = sum(r.input_tokens for r in done)
    per_s = (lambda n: n / wall_s) if wall_s > 0 else (lambda n: None)
    latency = [x for r in done if (x := r.e2e) is not None]
    return {
        "calls": len(records),
        "completed": len(done),
        "errors": dict(Counter(r.error for r in records if r.error is not None)),
        "wall_s": wall_s,
        "batch_size": batch_size,
        "texts": texts,
        "input_tokens": tokens,
        "calls_per_s": per_s(len(done)),
        "texts_per_s": per_s(texts),
        "tokens_per_s": per_s(tokens),
        "latency": stats(latency).__dict__,
        "latency_per_text": stats(x / batch_size for x in latency).__dict__,
    }
