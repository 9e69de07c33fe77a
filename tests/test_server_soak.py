"""A soak of ``unillm serve``: 64 streaming clients, 500 requests, some cut short.

On llama.cpp (one sequence at a time, so up to 63 requests queue behind it) and on MLX batching
eight. The tiny model generates thousands of tokens a second, so the run is the server's own
work: admission, the SSE path, cancellation of the requests whose client hangs up after a few
chunks, and memory. Every request the client did not cut must come back whole: the text an
in-process engine generates for it (llama.cpp with the same options; MLX one sequence at a time,
so the batched path is checked against the single one), its usage and finish reason, then
``[DONE]``; on llama.cpp also one logprob entry per generated token, so ``usage.completion_tokens``
is checked against what was streamed. Or a deliberate 429/503; never a 500. On llama.cpp the
server's RSS after the run must be within 5 % of its RSS after a warm-up as wide as the run (MLX's
own warm-up outlasts the run: see BACKENDS). Bounded: the whole run has a deadline.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from unillm.testing import TinyModel

from ._soak_util import Served, metric, serve
from .conftest import HAS_LLAMA_CPP

pytestmark = pytest.mark.slow

CLIENTS = 64
REQUESTS = 500
# The warm-up reaches the run's peak, all clients in flight at once: after 50 requests (50 in
# flight at most) the first 64-wide burst's buffers still counted as growth (+3.5 to +4.6 % by
# request 500, measured), after 64 it was +2.0 %, after 128 +1.0 %, then flattening.
WARMUP = CLIENTS
CUT_SHARE = 0.10
CONTEXT = 512
RSS_GROWTH = 0.05  # at most this share of the warmed-up RSS
# A guard against a hang, not a speed limit: the warm-up and the run take about a minute here.
DEADLINE_S = 600


@dataclass(frozen=True)
class Backend:
    """A backend to soak: the server's engine options, and whether to count tokens by logprobs."""

    name: str
    options: dict[str, Any]
    logprobs: bool
    rss_growth: float | None  # the most the server's RSS may grow over the run; None: not bounded

    def reference(self, tiny: TinyModel) -> Any:
        """The in-process engine whose answers the server's must equal."""
        if self.name == "llama.cpp":
            from unillm.engines.llamacpp import LlamaCppEngine

            one = {k: v for k, v in self.options.items() if k != "parallel"}  # the one-sequence path
            return LlamaCppEngine(model=str(tiny.gguf_path), context_length=CONTEXT, options=one)
        from unillm.engines.mlx import MLXEngine

        return MLXEngine(model=str(tiny.hf_dir), context_length=CONTEXT, options={"batch_size": 1})


BACKENDS = [
    # One llama.cpp thread: with two on two cores, beside the server's event loop and any other
    # load, ggml's threads spin at their barriers and a request takes 10-100x longer (measured).
    pytest.param(
        Backend(
            "llama.cpp", {"n_threads": 1, "seed": 1234, "parallel": 1}, logprobs=True, rss_growth=RSS_GROWTH
        ),
        id="llama.cpp",
        marks=pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed"),
    ),
    # llama.cpp as unillm serve runs it by default: 8 sequences batched. Its RSS grows in steps
    # while prefill steps of new sizes come (+5.1 % between request 128 and 628 of this soak), then
    # flattens: 104.6 MiB after 250 requests, 105.4 after 2,500 (served, 64 clients, measured). A
    # warm-up that long would make the soak several times longer, so this run checks the answers
    # and prints its RSS; the one-at-a-time run above bounds the server's own memory.
    pytest.param(
        Backend("llama.cpp", {"n_threads": 1, "seed": 1234, "parallel": 8}, logprobs=True, rss_growth=None),
        id="llama.cpp-batched",
        marks=pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed"),
    ),
    # No logprobs on MLX: its batched engine grows ~30 KiB a request when they are asked for, in
    # process as much as served (measured: 543 to 637 MiB over 3,250 requests). Without them MLX
    # still warms up for ~1,500 requests, in process too (+9 to +12 %), then stays flat (served:
    # 472 MiB after the warm-up, 558 at request 1,500, 528 from 2,500 to 4,000): a warm-up that long
    # would triple the soak, so MLX's run checks the answers and only prints its RSS; llama.cpp's
    # run bounds the server's own memory.
    pytest.param(
        Backend("mlx", {"batch_size": 8}, logprobs=False, rss_growth=None), id="mlx-batched",
        marks=pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="needs mlx-lm"),
    ),
]  # fmt: skip
# A stream once sent no logprob for a last token that adds no text (it completes a stop string,
# or is a byte left incomplete); test_server_engines.py holds the fix, the soak counts them all.
LAST_LOGPROB_DROPPED = False
_TEXT = (
    "the engine loads weights turns text into tokens runs the forward pass samples next token "
    "cache grows with context and users paged attention splits blocks quantization stores fewer bits "
    "bonjour comment ça va 你好 世界 🙂 0 1 2 3 5 8 13 def fibonacci(n): return SELECT * FROM users"
)
WORDS = _TEXT.split()


