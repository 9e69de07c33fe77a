"""``/v1/chat/completions`` in OpenAI's shape, streamed or not, one choice or ``n``
(``_openai_wire`` writes both shapes; ``_completions`` serves the legacy route)."""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from unillm._chat._tools import ToolCallParseError, ToolSpec, openai_tool_call, parse_tool_calls
from unillm._contract._engine import forced_params
from unillm._contract._run import afold
from unillm._errors import ConfigError
from unillm._types import Chunk
from unillm.server._errors import ApiError
from unillm.server._generate import nothing, stream
from unillm.server._openai_logprobs import chat_logprobs
from unillm.server._openai_wire import (
    DONE,
    SSE_HEADERS,
    Framing,
    finish_reason,
    folded,
    seeded,
    sse,
    summed,
    whole,
)
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
from unillm.server._schemas import ChatRequest

if TYPE_CHECKING:
    from unillm._contract._engine import Engine
    from unillm._types import Completion, SamplingParams

__all__ = ["router"]


router = APIRouter()


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
    asked = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    k = (body.top_logprobs or 0) if body.logprobs else None
    # max_tokens 0 generates nothing; the other fields are checked as for one token
    params = openai_sampling(
        state, engine, slot.alias, body, 1 if asked == 0 else asked, logprobs=k, lora=record.adapter
    )
    if tools is not None:
        params = _forced(engine, params, tools)
    cid, created = "chatcmpl-" + secrets.token_hex(12), int(time.time())
    want_lp = body.logprobs
    if tools is not None:
        if body.n > 1:
            raise ApiError(400, f"n is {body.n}: a chat with tools returns one choice",
                           param="n", code="unsupported_value")  # fmt: skip
        chunks = await nothing(engine, prompt, params, echo=False) if asked == 0 else None
        chunks = chunks or stream(state, slot, engine, prompt, params, record)
        done = await unless_gone(request, afold(chunks))
        return _tool_answer(engine, body, tools, done, cid, created, slot.alias)
    if asked == 0:
        streams = [await nothing(engine, prompt, params, echo=False) for _ in range(body.n)]
    else:
        streams = [stream(state, slot, engine, prompt, p, record) for p in seeded(params, body.n)]
    if not body.stream:
        answers = await folded(request, streams)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": done.text, "refusal": None},
                "logprobs": chat_logprobs(engine, done) if want_lp else None,
                "finish_reason": finish_reason(done.finish_reason),
                "stop_reason": done.stop_sequence,  # vLLM's field: the stop string that ended it
            }
            for i, done in enumerate(answers)
        ]
        return whole(cid, "chat.completion", created, slot.alias, choices, summed([a.usage for a in answers]))
    framing = Framing(cid, "chat.completion.chunk", created, slot.alias, body, '"delta":{}', body.n)
    heads = framing.heads

    def event(i: int, chunk: Chunk) -> str:
        lp = dumps(chat_logprobs(engine, chunk)) if want_lp else "null"
        text = dumps(chunk.text)
        return f'data: {heads[i]}"delta":{{"content":{text}}},"logprobs":{lp},"finish_reason":null}}]}}\n\n'

    def opening(i: int) -> str:
        delta = '"delta":{"role":"assistant","content":""}'
        return f'data: {heads[i]}{delta},"logprobs":null,"finish_reason":null}}]}}\n\n'

    return await sse(request, streams, event, framing, opening=opening, keep_empty=want_lp)


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
    finish = "tool_calls" if calls else finish_reason(done.finish_reason)
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
        return whole(cid, "chat.completion", created, alias, [choice], done.usage)
    framing = Framing(cid, "chat.completion.chunk", created, alias, body, '"delta":{}')
    head = framing.heads[0]

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
    events.append(framing.finish(0, end) + framing.usage(done.usage) + DONE)
    return StreamingResponse(iter(events), media_type="text/event-stream", headers=SSE_HEADERS)
