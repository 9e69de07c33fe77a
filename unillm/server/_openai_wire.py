"""What chat and completions answer alike on the wire: a whole answer of one or more choices, and
a stream of server-sent events that carries one choice or several side by side.

A streamed answer starts only once every choice's first token is there, so a request the engine
refuses (a prompt longer than the context, a full queue) still gets its HTTP status, not an error
event inside a 200. Each token is one event, formatted from a prefix made once per choice (the
JSON encoder runs on the token text only). Several choices (``n`` above 1, a batch of prompts)
are generated side by side, each a request of its own to the engine, and their events interleave
as their tokens come; each choice ends with its own finish event, and the usage (when asked for)
comes once, after the last.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from unillm._contract._run import afold
from unillm._params import SamplingParams
from unillm._types import Chunk, Completion, Usage
from unillm.server._errors import ApiError, public_message
from unillm.server._request import dumps, unless_gone

__all__ = [
    "DONE", "SSE_HEADERS", "Framing", "finish_reason", "folded", "seeded", "sse", "summed",
    "usage_json", "whole",
]  # fmt: skip

if TYPE_CHECKING:
    pass

T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering
DONE = "data: [DONE]\n\n"


def usage_json(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    out: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }
    if usage.cached_prompt_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": usage.cached_prompt_tokens}
    if usage.draft_tokens is not None:  # speculative decoding, where the engine counts them
        out["completion_tokens_details"] = {
            "draft_tokens": usage.draft_tokens,
            "accepted_draft_tokens": usage.accepted_draft_tokens,
        }
    return out


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else reason if reason in ("length", "tool_calls") else "stop"


def summed(usages: Sequence[Usage], per_prompt: int = 1) -> Usage:
    """The usage of several choices: each prompt once (choices ``per_prompt`` apart share one),
    every choice's generated tokens. One choice keeps its own, speculative decoding's counts
    included."""
    if len(usages) == 1:
        return usages[0]
    firsts = usages[::per_prompt]
    cached = [u.cached_prompt_tokens for u in firsts if u.cached_prompt_tokens is not None]
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in firsts),
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_prompt_tokens=sum(cached) if cached else None,
    )


def whole(cid: str, obj: str, created: int, alias: str, choices: list[dict[str, Any]], usage: Usage) -> Any:
    """A whole (non-streamed) answer."""
    body = {"id": cid, "object": obj, "created": created, "model": alias, "choices": choices}
    return JSONResponse({**body, "usage": usage_json(usage)})


class Framing:
    """A stream's event prefixes (one per choice, up to the choice's fields) and its endings: a
    choice's finish event on its ``empty`` delta, and the usage event when the request asked."""

    def __init__(self, cid: str, obj: str, created: int, alias: str, body: Any, empty: str, count: int = 1):
        self.base = dumps({"id": cid, "object": obj, "created": created, "model": alias})[:-1]
        self.heads = [f'{self.base},"choices":[{{"index":{i},' for i in range(count)]
        self.empty = empty
        self.usage_too = bool(body.stream_options and body.stream_options.include_usage)

    def finish(self, i: int, chunk: Chunk) -> str:
        reason = finish_reason(chunk.finish_reason)
        stop = dumps(chunk.stop_sequence)  # vLLM's stop_reason: the stop string that ended it
        out = f'data: {self.heads[i]}{self.empty},"logprobs":null,"finish_reason":"{reason}",'
        return out + f'"stop_reason":{stop}}}]}}\n\n'

    def usage(self, usage: Usage | None) -> str:
        if not self.usage_too:
            return ""
        return f'data: {self.base},"choices":[],"usage":{dumps(usage_json(usage))}}}\n\n'


def error_event(exc: BaseException) -> str:
    """The event a stream ends with when its generation fails: OpenAI's error object."""
    if isinstance(exc, ApiError):
        err: dict[str, Any] = {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}
    else:
        err = {"message": public_message(exc, None), "type": "server_error"}
    return "data: " + dumps({"error": err}) + "\n\n" + DONE


