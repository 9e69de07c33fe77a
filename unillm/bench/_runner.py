"""Running a workload's levels against a target, and nothing else: timing and bookkeeping.

Each level (a concurrency, or a request rate) runs its warm-up requests, then its measured ones:
closed loop (``concurrency`` clients, each sending its next request as its last one ends) or open
loop (requests sent at arrival times drawn from the seed, Poisson or gamma, at most
``max_concurrency`` in flight when set). A sampler beside it reads the process's RSS and the
engine's ``kv_stats`` (a server's ``/metrics``) several times a second. What was measured stays
in ``Bench.levels`` and ``Bench.current`` as it happens, so an interrupted run can still be
written, marked partial.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from unillm.bench._metrics import RequestRecord, summarize
from unillm.bench._prompts import Prompts
from unillm.bench._targets import Target, rss_bytes
from unillm.bench._workload import BenchWorkload

__all__ = ["Bench", "Level", "arrival_times", "rss_bytes"]

_WARMUP_BASE = 1_000_000  # warm-up requests take indices of their own, not the measured ones'

Progress = Callable[[str, int, int | None], None]  # (level label, done, total or None)


def arrival_times(n: int, rate: float, *, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of ``n`` requests arriving at ``rate`` per second: gaps
    drawn from a gamma distribution of shape ``burstiness`` and mean ``1/rate`` (shape 1 is a
    Poisson process), the first request at 0."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


@dataclass
class Level:
    """One level's records and what the sampler saw while it ran."""

    kind: str  # "concurrency" or "rate"
    value: float
    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float | None = None
    peak_rss_bytes: int | None = None
    peak_in_flight: int = 0
    kv_before: dict[str, Any] | None = None
    kv_after: dict[str, Any] | None = None
    kv_peak_used_tokens: int | None = None
    kv_peak_usage: float | None = None  # 0..1, as sampled
    partial: bool = False
    started: float | None = None  # wall clock (time.time()) when its measured requests began
    done: int = 0  # requests ended

    def __repr__(self) -> str:  # short: asyncio may repr a task's result, and records run long
        return f"<Level {self.label}: {len(self.records)} requests{' (partial)' if self.partial else ''}>"

    def summary(self, workload: BenchWorkload) -> dict[str, Any]:
        return summarize(self.records, workload.slo, wall_s=self.wall_s)

    @property
    def label(self) -> str:
        return f"c={int(self.value)}" if self.kind == "concurrency" else f"{self.value:g} req/s"


class Bench:
    """One benchmark of ``target`` under ``workload``: ``await bench.run()`` runs every level."""

    def __init__(
        self, target: Target, workload: BenchWorkload, prompts: Prompts, *, progress: Progress | None = None
    ) -> None:
        self.target = target
        self.workload = workload
        self.prompts = prompts
        self.progress = progress
        self.levels: list[Level] = []
        self.current: Level | None = None
        self._in_flight = 0

    async def run(self) -> list[Level]:
        """Every level in turn; returns them (also kept in ``levels``)."""
        for kind, value in self.workload.levels():
            await self.run_level(kind, value)
        return self.levels

    async def run_level(self, kind: str, value: float) -> Level:
        """One level: its warm-up, then its measured requests (appended to ``levels``)."""
        await self._warmup(kind, value)
        level = Level(kind, value)
        self.current = level
        await self._measure(level)
        self.levels.append(level)
        self.current = None
        return level

    def interrupted(self) -> list[Level]:
        """The levels measured so far, the one in progress marked partial (its unfinished
        requests left out): what an interrupted run writes."""
        out = list(self.levels)
        if self.current is not None:
            level = self.current
            level.records = [r for r in level.records if r.end is not None]
            level.partial = True
            out.append(level)
        return out

    async def _one(self, i: int, level: Level, t0: float) -> None:
        rec = RequestRecord(i)
        level.records.append(rec)
        self._in_flight += 1
        level.peak_in_flight = max(level.peak_in_flight, self._in_flight)
        try:
            await self.target.send(self.prompts.get(i), rec, t0)
        finally:
            self._in_flight -= 1
        if rec.end is None and rec.error is None:
            rec.end = perf_counter() - t0
        level.done += 1
        if self.progress is not None and level is self.current:  # warm-ups are not shown
            self.progress(level.label, level.done, self.workload.requests)

    async def _warmup(self, kind: str, value: float) -> None:
        n = self.workload.warmup
        if not n:
            return
        scratch = Level(kind, value)
        width = int(value) if kind == "concurrency" else 1
        t0 = perf_counter()
        for start in range(0, n, max(1, width)):
            batch = range(_WARMUP_BASE + start, _WARMUP_BASE + min(n, start + width))
            await asyncio.gather(*(self._one(i, scratch, t0) for i in batch))

    async def _measure(self, level: Level) -> None:
        level.kv_before = await self.target.kv()
        level.started = time.time()
        sampler = asyncio.create_task(self._sample(level))
        t0 = perf_counter()
        try:
            if level.kind == "concurrency":
                await self._closed(level, int(level.value), t0)
            else:
                await self._open(level, level.value, t0)
        finally:
            level.wall_s = _wall(level, perf_counter() - t0)
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            level.kv_after = await self.target.kv()

    async def _closed(self, level: Level, concurrency: int, t0: float) -> None:
        wl = self.workload
        counter = iter(range(wl.requests if wl.requests is not None else 1 << 62))

        async def client() -> None:
            for i in counter:
                if wl.duration_s is not None and perf_counter() - t0 >= wl.duration_s:
                    return
                await self._one(i, level, t0)

        await asyncio.gather(*(client() for _ in range(concurrency)))

    async def _open(self, level: Level, rate: float, t0: float) -> None:
        wl = self.workload
        n = wl.requests if wl.requests is not None else int(rate * (wl.duration_s or 0)) + 1
        times = arrival_times(n, rate, burstiness=wl.arrival.burstiness, seed=wl.seed)
        cap = asyncio.Semaphore(wl.max_concurrency) if wl.max_concurrency else None
        tasks = []

        async def capped(i: int) -> None:
            if cap is None:
                await self._one(i, level, t0)
                return
            async with cap:
                await self._one(i, level, t0)

        for i, at in enumerate(times):
            delay = at - (perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if wl.duration_s is not None and perf_counter() - t0 >= wl.duration_s:
                break
            tasks.append(asyncio.create_task(capped(i)))
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    async def _sample(self, level: Level) -> None:
        while True:
            target = self.target
            rss = None if target.process is None else target.rss(target.process)
            if rss is not None:
                level.peak_rss_bytes = max(level.peak_rss_bytes or 0, rss)
            kv = await self.target.kv()
            if kv is not None and target.process is None and kv.get("rss_bytes"):  # a server's own
                level.peak_rss_bytes = max(level.peak_rss_bytes or 0, kv["rss_bytes"])
            if kv is not None:
                used, usage = kv.get("used_tokens"), kv.get("usage")
                if used is not None:
                    level.kv_peak_used_tokens = max(level.kv_peak_used_tokens or 0, used)
                if usage is not None:
                    level.kv_peak_usage = max(level.kv_peak_usage or 0.0, usage)
            await asyncio.sleep(self.target.sample_every_s)


def _wall(level: Level, elapsed: float) -> float:
    """The level's wall time: first send to last end of its requests (elapsed if none ended)."""
    ends = [r.end for r in level.records if r.end is not None]
    if not ends or not level.records:
        return elapsed
    return max(ends) - min(r.send for r in level.records)
