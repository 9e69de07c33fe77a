"""What a benchmark sends requests to: an engine in this process, or an OpenAI-compatible URL.

``EngineTarget`` drives ``engine.astream`` (``astream_chat`` for chat), so a batching engine
batches the concurrent requests of a level; ``HttpTarget`` streams server-sent events from
``/v1/completions`` or ``/v1/chat/completions`` with httpx. Both fill a ``RequestRecord`` with the
arrival time of every chunk that carried tokens, and never raise for a failed request: the error's
type is recorded, so a run reports its errors by kind.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable
from time import perf_counter
from typing import TYPE_CHECKING, Any

from unillm.bench._metrics import RequestRecord
from unillm.bench._prompts import BenchRequest
from unillm.bench._workload import BenchWorkload

if TYPE_CHECKING:
    from unillm._contract._engine import Engine
    from unillm._types import KVStats

__all__ = ["STRUCTURED_SCHEMA", "EngineTarget", "HttpTarget", "Target"]

#: The schema a structured-output workload asks for: small, so the format's cost is what shows.
STRUCTURED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
    "required": ["answer", "confidence"],
}


_METRIC = re.compile(
    r"^(?:(?:vllm|unillm|sglang):(?P<name>kv_cache_usage_perc|prefix_cache_(?:queries|hits)(?:_total)?"
    r"|resident_memory_bytes)|(?P<process>process_resident_memory_bytes))"
    r"(?:\{[^}]*\})?\s+(?P<value>[-+0-9.eE]+|NaN)\s*$",
    re.MULTILINE,
)


def rss_bytes(pid: int | None = None) -> int | None:
    """The resident memory of process ``pid`` (default: this one) now, or None where it cannot be
    read."""
    pid = os.getpid() if pid is None else pid
    try:
        with open(f"/proc/{pid}/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except Exception:  # no psutil, or a platform it cannot read
        return None


class Target:
    """Base of the targets: ``send`` one request, fill its record."""

    kind: str = ""
    #: whether output lengths are enforced (``ignore_eos``) and how, said in every result
    output_enforcement: str = "none"

    async def send(self, req: BenchRequest, rec: RequestRecord, t0: float) -> None:
        raise NotImplementedError

    #: seconds between samples of the KV cache while a level runs
    sample_every_s: float = 0.1
    #: the process whose resident memory a level samples (its engine's; None: unknown, not sampled)
    process: int | None = os.getpid()
    #: how that memory is read (``unillm.bench._runner.rss_bytes``; a server's tree for ``--servers``)
    rss: Callable[[int], int | None] = staticmethod(rss_bytes)

    async def kv(self) -> dict[str, Any] | None:
        """The KV cache now, as ``KVStats``'s fields plus ``usage`` (0..1), None when unknown."""
        return None

    async def aclose(self) -> None:
        """Release what the target opened (not the engine: its caller owns it)."""