async def sse(
    request: Request,
    streams: Sequence[AsyncGenerator[Chunk, None]],
    event: Callable[[int, Chunk], str],
    framing: Framing,
    *,
    opening: Callable[[int], str] | None = None,
    keep_empty: bool = False,
    per_prompt: int = 1,
) -> Any:
    """A streaming response of ``streams`` (one per choice, in index order), started once a first
    token is there (or its refusal raised, for the HTTP status). ``event(i, chunk)`` writes choice
    i's token event; ``opening(i)`` its first event, if any; ``keep_empty`` keeps events of no
    text (the tokens' logprobs are asked for).

    Several streams are all read from the start, side by side: an engine that runs fewer at once
    than there are choices (one at a time) gives the next its slot when the one before ends, so
    the response waits for the first token of any, never for every first token (that would wait
    on a slot held by a stream nobody reads). A refusal after the response began (a full queue
    for a later choice) is an error event."""

    def piece(i: int, chunk: Chunk) -> str:
        if chunk.finish_reason is None:
            return event(i, chunk) if chunk.text or keep_empty else ""
        # the last chunk may carry the last token, text or not
        keep = chunk.text or (keep_empty and chunk.token_ids)
        return (event(i, chunk) if keep else "") + framing.finish(i, chunk)

    if len(streams) == 1:
        (chunks,) = streams
        try:
            first = await unless_gone(request, anext(chunks))
        except BaseException:
            await chunks.aclose()
            raise

        async def one() -> AsyncIterator[str]:
            chunk = first
            try:
                if opening is not None:
                    yield opening(0)
                while True:
                    if chunk.finish_reason is not None:
                        yield piece(0, chunk) + framing.usage(chunk.usage) + DONE
                        return
                    if text := piece(0, chunk):
                        yield text
                    chunk = await anext(chunks)
            except Exception as exc:
                yield error_event(exc)
            finally:
                await chunks.aclose()

        return StreamingResponse(one(), media_type="text/event-stream", headers=SSE_HEADERS)

    queue: asyncio.Queue[tuple[int, Chunk | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, chunks: AsyncGenerator[Chunk, None]) -> None:
        try:
            async for chunk in chunks:
                queue.put_nowait((i, chunk))
            queue.put_nowait((i, None))  # ended (after its finish chunk)
        except Exception as exc:
            queue.put_nowait((i, exc))

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]

    async def stop() -> None:
        for task in pumps:
            task.cancel()
        for task in pumps:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for s in streams:
            await s.aclose()

    try:
        head = await unless_gone(request, queue.get())
        if isinstance(head[1], BaseException):
            raise head[1]
    except BaseException:
        await stop()
        raise

    async def many() -> AsyncIterator[str]:
        usages: list[Usage | None] = [None] * len(streams)
        ended = [False] * len(streams)
        got: tuple[int, Chunk | BaseException | None] = head
        try:
            if opening is not None:
                yield "".join(opening(i) for i in range(len(streams)))
            while True:
                i, item = got
                if isinstance(item, BaseException):
                    yield error_event(item)
                    return
                if item is None:
                    ended[i] = True
                    if all(ended):
                        break
                else:
                    if item.finish_reason is not None:
                        usages[i] = item.usage
                    if text := piece(i, item):
                        yield text
                got = await queue.get()
            known = [u for u in usages if u is not None]
            total = summed(known, per_prompt) if len(known) == len(usages) else None
            yield framing.usage(total) + DONE
        finally:
            await stop()

    return StreamingResponse(many(), media_type="text/event-stream", headers=SSE_HEADERS)


def seeded(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The parameters of ``n`` choices to one prompt: with a ``seed``, choice i samples with
    seed + i, so each choice is the answer one request with that seed gets."""
    if params.seed is None:
        return [params] * n
    return [params.model_copy(update={"seed": params.seed + i}) for i in range(n)]


async def folded(request: Request, streams: Sequence[AsyncGenerator[Chunk, None]]) -> list[Completion]:
    """The whole answers of ``streams``, generated side by side (each a request of its own to the
    engine, which batches them where it batches); the others stop too when one fails or the
    client leaves."""
    return await unless_gone(request, _gathered([afold(s) for s in streams]))


async def _gathered(work: Sequence[Awaitable[T]]) -> list[T]:
    """``work``'s results, as a task of its own: cancelling it cancels every one (a bare
    ``gather`` future does not end cancelled, and ``unless_gone`` tells a gone client by that),
    and one failing cancels the others (``gather`` leaves them running) before it raises."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
