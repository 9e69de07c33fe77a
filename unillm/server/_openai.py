"""``/v1/chat/completions`` and ``/v1/completions`` in OpenAI's shapes, streamed or not.

A streamed answer starts only once the first token is there, so a request the engine refuses
(a prompt longer than the context, a full queue) still gets its HTTP status, not an error event
inside a 200. Each token is one server-sent event, formatted from a prefix and suffix made once
per request (the JSON encoder runs on the token text only).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from unillm._chat._tools import ToolCallParseError, ToolSpec, openai_tool_call, parse_tool_calls
from unillm._contract._engine import forced_params
from unillm._contract._run import afold
from unillm._errors import ConfigError
from unillm._types import Chunk, Usage
from unillm.server._errors import ApiError
from unillm.server._generate import stream
from unillm.server._openai_logprobs import chat_logprobs, completion_logprobs
from unillm.server._request import (
    chat_prompt,
    check_common,
    dumps,
    engine_for,
    openai_sampling,
    read_request_tools,
    record_of,
    refuse_unsupported,
    unless_gone,
)

# FastAPI reads the body models from the annotations at runtime
from unillm.server._schemas import ChatRequest, CompletionRequest

if TYPE_CHECKING:
    from unillm._contract._engine import Engine
    from unillm._types import Completion, SamplingParams

__all__ = ["router"]


router = APIRouter()
_SSE = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of the stream
_DONE = "data: [DONE]\n\n"


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


def _finish(reason: str | None) -> str | None:
    return None if reason is None else reason if reason in ("length", "tool_calls") else "stop"


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request) -> Any:
    state, record = request.app.state.unillm, record_of(request)
    check_common(body)
    refuse_unsupported(body.unsupported())
    tools = read_request_tools(body)
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    slot, engine = await engine_for(state, body.model, record)
    prompt = await chat_prompt(engine, body.messages, tools)
    asked = body.max_completion_tokens or body.max_tokens
    k = (body.top_logprobs or 0) if body.logprobs else None
    params = openai_sampling(state, engine, slot.alias, body, asked, logprobs=k, lora=record.adapter)
    if tools is not None:
        params = _forced(engine, params, tools)
    cid, created = "chatcmpl-" + secrets.token_hex(12), int(time.time())
    want_lp = body.logprobs
    if tools is not None:
        if body.n > 1:
            raise ApiError(400, f"n is {body.n}: a chat with tools returns one choice",
                           param="n", code="unsupported_value")  # fmt: skip
        done = await unless_gone(request, afold(stream(state, slot, engine, prompt, params, record)))
        return _tool_answer(engine, body, tools, done, cid, created, slot.alias)
    if not body.stream:
        answers = await _choices(request, state, slot, engine, prompt, params, record, body.n)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": done.text, "refusal": None},
                "logprobs": chat_logprobs(engine, done) if want_lp else None,
                "finish_reason": _finish(done.finish_reason),
                "stop_reason": done.stop_sequence,  # vLLM's field: the stop string that ended it
            }
            for i, done in enumerate(answers)
        ]
        return _whole(cid, "chat.completion", created, slot.alias, choices, _summed(answers))
    chunks = stream(state, slot, engine, prompt, params, record)
    head, last = _framing(cid, "chat.completion.chunk", created, slot.alias, body, '"delta":{}')

    def event(chunk: Chunk) -> str:
        lp = dumps(chat_logprobs(engine, chunk)) if want_lp else "null"
        text = dumps(chunk.text)
        return f'data: {head}"delta":{{"content":{text}}},"logprobs":{lp},"finish_reason":null}}]}}\n\n'

    role = (
        f'data: {head}"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}]}}'
    )
    role += "\n\n"
    return await _sse(request, chunks, event, last, role, want_lp)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    state, record = request.app.state.unillm, record_of(request)
    check_common(body)
    refused = {"echo": body.echo, "best_of": (body.best_of or 1) > 1, "suffix": body.suffix is not None}
    refuse_unsupported([name for name, asked in refused.items() if asked])
    prompt = _one_prompt(body.prompt)
    slot, engine = await engine_for(state, body.model, record)
    params = openai_sampling(
        state, engine, slot.alias, body, body.max_tokens, logprobs=body.logprobs, lora=record.adapter
    )
    cid, created = "cmpl-" + secrets.token_hex(12), int(time.time())
    want_lp = body.logprobs is not None
    if not body.stream:
        answers = await _choices(request, state, slot, engine, prompt, params, record, body.n)
        choices = [
            {
                "index": i,
                "text": done.text,
                "logprobs": completion_logprobs(engine, done) if want_lp else None,
                "finish_reason": _finish(done.finish_reason),
                "stop_reason": done.stop_sequence,  # vLLM's field: the stop string that ended it
            }
            for i, done in enumerate(answers)
        ]
        return _whole(cid, "text_completion", created, slot.alias, choices, _summed(answers))
    chunks = stream(state, slot, engine, prompt, params, record)
    head, last = _framing(cid, "text_completion", created, slot.alias, body, '"text":""')

    sent = [0]  # text sent so far: where the next chunk's tokens start

    def event(chunk: Chunk) -> str:
        lp = "null"
        if want_lp:
            lp = dumps(completion_logprobs(engine, chunk, sent[0]))
            sent[0] += len(chunk.text)
        text = dumps(chunk.text)
        return f'data: {head}"text":{text},"logprobs":{lp},"finish_reason":null}}]}}\n\n'

    return await _sse(request, chunks, event, last, "", want_lp)


def _forced(engine: Engine[Any], params: SamplingParams, tools: ToolSpec) -> SamplingParams:
    try:
        return forced_params(engine, params, tools)
    except ConfigError as exc:
        raise ApiError(400, str(exc), param="tool_choice", code="unsupported_parameter") from exc


def _tool_answer(
    engine: Engine[Any],
    body: ChatRequest,
    tools: ToolSpec,
    done: Completion,
    cid: str,
    created: int,
    alias: str,
) -> Any:
    """The answer of a chat with tools, whole or as one stream of events (the reply was held back
    until it could be parsed): the calls in OpenAI's shape, the text around them as the content."""
    try:
        content, calls = parse_tool_calls(done.text, tools.names, forced=tools.forced)
    except ToolCallParseError:  # cut by max_tokens: the text as it is, finish_reason "length"
        content, calls = done.text, ()
    if body.parallel_tool_calls is False:
        calls = calls[:1]
    finish = "tool_calls" if calls else _finish(done.finish_reason)
    wire = [openai_tool_call(c) for c in calls]
    lp = chat_logprobs(engine, done) if body.logprobs else None
    if not body.stream:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content or (None if calls else ""),
            "refusal": None,
        }
        if calls:
            message["tool_calls"] = wire
        choice = {
            "index": 0,
            "message": message,
            "logprobs": lp,
            "finish_reason": finish,
            "stop_reason": None,
        }
        return _whole(cid, "chat.completion", created, alias, [choice], done.usage)
    head, last = _framing(cid, "chat.completion.chunk", created, alias, body, '"delta":{}')

    def delta(fields: dict[str, Any], logprobs: Any = None) -> str:
        return (
            f'data: {head}"delta":{dumps(fields)},"logprobs":{dumps(logprobs)},"finish_reason":null}}]}}\n\n'
        )

    events = [delta({"role": "assistant", "content": ""})]
    if content:
        events.append(delta({"content": content}, lp))
    if wire:
        events.append(delta({"tool_calls": [{"index": i, **c} for i, c in enumerate(wire)]}))
    end = Chunk("", (), finish, done.usage, done.timings)  # type: ignore[arg-type]
    events.append(last(end) + _DONE)
    return StreamingResponse(iter(events), media_type="text/event-stream", headers=_SSE)