class EngineTarget(Target):
    """An engine loaded in this process, driven through its async API."""

    kind = "engine"

    def __init__(self, engine: Engine[Any], workload: BenchWorkload) -> None:
        self.engine = engine
        self.workload = workload
        self.ignore_eos = "ignore_eos" in engine.capabilities.sampling and not workload.structured
        self.output_enforcement = (
            "ignore_eos"
            if self.ignore_eos
            else "none: structured output ends where the format does"
            if workload.structured
            else f"none: {engine.name} has no ignore_eos; max_tokens bounds the output"
        )

    def _params(self, req: BenchRequest) -> dict[str, Any]:
        params: dict[str, Any] = {"max_tokens": req.output_tokens, "temperature": self.workload.temperature}
        if self.ignore_eos:
            params["ignore_eos"] = True
        if self.workload.structured:
            params["response_format"] = STRUCTURED_SCHEMA
        return params

    async def send(self, req: BenchRequest, rec: RequestRecord, t0: float) -> None:
        engine, wl = self.engine, self.workload
        params = self._params(req)
        rec.output_asked = req.output_tokens
        rec.streamed = wl.stream
        times, counts = rec.chunk_times, rec.chunk_tokens
        rec.send = perf_counter() - t0
        try:
            if wl.stream:
                stream = (
                    engine.astream_chat([{"role": "user", "content": req.prompt}], params)
                    if wl.mode == "chat"
                    else engine.astream(req.prompt, params)
                )
                last = None
                async for chunk in stream:
                    n = len(chunk.token_ids)
                    if n:
                        times.append(perf_counter() - t0)
                        counts.append(n)
                    last = chunk
                rec.end = perf_counter() - t0
                usage = last.usage if last is not None else None
                timings = last.timings if last is not None else None
            else:
                done = await (
                    engine.achat([{"role": "user", "content": req.prompt}], params)
                    if wl.mode == "chat"
                    else engine.agenerate(req.prompt, params)
                )
                rec.end = perf_counter() - t0
                usage, timings = done.usage, done.timings
            if usage is not None:
                rec.input_tokens = usage.prompt_tokens
                rec.output_tokens = usage.completion_tokens
                rec.cached_tokens = usage.cached_prompt_tokens
            else:
                rec.output_tokens = sum(counts)
            if timings is not None:
                rec.engine_peak_memory = timings.peak_memory_bytes
        except Exception as exc:  # recorded by kind; the level goes on
            rec.error, rec.error_message = type(exc).__name__, str(exc)[:300]

    async def kv(self) -> dict[str, Any] | None:
        try:
            kv: KVStats = self.engine.kv_stats()
        except Exception:  # an engine closing under the sampler
            return None
        return {**dataclasses.asdict(kv), "usage": kv.utilization}


