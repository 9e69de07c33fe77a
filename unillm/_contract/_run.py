"""One request's accounting and the folds over its chunks, shared by ``Engine``'s drivers.

``_Run`` sits between a backend's raw pieces and the user's chunks (stop strings, the max-token
cut, the final chunk's usage and timings); ``fold``/``afold`` turn a stream into a
``Completion``; ``iterate_in_thread`` bridges a sync stream to an event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator
from time import perf_counter
from typing import Any

from unillm._contract._stop import StopMatcher
from unillm._errors import GenerationError
from unillm._types import Chunk, Completion, FinishReason, SamplingParams, Timings, Usage

__all__ = ["RawPiece", "Request", "RequestState", "Run", "TopLogprobs", "afold", "fold", "iterate_in_thread"]

TopK = tuple[tuple[int, float], ...]


class TopLogprobs:
    """A piece's logprobs with the alternatives: ``chosen`` (one per token id, as the plain tuple
    would be) and ``top``, per token the ``k`` most likely ``(token_id, logprob)`` pairs, most
    likely first, ties by the lower id. A backend yields it in place of the plain tuple when the
    request asked for ``logprobs`` above 0."""

    __slots__ = ("chosen", "top")

    def __init__(self, chosen: tuple[float, ...], top: tuple[TopK, ...]) -> None:
        self.chosen = chosen
        self.top = top

    def __repr__(self) -> str:
        return f"TopLogprobs({self.chosen!r}, {self.top!r})"


#: What a backend's ``_stream`` yields per step: text delta, token ids, and None, the chosen
#: tokens' logprobs, or ``TopLogprobs`` (those and the alternatives).
RawPiece = tuple[str, tuple[int, ...], "tuple[float, ...] | TopLogprobs | None"]
LP = tuple[float, ...] | TopLogprobs | None


def _split(lp: LP) -> tuple[tuple[float, ...] | None, tuple[TopK, ...] | None]:
    if type(lp) is TopLogprobs:
        return lp.chosen, lp.top
    return lp, None  # type: ignore[return-value]


class RequestState:
    """Per-request bookkeeping a backend's ``_stream`` fills in as it learns things.

    ``prompt_tokens`` must be set; the rest are optional. ``prefill_s``/``decode_s`` come from the
    engine's own counters when it has them (otherwise unillm's wall clock is used).
    ``completion_tokens`` is for a backend that knows the count better than the ids it streamed
    (a server that streams text only); left None, the ids streamed are counted.
    ``stop_sequence`` is for a backend whose engine matched a stop string itself (and so never
    streamed it): the string it names.
    """

    __slots__ = (
        "accepted_draft_tokens",
        "cached_tokens",
        "completion_tokens",
        "decode_s",
        "draft_tokens",
        "finish_reason",
        "peak_memory_bytes",
        "prefill_s",
        "prompt_tokens",
        "queue_s",
        "stop_sequence",
    )

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.cached_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.finish_reason: FinishReason | None = None
        self.prefill_s: float | None = None
        self.decode_s: float | None = None
        self.peak_memory_bytes: int | None = None
        self.queue_s: float | None = None
        self.stop_sequence: str | None = None
        self.draft_tokens: int | None = None  # speculative decoding, where the engine counts them
        self.accepted_draft_tokens: int | None = None


#: The name ``RequestState`` had before: kept, as plugins written against it import it.
Request = RequestState


class Run:
    """One request's accounting between the backend's raw pieces and the user's chunks: stop
    strings, the max-token cut, the final chunk's usage and timings. Shared by both drivers."""

    __slots__ = ("finish", "first", "max_tokens", "n", "stops", "tail")

    def __init__(self, params: SamplingParams) -> None:
        self.first = 0.0
        self.n = 0
        self.max_tokens = params.max_tokens
        self.stops = StopMatcher(params.stop) if params.stop else None
        self.finish: FinishReason | None = None
        self.tail: RawPiece = ("", (), None)

    def step(self, text: str, ids: tuple[int, ...], lp: LP) -> Chunk | None:
        """The chunk for one raw piece, or None when this piece ends the completion."""
        if not self.first:
            self.first = perf_counter()
        self.n += len(ids)
        stops = self.stops
        out = text if stops is None else stops.feed(text)
        if stops is not None and stops.stopped:
            self.finish, self.tail = "stop", (out, ids, lp)
            return None
        if self.n >= self.max_tokens:
            self.finish, self.tail = "length", (out, ids, lp)
            return None
        if type(lp) is TopLogprobs:
            return Chunk(out, ids, None, None, None, lp.chosen, top_logprobs=lp.top)
        return Chunk(out, ids, None, None, None, lp)  # type: ignore[arg-type]

    def last(self, req: RequestState, t0: float) -> Chunk:
        """The final chunk: what the cut held back, the finish reason, usage and timings."""
        end = perf_counter()
        text, ids, raw = self.tail
        lp, top = _split(raw)
        if self.stops is not None and not self.stops.stopped:
            text += self.stops.flush()
        n = self.n if req.completion_tokens is None else req.completion_tokens
        return Chunk(
            text,
            ids,
            self.finish or req.finish_reason or "stop",
            Usage(req.prompt_tokens, n, req.cached_tokens, req.draft_tokens, req.accepted_draft_tokens),
            _timings(req, t0, self.first or end, end, n),
            lp,
            self._stop_sequence(req),
            top_logprobs=top,
        )

    def _stop_sequence(self, req: RequestState) -> str | None:
        if self.stops is None:
            return None
        if self.finish == "stop":
            return self.stops.matched
        # the engine matched it first (and never streamed it): the string it names, if it is ours
        if self.finish is None and req.finish_reason == "stop" and req.stop_sequence in self.stops.strings():
            return req.stop_sequence
        return None