def _whole(
    cid: str, obj: str, created: int, alias: str, choices: list[dict[str, Any]], usage: Usage
) -> JSONResponse:
    """A whole (non-streamed) answer."""
    body = {"id": cid, "object": obj, "created": created, "model": alias, "choices": choices}
    return JSONResponse({**body, "usage": usage_json(usage)})


async def _choices(
    request: Request,
    state: Any,
    slot: Any,
    engine: Engine[Any],
    prompt: Any,
    params: SamplingParams,
    record: Any,
    n: int,
) -> list[Completion]:
    """``n`` answers to one prompt, generated side by side (each a request of its own to the
    engine, which batches them where it batches). With a ``seed``, choice i samples with seed + i,
    so each choice is the answer one request with that seed gets; the others then stop too when
    one fails or the client leaves."""
    if n == 1:
        return [await unless_gone(request, afold(stream(state, slot, engine, prompt, params, record)))]
    runs = [
        params if params.seed is None else params.model_copy(update={"seed": params.seed + i})
        for i in range(n)
    ]
    work = asyncio.gather(*(afold(stream(state, slot, engine, prompt, p, record)) for p in runs))
    try:
        return list(await unless_gone(request, work))
    except BaseException:
        work.cancel()
        raise


def _summed(answers: list[Completion]) -> Usage:
    """The usage of ``n`` choices: the prompt once, every choice's tokens (one choice: its own,
    speculative decoding's counts included)."""
    first = answers[0].usage
    if len(answers) == 1:
        return first
    return Usage(
        prompt_tokens=first.prompt_tokens,
        completion_tokens=sum(a.usage.completion_tokens for a in answers),
        cached_prompt_tokens=first.cached_prompt_tokens,
    )