class HttpTarget(Target):
    """An OpenAI-compatible server at ``url`` (its root or its ``/v1``), streamed with httpx."""

    kind = "http"

    def __init__(
        self,
        url: str,
        model: str,
        workload: BenchWorkload,
        *,
        api_key: str | None = None,
        count_tokens: Callable[[str], int] | None = None,
        keepalive: bool = True,
    ) -> None:
        import httpx

        #: counts a completion's tokens (the model's tokenizer) for a server that streams no usage
        self.count_tokens = count_tokens

        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.model = model
        self.workload = workload
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(600.0, connect=10.0),
            # keepalive=False: a connection per request, for servers that mishandle kept-alive ones
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None if keepalive else 0),
            headers=headers,
        )
        self._no_metrics = False
        self.sample_every_s = 0.5  # a scrape is a request the server serves too
        self.process = None  # the server's memory is not this process's: read from its /metrics
        self.output_enforcement = (
            "none: structured output ends where the format does"
            if workload.structured
            else "ignore_eos sent (servers that do not read it stop at EOS: see output_len_mismatches)"
        )

    def _body(self, req: BenchRequest) -> tuple[str, dict[str, Any]]:
        wl = self.workload
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": req.output_tokens,
            "temperature": wl.temperature,
            "stream": wl.stream,
        }
        if wl.stream:
            body["stream_options"] = {"include_usage": True}
        if wl.structured:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": STRUCTURED_SCHEMA},
            }
        else:
            body["ignore_eos"] = True
        if wl.mode == "chat":
            body["messages"] = [{"role": "user", "content": req.prompt}]
            return "/chat/completions", body
        body["prompt"] = req.prompt
        return "/completions", body

    async def send(self, req: BenchRequest, rec: RequestRecord, t0: float) -> None:
        path, body = self._body(req)
        rec.output_asked = req.output_tokens
        rec.input_tokens = req.input_tokens
        rec.streamed = self.workload.stream
        rec.send = perf_counter() - t0
        try:
            if self.workload.stream:
                await self._stream(path, body, rec, t0)
            else:
                resp = await self.client.post(self.base + path, json=body)
                rec.end = perf_counter() - t0
                if resp.status_code != 200:
                    rec.error, rec.error_message = f"HTTP {resp.status_code}", resp.text[:300]
                    return
                self._usage(resp.json().get("usage"), rec)
        except Exception as exc:  # connection refused, timeouts, bad JSON: recorded by kind
            rec.error, rec.error_message = type(exc).__name__, str(exc)[:300]

    async def _stream(self, path: str, body: dict[str, Any], rec: RequestRecord, t0: float) -> None:
        times, counts = rec.chunk_times, rec.chunk_tokens
        finish, ids, parts = None, 0, []
        async with self.client.stream("POST", self.base + path, json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}"
                rec.error_message = (await resp.aread()).decode("utf-8", "replace")[:300]
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                choices = event.get("choices") or []
                if choices:
                    c = choices[0]
                    text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if isinstance(c.get("token_ids"), list):  # vLLM's, when asked
                        ids += len(c["token_ids"])
                    finish = c.get("finish_reason") or finish
                    if text:
                        times.append(perf_counter() - t0)
                        counts.append(1)  # timing per chunk with text; the count is settled below
                        parts.append(text)
                if event.get("usage"):
                    self._usage(event["usage"], rec)
        rec.end = perf_counter() - t0
        if not rec.output_tokens:  # the server streamed no usage (llama-cpp-python's)
            rec.output_tokens = self._count(finish, ids, "".join(parts), counts, int(body["max_tokens"]))

    def _count(self, finish: str | None, ids: int, text: str, counts: list[int], asked: int) -> int:
        """A completion's tokens without the server's usage. A chunk is not a token: a server may
        stream a token that renders as nothing with empty text, and the tokens of one character
        as one chunk; so the ids it streamed, else ``max_tokens`` when it stopped for length,
        else the text through the model's tokenizer, and only failing all of them the chunks."""
        if ids:
            return ids
        if finish == "length":
            return asked
        if self.count_tokens is not None:
            return self.count_tokens(text)
        return sum(counts)

    @staticmethod
    def _usage(usage: dict[str, Any] | None, rec: RequestRecord) -> None:
        if not usage:
            return
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
        if usage.get("prompt_tokens"):
            rec.input_tokens = int(usage["prompt_tokens"])
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            rec.cached_tokens = int(details["cached_tokens"])

    async def kv(self) -> dict[str, Any] | None:
        """KV usage and prefix-cache counters from the server's Prometheus ``/metrics`` (vLLM's
        ``vllm:`` names, unillm serve's ``unillm:`` ones), summed over its engines; None when it
        has no such metrics (llama.cpp's servers)."""
        if self._no_metrics:
            return None
        try:
            resp = await self.client.get(self.base[: -len("/v1")] + "/metrics", timeout=5.0)
        except Exception:  # a server busy past the timeout: this sample is skipped
            return None
        if resp.status_code != 200:
            self._no_metrics = True
            return None
        found: dict[str, float] = {}
        for m in _METRIC.finditer(resp.text):
            key = (m["name"] or m["process"]).removesuffix("_total")
            found[key] = found.get(key, 0.0) + float(m["value"])
        if not found:
            self._no_metrics = True
            return None
        q, h = found.get("prefix_cache_queries"), found.get("prefix_cache_hits")
        # the server's memory: unillm serve's with its engine's processes, else the serving
        # process's own (Prometheus' process collector); unknown when it exports neither
        rss = found.get("resident_memory_bytes", found.get("process_resident_memory_bytes"))
        return {
            "usage": found.get("kv_cache_usage_perc"),
            "prefix_cache_queries": int(q) if q is not None else None,
            "prefix_cache_hits": int(h) if h is not None else None,
            "rss_bytes": int(rss) if rss is not None and not math.isnan(rss) else None,
        }

    async def models(self) -> list[str]:
        """The model ids the server lists (``/v1/models``), empty when it lists none."""
        resp = await self.client.get(self.base + "/models")
        if resp.status_code != 200:
            return []
        return [str(m.get("id")) for m in resp.json().get("data", []) if isinstance(m, dict)]

    async def aclose(self) -> None:
        await self.client.aclose()