@dataclass(frozen=True)
class Job:
    """One request: which route, what prompt, how many tokens, and whether the client cuts it."""

    chat: bool
    prompt: str
    max_tokens: int
    ignore_eos: bool
    cut_after: int | None  # chunks the client reads before it hangs up; None reads to the end

    def body(self, logprobs: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": "tiny", "max_tokens": self.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": self.ignore_eos,
        }  # fmt: skip
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if logprobs:  # one entry per generated token: a count of what was streamed
            body["logprobs"] = True if self.chat else 0
        return body


@dataclass
class Outcome:
    """What the client saw of one request."""

    job: Job
    status: int = 0
    text: str = ""
    tokens: int = 0  # logprob entries received: tokens streamed
    chunks: int = 0
    finish: str | None = None
    usage: dict[str, Any] | None = None
    done: bool = False  # [DONE] came
    cut: bool = False
    error: str | None = None
    events_after_finish: int = field(default=0)


def jobs(n: int, rng: random.Random) -> list[Job]:
    """``n`` requests of mixed lengths: prompts of 1 to 130 words (up to ~400 tokens), 1 to 64 new tokens."""
    out = []
    for _ in range(n):
        words = rng.choice([1, 2, 5, 10, 30, 60, 100, 130])
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, words)))
        cut = rng.randint(1, 3) if rng.random() < CUT_SHARE else None
        max_tokens = rng.randint(8 if cut else 1, 64)  # a cut one has chunks left to cut
        out.append(Job(rng.random() < 0.5, prompt, max_tokens, rng.random() < 0.5, cut))
    return out


async def one(client: httpx.AsyncClient, job: Job, logprobs: bool) -> Outcome:
    seen = Outcome(job)
    path = "/v1/chat/completions" if job.chat else "/v1/completions"
    try:
        async with client.stream("POST", path, json=job.body(logprobs)) as resp:
            seen.status = resp.status_code
            if resp.status_code != 200:
                seen.error = (await resp.aread()).decode(errors="replace")[:300]
                return seen
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    seen.done = True
                    break
                _take(seen, json.loads(data))
                if job.cut_after is not None and seen.chunks >= job.cut_after and seen.finish is None:
                    seen.cut = True  # leaving the block closes the connection mid-stream
                    break
    except httpx.HTTPError as exc:
        seen.error = f"{type(exc).__name__}: {exc}"
    return seen


def _take(seen: Outcome, event: dict[str, Any]) -> None:
    if "error" in event:
        seen.error = json.dumps(event)[:300]
        return
    if not event["choices"]:
        seen.usage = event["usage"]
        return
    choice = event["choices"][0]
    if seen.finish is not None:
        seen.events_after_finish += 1
    seen.chunks += 1
    if "delta" in choice:
        seen.text += choice["delta"].get("content") or ""
        lp = choice["logprobs"]
        seen.tokens += len(lp["content"]) if lp else 0
    else:
        seen.text += choice["text"]
        lp = choice["logprobs"]
        seen.tokens += len(lp["tokens"]) if lp else 0
    seen.finish = choice["finish_reason"] or seen.finish


