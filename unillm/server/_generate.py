"""One generation request, whatever API it came through: admission, the engine's async stream,
metrics and the access-log record. The OpenAI and Anthropic routes only translate shapes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from time import perf_counter
from typing import TYPE_CHECKING, Any

from unillm._contract._checks import check_prompt
from unillm._contract._engine import ALWAYS_HANDLED
from unillm._errors import ConfigError, UnsupportedParameter
from unillm._types import Chunk, SamplingParams, Timings, Usage
from unillm.server._errors import ApiError, shutting_down

if TYPE_CHECKING:
    from unillm._contract._engine import Engine
    from unillm.server._pool import Slot
    from unillm.server._state import State

__all__ = ["RequestRecord", "fits", "nothing", "sampling", "stream"]


class RequestRecord:
    """What the access log says of one request; the routes fill it in as they learn it."""

    __slots__ = ("adapter", "alias", "completion_tokens", "finish", "pinned", "prompt_tokens", "ttft_s")

    def __init__(self) -> None:
        self.alias: str | None = None
        self.adapter: str | None = None  # the LoRA adapter the request's model names (alias:adapter)
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.ttft_s: float | None = None
        self.finish: str | None = None
        self.pinned: Slot | None = None  # the model this request holds until it ends


def sampling(
    engine: Engine[Any], alias: str, limit: int, asked: int | None, fields: dict[str, Any]
) -> SamplingParams:
    """``SamplingParams`` for a request, refusing with a 400 what ``engine`` cannot honour.

    ``limit`` is the server's cap on new tokens; ``asked`` the request's (None: up to the cap).
    """
    window = engine.context_length
    most = min(limit, window) if window else limit
    if asked is not None and asked > most:
        where = f" (its context window is {window} tokens)" if window and window <= limit else ""
        raise ApiError(
            400,
            f"max_tokens is {asked}, more than the {most} this server allows for {alias!r}{where}; "
            "ask for fewer",
            param="max_tokens",
            code="max_tokens_exceeded",
        )
    try:
        params = SamplingParams(
            max_tokens=asked or most, **{k: v for k, v in fields.items() if v is not None}
        )
    except ConfigError as exc:
        raise ApiError(400, str(exc), param=exc.fields[0] if len(exc.fields) == 1 else None) from exc
    supported = engine.capabilities.sampling
    unsupported = [n for n in params.non_default() if n not in supported and n not in ALWAYS_HANDLED]
    if unsupported:
        raise ApiError(
            400, str(UnsupportedParameter(engine.name, unsupported)), param=unsupported[0],
            code="unsupported_parameter",
        )  # fmt: skip
    return params


async def fits(engine: Engine[Any], prompt: str | Sequence[int], params: SamplingParams) -> None:
    """Refuse a prompt that cannot fit the context before it takes a place in the queue. A text
    shorter than the context in UTF-8 bytes (4 per character at most) cannot fill it, as every
    token stands for at least one byte: only a longer one is counted (on a thread), and the
    engine's own rule (``check_prompt``) decides. Where the engine cannot count, it decides later."""
    window = engine.context_length
    if not window:
        return
    if isinstance(prompt, str):
        if 4 * len(prompt) + 1 < window:
            return
        try:
            ids: Sequence[int] = await asyncio.to_thread(engine.tokenize, prompt)
        except Exception:  # no tokenizer here, or a prompt it refuses: the engine says so later
            return
    else:
        ids = prompt
    check_prompt(ids, window, params.max_tokens)


async def stream(
    state: State,
    slot: Slot,
    engine: Engine[Any],
    prompt: str | Sequence[int],
    params: SamplingParams,
    record: RequestRecord,
) -> AsyncGenerator[Chunk, None]:
    """The engine's chunks for one request, inside the alias's admission, observed as they pass.

    ``Busy`` comes out of the first step when the queue is full; a consumer that stops early (a
    client gone) closes this generator, which cancels the engine's stream at its next token.
    """
    m = state.metrics.labels(slot.alias, engine.name)
    arrived = perf_counter()
    record.alias = slot.alias
    assert slot.admission is not None
    await fits(engine, prompt, params)
    async with slot.admission.slot(slot.alias):
        start = perf_counter()
        m.queue.observe(start - arrived)
        last = start
        first = True
        itl = m.itl.observe
        finish: str | None = None
        try:
            async for chunk in engine.astream(prompt, params):
                if state.cut:  # shutting down, and the grace is over: end in the protocol's error
                    raise shutting_down()
                now = perf_counter()
                if chunk.finish_reason is not None:
                    finish = chunk.finish_reason
                    usage = chunk.usage
                    if usage is not None:
                        record.prompt_tokens = usage.prompt_tokens
                        record.completion_tokens = usage.completion_tokens
                        m.prompt_tokens.inc(usage.prompt_tokens)
                        m.generation_tokens.inc(usage.completion_tokens)
                    if first:  # nothing came before: the end is the first answer
                        record.ttft_s = now - arrived
                        m.ttft.observe(now - arrived)
                    elif chunk.token_ids:  # the last token's own gap
                        itl(now - last)
                    m.e2e.observe(now - arrived)
                elif first:
                    first = False
                    record.ttft_s = now - arrived
                    m.ttft.observe(now - arrived)
                else:
                    itl(now - last)
                last = now
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            finish = finish or "abort"  # closed after the last chunk is a finished request
            raise
        except Exception:
            finish = "error"
            raise
        finally:
            record.finish = finish = finish or "abort"
            m.finished(finish)
            slot.last_used = time.monotonic()  # idle time counts from the end of the last request


async def nothing(
    engine: Engine[Any], prompt: str | list[int], params: SamplingParams, echo: bool
) -> AsyncGenerator[Chunk, None]:
    """The answer of ``max_tokens: 0``: the prompt counted (and echoed when asked), no token
    generated, finish ``length``; as a stream of one last chunk, like a generation's."""
    await fits(engine, prompt, params)
    if isinstance(prompt, str):
        try:
            ids: Sequence[int] = await asyncio.to_thread(engine.tokenize, prompt)
        except NotImplementedError as exc:
            raise ApiError(
                400, f"max_tokens 0 answers with the prompt's token count, which {engine.name} cannot "
                "count; ask for at least one token", param="max_tokens", code="unsupported_value",
            ) from exc  # fmt: skip
        text = prompt
    else:
        ids, text = prompt, await asyncio.to_thread(engine.detokenize, prompt)

    async def one() -> AsyncGenerator[Chunk, None]:
        usage = Usage(prompt_tokens=len(ids), completion_tokens=0)
        yield Chunk(text if echo else "", (), "length", usage, Timings(0.0, 0.0, 0.0, 0.0, None, None))

    return one()
