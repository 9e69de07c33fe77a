"""``/v1/messages``: Anthropic's Messages API over the same engines, streamed or not.

The stream is Anthropic's event sequence: ``message_start``, ``content_block_start``,
``content_block_delta`` per token, ``content_block_stop``, ```message_delta`` (stop reason and
output tokens), ``message_stop``. ``stop_reason`` is ``max_tokens`` when the length limit ended
the reply, ``stop_sequence`` (naming it) when one of ``stop_sequences`` did, ``tool_use`` when the
model called tools, else ``end_turn``. With tools the reply is held back until it can be parsed,
then sent as its blocks (``_anthropic_tools``).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from unillm._chat._tools import ToolCallParseError, json_text, parse_tool_calls
from unillm._contract._engine import forced_params
from unillm._contract._run import afold
from unillm._errors import ConfigError
from unillm.server._anthropic_tools import input_json, read_anthropic_tools, tool_use_blocks, turns
from unillm.server._errors import ApiError, anthropic_type
from unillm.server._generate import nothing, sampling, stream
from unillm.server._request import (
    dumps,
    engine_for,
    nucleus,
    record_of,
    refuse_unsupported,
    render,
    text_of,
    unless_gone,
)

# FastAPI reads the body models from the annotations at runtime
from unillm.server._schemas import CountTokensRequest, MessagesRequest

if TYPE_CHECKING:
    from unillm._chat._tools import ToolSpec
    from unillm._contract._engine import Engine
    from unillm._types import Chunk
    from unillm.server._pool import Slot

__all__ = ["error_event", "router"]


router = APIRouter()


def _stop_reason(finish: str, stop_sequence: str | None) -> tuple[str, str | None]:
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls":
        return "tool_use", None
    if stop_sequence is not None:
        return "stop_sequence", stop_sequence
    return "end_turn", None


async def _prompt(
    body: MessagesRequest | CountTokensRequest, request: Request
) -> tuple[Slot, Engine[Any], str, ToolSpec | None, bool]:
    """The alias's engine and the prompt the request's system prompt, turns and tools render to
    under its chat template; and whether one tool call at most is wanted."""
    msgs = _turns(body)
    tools, one_call = read_anthropic_tools(body)
    slot, engine = await engine_for(request.app.state.unillm, body.model, record_of(request))
    return slot, engine, await render(engine, msgs, tools), tools, one_call


def _turns(body: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The request's system prompt and turns, as chat messages."""
    if body.thinking:
        raise ApiError(
            400, "extended thinking is not served by this server; leave it out", param="thinking",
            code="unsupported_parameter",
        )  # fmt: skip
    refuse_unsupported([n for n in ("container", "output_config") if getattr(body, n, None) is not None])
    msgs = []
    if body.system is not None:
        msgs.append({"role": "system", "content": text_of(body.system, "system")})
    msgs.extend(turns(body.messages))
    return msgs


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> Any:
    """The prompt tokens a Messages request with these messages, system prompt and tools would take."""
    _, engine, prompt, _, _ = await _prompt(body, request)
    try:
        ids = await asyncio.to_thread(engine.tokenize, prompt)
    except NotImplementedError as exc:  # a plugin engine without a tokenizer
        raise ApiError(400, f"{engine.name} cannot count tokens: {exc}", code="unsupported") from exc
    return JSONResponse({"input_tokens": len(ids)})


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request) -> Any:
    state, record = request.app.state.unillm, record_of(request)
    slot, engine, prompt, tools, one_call = await _prompt(body, request)
    stops = tuple(s for s in body.stop_sequences or () if s)  # "": stops nothing, as OpenAI's stop
    temperature, top_p = nucleus(body.temperature, body.top_p)
    fields = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": body.top_k or None,  # 0: no cut
        "stop": stops or None,
        "lora": record.adapter,
    }
    asked = body.max_tokens  # 0: the prompt counted, nothing generated (checked as for one token)
    params = sampling(engine, slot.alias, state.config.max_tokens, asked or 1, fields)
    if tools is not None:
        try:
            params = forced_params(engine, params, tools)
        except ConfigError as exc:
            raise ApiError(400, str(exc), param="tool_choice", code="unsupported_parameter") from exc
    chunks = await nothing(engine, prompt, params, echo=False) if asked == 0 else None
    chunks = chunks or stream(state, slot, engine, prompt, params, record)
    mid = "msg_" + secrets.token_hex(12)
    if not body.stream or tools is not None:
        done = await unless_gone(request, afold(chunks))
        reason, seq = _stop_reason(done.finish_reason, done.stop_sequence)
        content: list[dict[str, Any]] = [{"type": "text", "text": done.text, "citations": None}]
        if tools is not None:
            try:
                text, calls = parse_tool_calls(done.text, tools.names, forced=tools.forced)
            except ToolCallParseError:  # cut by max_tokens: the text as it is
                text, calls = done.text, ()
            calls = calls[:1] if one_call else calls
            content = [{"type": "text", "text": text, "citations": None}] if text or not calls else []
            content += tool_use_blocks(calls)
            reason = "tool_use" if calls else reason
        u = done.usage
        message = {
            "id": mid, "type": "message", "role": "assistant", "model": slot.alias, "content": content,
            "stop_reason": reason, "stop_sequence": seq, "stop_details": None, "container": None,
            "usage": _usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens),
        }  # fmt: skip
        if body.stream:
            return StreamingResponse(_held_events(message), media_type="text/event-stream", headers=_SSE)
        # json_text: a tool's input may hold a number past a double's range, which is JSON
        return Response(json_text(message), media_type="application/json")
    try:
        first = await unless_gone(request, anext(chunks))
    except BaseException:
        await chunks.aclose()
        raise
    return StreamingResponse(_events(mid, slot.alias, first, chunks), media_type="text/event-stream",
                             headers=_SSE)  # fmt: skip