async def drive(served: Served, work: list[Job], clients: int, logprobs: bool) -> list[Outcome]:
    """``clients`` workers, each sending its next job as soon as the last one ended."""
    queue: asyncio.Queue[Job] = asyncio.Queue()
    for job in work:
        queue.put_nowait(job)
    results: list[Outcome] = []
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=served.url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                results.append(await one(client, queue.get_nowait(), logprobs))

        await asyncio.gather(*(worker() for _ in range(clients)))
    return results


@dataclass(frozen=True)
class Expected:
    """The in-process engine's answer to a job."""

    text: str
    finish: str  # as the OpenAI API says it: stop or length
    prompt_tokens: int
    completion_tokens: int
    silent_last: bool  # the last chunk carries a token but no text


def _expected(engine: Any, job: Job) -> Expected:
    prompt = engine.render_chat([{"role": "user", "content": job.prompt}]) if job.chat else job.prompt
    chunks = list(
        engine.stream(prompt, temperature=0.0, max_tokens=job.max_tokens, ignore_eos=job.ignore_eos)
    )
    last = chunks[-1]
    assert last.usage is not None
    return Expected(
        "".join(c.text for c in chunks), "length" if last.finish_reason == "length" else "stop",
        last.usage.prompt_tokens, last.usage.completion_tokens, bool(last.token_ids) and not last.text,
    )  # fmt: skip


def _problems(outcomes: list[Outcome], refs: dict[Job, Expected], logprobs: bool) -> list[str]:
    """Every way an outcome falls short of a whole answer or a deliberate refusal."""
    bad = []
    for o in outcomes:
        j = o.job
        where = f"{'chat' if j.chat else 'completion'} max_tokens={j.max_tokens} ignore_eos={j.ignore_eos}"
        if o.status in (429, 503):
            continue
        if o.status != 200:
            bad.append(f"{where}: HTTP {o.status}: {o.error}")
            continue
        if o.error is not None:
            bad.append(f"{where}: error event {o.error}")
            continue
        if o.cut:
            continue
        ref = refs[j]
        # the known bug: the stream leaves out the last token's logprob when it adds no text
        streamed = ref.completion_tokens - (LAST_LOGPROB_DROPPED and ref.silent_last)
        checks = {
            "[DONE]": o.done,
            "finish_reason": o.finish == ref.finish,
            "usage": o.usage is not None and o.usage["completion_tokens"] == ref.completion_tokens,
            "prompt_tokens": o.usage is not None and o.usage["prompt_tokens"] == ref.prompt_tokens,
            "a logprob per token streamed": not logprobs or o.tokens == streamed,
            "ignore_eos runs to max_tokens": not j.ignore_eos or ref.completion_tokens == j.max_tokens,
            "text": o.text == ref.text,
            "nothing after the finish": o.events_after_finish == 0,
        }
        failed = [name for name, ok in checks.items() if not ok]
        if failed:
            got = {"finish": o.finish, "usage": o.usage, "tokens": o.tokens, "text": o.text[-40:]}
            want = {
                "finish": ref.finish,
                "tokens": ref.completion_tokens,
                "streamed": streamed,
                "text": ref.text[-40:],
            }
            bad.append(f"{where}: {failed}; got {got}, want {want}")
    return bad


