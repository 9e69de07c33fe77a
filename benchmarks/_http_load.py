"""A small closed-loop load generator for OpenAI-compatible servers, measured client-side.

``concurrency`` workers pull request numbers from one counter, so exactly ``concurrency`` requests
are in flight until the last ones drain. Each request streams (SSE) and records, on this process's
clock: when it was sent, when the first content arrived, when the stream ended, how many content
chunks came and the server's ``usage`` if it sent one. One ``httpx.AsyncClient`` with keep-alive
connections; chunks are parsed with ``json.loads`` and nothing else, so the client's own cost per
token is small and the same for every server.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True, slots=True)
class Record:
    """One streamed request, as the client saw it (perf_counter seconds)."""

    start: float
    first: float | None  # first chunk carrying generated text
    end: float
    chunks: int  # chunks carrying generated text
    usage_tokens: int | None  # usage.completion_tokens, when the server reported it
    finish: str | None
    text: str
    error: str | None = None

    def tokens(self, asked: int) -> tuple[int, str]:
        """Output tokens and how they are known: the server's usage if it sent one; else, on
        ``finish_reason == "length"``, the ``asked`` max_tokens (exact by that definition); else
        the content chunks counted (a lower bound: a server may merge tokens into one chunk)."""
        if self.usage_tokens is not None:
            return self.usage_tokens, "usage"
        if self.finish == "length":
            return asked, "finish=length"
        return self.chunks, "chunks"


async def _one(client: httpx.AsyncClient, path: str, body: dict[str, Any], chat: bool) -> Record:
    start = time.perf_counter()
    first: float | None = None
    chunks, usage, finish, parts = 0, None, None, []
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                return Record(
                    start, None, time.perf_counter(), 0, None, None, "", f"HTTP {resp.status_code}: {detail}"
                )
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("usage"):
                    usage = event["usage"].get("completion_tokens", usage)
                for choice in event.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece:
                        if first is None:
                            first = time.perf_counter()
                        chunks += 1
                        parts.append(piece)
                    finish = choice.get("finish_reason") or finish
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return Record(start, first, time.perf_counter(), chunks, usage, finish, "".join(parts), repr(exc))
    return Record(start, first, time.perf_counter(), chunks, usage, finish, "".join(parts))


async def run_load(
    base_url: str,
    body_for: Callable[[int], dict[str, Any]],
    n: int,
    concurrency: int,
    *,
    chat: bool = True,
    keepalive: bool = True,
) -> tuple[list[Record], float]:
    """Send requests ``0..n-1`` (bodies from ``body_for``), ``concurrency`` at a time; return the
    records in request order and the wall time from the first send to the last stream's end.
    ``keepalive=False`` opens a connection per request (for a server that mishandles reuse)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    limits = httpx.Limits(
        max_connections=concurrency, max_keepalive_connections=concurrency if keepalive else 0
    )
    timeout = httpx.Timeout(600.0, connect=10.0)
    records: list[Record | None] = [None] * n
    counter = iter(range(n))
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:

        async def worker() -> None:
            for i in counter:  # one shared iterator: every request is sent exactly once
                records[i] = await _one(client, path, body_for(i), chat)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
        wall = time.perf_counter() - t0
    return [r for r in records if r is not None], wall


def count(items: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1) of a non-empty list."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def summarize(records: list[Record], wall: float, asked: int) -> dict[str, Any]:
    """One run's figures: throughput over the run's wall time, latencies per request."""
    ok = [r for r in records if r.error is None and r.first is not None]
    counted = [r.tokens(asked) for r in ok]
    tokens = [n for n, _ in counted]
    ttft = [r.first - r.start for r in ok if r.first is not None]
    # Time per output token after the first (TPOT as vLLM and guidellm's ITL define it).
    tpot = [
        (r.end - r.first) / (n - 1) for r, n in zip(ok, tokens, strict=True) if r.first is not None and n > 1
    ]
    return {
        "requests": len(records),
        "errors": [r.error for r in records if r.error is not None],
        "empty": sum(1 for r in records if r.error is None and r.first is None),
        "wall_s": wall,
        "output_tokens": sum(tokens),
        "output_tokens_min": min(tokens, default=0),
        "output_tokens_max": max(tokens, default=0),
        "token_source": count(src for _, src in counted),
        "chunks_vs_usage_mismatch": sum(
            1 for r in ok if r.usage_tokens is not None and r.usage_tokens != r.chunks
        ),
        "finish": count(str(r.finish) for r in ok),
        "output_tok_s": sum(tokens) / wall,
        "requests_s": len(ok) / wall,
        "ttft_s": ttft,
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "ttft_p99_s": percentile(ttft, 0.99) if ttft else None,
        "tpot_p50_s": statistics.median(tpot) if tpot else None,
    }