def _timings(req: RequestState, t0: float, first: float, end: float, n: int) -> Timings:
    ttft = first - t0
    if req.prefill_s is not None and req.decode_s is not None:
        prefill, decode, source = req.prefill_s, req.decode_s, "engine"
    else:
        prefill, decode, source = ttft, end - first, "wall"
    cached = req.cached_tokens or 0
    evaluated = req.prompt_tokens - cached
    return Timings(
        ttft_s=ttft,
        prefill_s=prefill,
        decode_s=decode,
        total_s=end - t0,
        prefill_tokens_per_s=evaluated / prefill if prefill > 0 and evaluated > 0 else None,
        # the first token comes out of prefill; decode makes the other n - 1
        decode_tokens_per_s=(n - 1) / decode if decode > 0 and n > 1 else None,
        source=source,  # type: ignore[arg-type]
        peak_memory_bytes=req.peak_memory_bytes,
        queue_s=req.queue_s,
    )


FORMAT_NEVER_DROPPED = (
    "A response format is never ignored, whatever unsupported_params says: use a backend whose "
    "capabilities.sampling has response_format, or leave it unset."
)


def fold(chunks: Iterator[Chunk], params: SamplingParams | None = None) -> Completion:
    """The whole completion a stream makes; ``params``' response format, if any, rides along for
    ``Completion.parsed()``."""
    parts: list[str] = []
    ids: list[int] = []
    lps: list[float] = []
    tops: list[TopK] = []
    last: Chunk | None = None
    for last in chunks:
        parts.append(last.text)
        ids.extend(last.token_ids)
        if last.logprobs is not None:
            lps.extend(last.logprobs)
        if last.top_logprobs is not None:
            tops.extend(last.top_logprobs)
    return _completion(parts, ids, lps, tops, last, params)


async def afold(chunks: AsyncIterator[Chunk], params: SamplingParams | None = None) -> Completion:
    parts: list[str] = []
    ids: list[int] = []
    lps: list[float] = []
    tops: list[TopK] = []
    last: Chunk | None = None
    async for last in chunks:
        parts.append(last.text)
        ids.extend(last.token_ids)
        if last.logprobs is not None:
            lps.extend(last.logprobs)
        if last.top_logprobs is not None:
            tops.extend(last.top_logprobs)
    return _completion(parts, ids, lps, tops, last, params)


def _completion(
    parts: list[str],
    ids: list[int],
    lps: list[float],
    tops: list[TopK],
    last: Chunk | None,
    params: SamplingParams | None,
) -> Completion:
    if last is None or last.finish_reason is None or last.usage is None or last.timings is None:
        raise GenerationError("the stream ended without its final chunk")
    return Completion(
        "".join(parts),
        tuple(ids),
        last.finish_reason,
        last.usage,
        last.timings,
        tuple(lps) if lps else None,
        last.stop_sequence,
        params.output_format if params is not None and params.response_format is not None else None,
        last.tool_calls,
        tuple(tops) if tops else None,
    )


_DONE = object()


async def iterate_in_thread(gen: Iterator[Chunk]) -> AsyncIterator[Chunk]:
    """Run a sync chunk iterator in a worker thread, handing chunks to the event loop.

    When the consumer stops (cancelled, or breaks out), the worker is told to stop and closes the
    generator in its own thread at the next token, which releases the engine. Each stream has a
    thread of its own, not one of the loop's default executor (min(32, cores + 4) threads), which
    would queue concurrent requests to a batching engine behind one another.

    Chunks go through a buffer: the worker wakes the loop only when the buffer was empty, and the
    loop takes everything buffered on each wake-up. A wake-up (a write to the loop's self-pipe and
    a loop turn) costs more than a token of a fast engine; at one per token the hand-over would be
    what a client measures.
    """
    loop = asyncio.get_running_loop()
    buf: deque[Any] = deque()
    lock = threading.Lock()
    ready = asyncio.Event()
    stop = threading.Event()
    waking = False  # a wake-up is scheduled on the loop and has not run yet

    def wake() -> None:  # on the loop
        nonlocal waking
        with lock:
            waking = False
        ready.set()

    def put(item: Any) -> None:
        nonlocal waking
        with lock:
            buf.append(item)
            if waking:
                return
            waking = True
        try:
            loop.call_soon_threadsafe(wake)
        except RuntimeError:  # the loop is gone; nobody is listening
            stop.set()

    def work() -> None:
        try:
            for chunk in gen:
                if stop.is_set():
                    break
                put(chunk)
        except BaseException as exc:
            put(_Raised(exc))
        finally:
            gen.close()  # type: ignore[attr-defined]
            put(_DONE)

    threading.Thread(target=work, name="unillm-astream", daemon=True).start()
    try:
        while True:
            await ready.wait()
            ready.clear()  # before draining: a chunk put while we drain sets it again
            while buf:
                item = buf.popleft()
                if item is _DONE:
                    return
                if isinstance(item, _Raised):
                    raise item.exc
                yield item
    finally:
        stop.set()


class _Raised:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