_SSE = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _held_events(message: dict[str, Any]) -> list[str]:
    """A whole reply (``message``) as the events of a stream: each block whole in one delta."""
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = _usage(0, 0, None)
    events = [_event("message_start", {"message": start})]
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            opened: dict[str, Any] = {"type": "text", "text": "", "citations": None}
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            opened = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": input_json(block)}
        events.append(_event("content_block_start", {"index": i, "content_block": opened}))
        events.append(_event("content_block_delta", {"index": i, "delta": delta}))
        events.append(_event("content_block_stop", {"index": i}))
    stop = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    events.append(_event("message_delta", {"delta": stop, "usage": message["usage"]}))
    events.append(_event("message_stop", {}))
    return events


def _usage(prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
    """Anthropic's usage object, every field its document requires; what a local engine has no
    such thing for is null (no cache writes a client asked for, no server tools, no tiers)."""
    return {
        "input_tokens": prompt, "output_tokens": completion, "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": None, "cache_creation": None, "inference_geo": None,
        "output_tokens_details": None, "server_tool_use": None, "service_tier": None,
    }  # fmt: skip


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {dumps({'type': kind, **data})}\n\n"


def error_event(exc: BaseException) -> str:
    """The event a Messages stream ends with when its generation fails: Anthropic's error."""
    from unillm.server._errors import public_message

    kind = anthropic_type(exc.status) if isinstance(exc, ApiError) else "api_error"
    return _event("error", {"error": {"type": kind, "message": public_message(exc, None)}})


async def _events(
    mid: str, alias: str, first: Chunk, chunks: AsyncGenerator[Chunk, None]
) -> AsyncIterator[str]:
    try:
        # the prompt's size arrives with the last chunk; message_start says 0 until message_delta
        message: dict[str, Any] = {
            "id": mid, "type": "message", "role": "assistant", "model": alias, "content": [],
            "stop_reason": None, "stop_sequence": None, "stop_details": None, "container": None,
            "usage": _usage(0, 0, None),
        }  # fmt: skip
        yield _event("message_start", {"message": message})
        block = {"type": "text", "text": "", "citations": None}
        yield _event("content_block_start", {"index": 0, "content_block": block})
        delta = (
            'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            '"delta":{"type":"text_delta","text":'
        )
        chunk = first
        while True:
            if chunk.text:  # the last chunk may carry the last piece of text too
                yield f"{delta}{dumps(chunk.text)}}}}}\n\n"
            if chunk.finish_reason is not None:
                break
            chunk = await anext(chunks)
        yield _event("content_block_stop", {"index": 0})
        reason, seq = _stop_reason(chunk.finish_reason, chunk.stop_sequence)
        u = chunk.usage
        usage = _usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens) if u else {}
        yield _event(
            "message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": usage}
        )
        yield _event("message_stop", {})
    except Exception as exc:
        yield error_event(exc)
    finally:
        await chunks.aclose()