def _framing(cid: str, obj: str, created: int, alias: str, body: Any, empty: str) -> tuple[str, Any]:
    """A stream's event prefix (up to the choice's fields), and the function that writes its end:
    the finish reason on an ``empty`` choice, then the usage chunk when the request asked for it."""
    base = dumps({"id": cid, "object": obj, "created": created, "model": alias})[:-1]
    head = base + ',"choices":[{"index":0,'
    usage_too = bool(body.stream_options and body.stream_options.include_usage)

    def last(chunk: Chunk) -> str:
        reason = _finish(chunk.finish_reason)
        stop = dumps(chunk.stop_sequence)  # vLLM's stop_reason: the stop string that ended it
        out = f'data: {head}{empty},"logprobs":null,"finish_reason":"{reason}",'
        out += f'"stop_reason":{stop}}}]}}\n\n'
        if usage_too:
            out += f'data: {base},"choices":[],"usage":{dumps(usage_json(chunk.usage))}}}\n\n'
        return out

    return head, last


async def _sse(
    request: Request,
    chunks: AsyncGenerator[Chunk, None],
    event: Any,
    last: Any,
    opening: str,
    keep_empty: bool,
) -> Any:
    """A streaming response whose first token is already there (or whose refusal was raised)."""
    try:
        first = await unless_gone(request, anext(chunks))
    except BaseException:
        await chunks.aclose()
        raise

    async def body() -> AsyncIterator[str]:
        try:
            if opening:
                yield opening
            chunk = first
            while True:
                if chunk.finish_reason is not None:  # it may carry the last token, text or not
                    piece = chunk.text or (keep_empty and chunk.token_ids)
                    yield (event(chunk) if piece else "") + last(chunk) + _DONE
                    return
                if chunk.text or keep_empty:
                    yield event(chunk)
                chunk = await anext(chunks)
        except ApiError as exc:
            err = {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}
            yield "data: " + dumps({"error": err}) + "\n\n" + _DONE
        except Exception as exc:
            from unillm.server._errors import public_message

            msg = {"error": {"message": public_message(exc, None), "type": "server_error"}}
            yield "data: " + dumps(msg) + "\n\n" + _DONE
        finally:
            await chunks.aclose()

    return StreamingResponse(body(), media_type="text/event-stream", headers=_SSE)


def _one_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(p, int) for p in prompt):
        return prompt  # type: ignore[return-value]
    if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return prompt[0]  # type: ignore[return-value]
    raise ApiError(400, "send one prompt per request (a string or a list of token ids)", param="prompt")