def _settled(served: Served, timeout_s: float = 30) -> dict[str, float]:
    """``/metrics`` once no request is running or waiting: a request whose client hung up last
    ends when the server next writes to the closed connection."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = served.metrics()
        idle = metric(samples, "unillm:num_requests_running") + metric(samples, "unillm:num_requests_waiting")
        if idle == 0 or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)  # polling, bounded by the deadline


@pytest.mark.parametrize("backend", BACKENDS)
def test_soak_64_streaming_clients_500_requests(backend: Backend, tiny: TinyModel, tmp_path: Path) -> None:
    rng = random.Random(20261201)
    warmup, work = jobs(WARMUP, rng), jobs(REQUESTS, rng)
    t0 = time.perf_counter()
    with backend.reference(tiny) as engine:
        refs = {j: _expected(engine, j) for j in [*warmup, *work] if j.cut_after is None}
    ref_s = time.perf_counter() - t0
    model = tiny.gguf_path if backend.name == "llama.cpp" else tiny.hf_dir
    args = ["--backend", backend.name, "--context", str(CONTEXT), "--max-queue", str(CLIENTS), "--grace", "5"]
    for key, value in backend.options.items():
        args += ["--option", f"{key}={value}"]
    lp = backend.logprobs
    with serve(model, *args, log=tmp_path / "serve.log") as served:
        rss_start = served.rss_kib()
        started = time.perf_counter()

        async def run() -> tuple[list[Outcome], int, list[Outcome], float]:
            first = await drive(served, warmup, CLIENTS, lp)
            warm = served.rss_kib()
            t = time.perf_counter()
            rest = await drive(served, work, CLIENTS, lp)
            return first, warm, rest, time.perf_counter() - t

        try:
            warm_out, rss_warm, outcomes, wall = asyncio.run(asyncio.wait_for(run(), DEADLINE_S))
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
            pytest.fail(f"the soak did not end within {DEADLINE_S} s; the server's log:\n{served.log_tail()}")
        rss_after = served.rss_kib()
        after = _settled(served)
        log = served.log.read_text(errors="replace")
    total_s = time.perf_counter() - started

    statuses = Counter(o.status for o in outcomes)
    cut = sum(o.cut for o in outcomes)
    whole = [o for o in outcomes if o.status == 200 and not o.cut and o.error is None]
    ok = len(whole)
    silent = sum(refs[o.job].silent_last for o in whole) if lp else 0
    tokens = sum(o.usage["completion_tokens"] for o in outcomes if o.usage)
    growth = (rss_after - rss_warm) / rss_warm
    aborted = metric(after, "unillm:request_success_total", finished_reason="abort")
    logprob = "missing: the known bug" if LAST_LOGPROB_DROPPED else "there"
    silent_note = f"{silent} whole streams end on a token without text (its logprob {logprob}); "
    figures = (
        f"{backend.name}: {len(outcomes)} requests from {CLIENTS} clients in {wall:.1f} s ({tokens} tokens "
        f"in the whole answers, {tokens / wall:.0f}/s): {ok} whole, {statuses[429]} x 429, "
        f"{statuses[503]} x 503, {cut} cut by the client ({aborted:g} aborted per the server, warm-up "
        f"included), statuses {dict(statuses)}; {silent_note if lp else ''}"
        f"RSS {rss_start / 1024:.1f} MiB at start, {rss_warm / 1024:.1f} MiB after {WARMUP} warm-up "
        f"requests, {rss_after / 1024:.1f} MiB after (growth {growth:+.2%}); "
        f"references {ref_s:.1f} s, server up {total_s:.1f} s"
    )
    print(figures)

    problems = _problems([*warm_out, *outcomes], refs, lp)
    assert not problems, f"{len(problems)} bad answers ({figures}):\n" + "\n".join(problems[:20])
    assert statuses[500] == 0 and set(statuses) <= {200, 429, 503}, figures
    assert ok + cut + statuses[429] + statuses[503] == REQUESTS, figures
    assert ok >= REQUESTS * 0.8, figures  # the queue fits every client: refusals are rare
    assert cut >= REQUESTS * CUT_SHARE * 0.5, figures  # the cuts did happen mid-stream
    # nothing leaked: no request still counted, every cut one ended as an abort or a finish
    assert metric(after, "unillm:num_requests_running") == 0, figures
    assert metric(after, "unillm:num_requests_waiting") == 0, figures
    assert metric(after, "unillm:request_success_total", finished_reason="error") == 0, figures
    finished = metric(after, "unillm:request_success_total")
    assert finished == len(warm_out) + len(outcomes) - statuses[429] - statuses[503], figures
    assert "Traceback" not in log, log[-4000:]
    if backend.rss_growth is not None:
        assert growth <= backend.rss_growth, figures
