"""From a validated request body to what the engine takes: the alias's engine, the prompt, the
sampling parameters. Shared by every route."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request

from unillm._chat._tools import InvalidTools, ToolSpec, read_tools
from unillm._errors import ConfigError
from unillm.server._errors import ApiError
from unillm.server._generate import RequestRecord, sampling

if TYPE_CHECKING:
    from unillm._contract._engine import Engine
    from unillm.server._pool import Slot
    from unillm.server._schemas import ChatMessageIn, _Sampling
    from unillm.server._state import State

__all__ = [
    "chat_prompt", "check_common", "dumps", "engine_for", "openai_sampling", "read_request_tools",
    "nucleus", "record_of", "refuse_unsupported", "text_of", "unless_gone",
]  # fmt: skip

T = TypeVar("T")


def record_of(request: Request) -> RequestRecord:
    """The access-log record the edge middleware put on this request."""
    record = request.scope.get("unillm.record")
    if record is None:  # a route reached without the middleware (an embedding app's own stack)
        record = request.scope["unillm.record"] = RequestRecord()
    return record


async def engine_for(state: State, model: str, record: RequestRecord) -> tuple[Slot, Engine[Any]]:
    """The loaded engine of the alias ``model`` (a name, never a path). ``alias:adapter`` names
    one of the alias's LoRA adapters (its config's ``lora = {name = path}``), as vLLM serves
    each adapter as a model: ``record.adapter`` says which, for the request's sampling."""
    alias, record.adapter = adapter_of(state, model)
    slot, engine = await state.pool.engine(alias)
    # pinned before anything awaits: a model loading meanwhile must not unload this one before
    # the request reaches its queue (the edge middleware unpins it when the request ends)
    if record.pinned is None:
        slot.pins += 1
        record.pinned = slot
    record.alias = slot.alias
    return slot, engine


def adapter_of(state: State, model: str) -> tuple[str, str | None]:
    """``model`` as (alias, adapter name or None); a 404 naming the adapters for one it lacks."""
    slots = state.pool.slots
    base, sep, name = model.rpartition(":") if isinstance(model, str) else ("", "", "")
    if not sep or model in slots or base not in slots:
        return model, None
    adapters = served_adapters(slots[base].spec.engine)
    if name not in adapters:
        raise ApiError(
            404, f"model {model!r} names no adapter of {base!r}; its adapters: "
            f"{[f'{base}:{a}' for a in adapters] or 'none'}", param="model", code="model_not_found",
        )  # fmt: skip
    return base, name


def served_adapters(config: Any) -> list[str]:
    """The adapter names a model's config serves as ``alias:name`` (a lone ``lora`` path
    applies to every request and is not one)."""
    return sorted(config.lora) if isinstance(config.lora, dict) else []


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, unless the client disconnects first: then ``work`` is cancelled (the
    engine stops at its next token) and the answer is a 499 nobody reads.

    Starlette cancels a response that is streaming already; without this, a whole answer, or a
    stream still waiting for its slot or first token, would run on for a client long gone.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ApiError(499, "the client closed the connection before the answer", code="client_closed")
    return task.result()


async def _disconnected(request: Request) -> None:
    # the body is read already: the next message is the disconnect (or the response's end)
    while (await request.receive())["type"] != "http.disconnect":
        pass


def nucleus(temperature: float | None, top_p: float | None) -> tuple[float | None, float | None]:
    """``temperature`` and ``top_p`` as the engine takes them: top_p 0 keeps the smallest set of
    tokens whose mass reaches 0, the likeliest one, which is greedy decoding (both APIs allow 0)."""
    if top_p == 0:
        return 0.0, None
    return temperature, top_p


def refuse_unsupported(names: list[str]) -> None:
    """A 400 naming the first of ``names``: fields the APIs define that this server does not serve."""
    if names:
        raise ApiError(
            400, f"{names[0]} is not supported by this server; leave it out", param=names[0],
            code="unsupported_parameter",
        )  # fmt: skip


def check_common(body: _Sampling) -> None:
    """Refuse what neither API route serves."""
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")


def openai_sampling(
    state: State,
    engine: Engine[Any],
    alias: str,
    body: Any,
    asked: int | None,
    *,
    logprobs: int | None,
    lora: str | None = None,
) -> Any:
    """``SamplingParams`` from an OpenAI-shaped body."""
    bias = None
    if body.logit_bias:
        bias = {}
        for key, value in body.logit_bias.items():
            if not key.strip().isdigit():
                raise ApiError(400, f"logit_bias keys are token ids, got {key[:40]!r}", param="logit_bias")
            if not -100 <= value <= 100:
                raise ApiError(400, f"logit_bias values lie in [-100, 100], got {value}", param="logit_bias")
            bias[int(key)] = value
    temperature, top_p = nucleus(body.temperature, body.top_p)
    stop = [s for s in ([body.stop] if isinstance(body.stop, str) else body.stop or []) if s]  # "": none
    fields = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": body.top_k if body.top_k and body.top_k > 0 else None,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "seed": body.seed,
        "stop": stop or None,
        "stop_token_ids": tuple(body.stop_token_ids) if body.stop_token_ids else None,
        "ignore_eos": body.ignore_eos or None,
        "min_tokens": body.min_tokens or None,
        "logprobs": logprobs,
        "logit_bias": bias,
        "response_format": _response_format(getattr(body, "response_format", None)),
        "lora": lora,
    }
    if isinstance(body.stop, list) and len(body.stop) > 16:
        raise ApiError(400, f"stop has {len(body.stop)} strings; send at most 16", param="stop")
    return sampling(engine, alias, state.config.max_tokens, asked, fields)


def _response_format(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is None or value.get("type") == "text":
        return None
    if value.get("type") not in ("json_object", "json_schema"):
        raise ApiError(
            400, f"response_format type {value.get('type')!r} is not one of text, json_object, json_schema",
            param="response_format",
        )  # fmt: skip
    return value


async def chat_prompt(
    engine: Engine[Any], messages: Sequence[ChatMessageIn], tools: ToolSpec | None = None
) -> str:
    """The prompt text of OpenAI-shaped messages (and tools) under the model's chat template."""
    plain: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.audio is not None:
            refuse_unsupported([f"messages[{i}].audio"])
        if m.function_call is not None:
            raise ApiError(
                400, "function_call is OpenAI's deprecated shape of tool_calls: send tool_calls",
                param=f"messages[{i}].function_call", code="unsupported_parameter",
            )  # fmt: skip
        content = m.content if m.content or m.refusal is None else m.refusal
        msg: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": text_of(content, f"messages[{i}].content"),
        }
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        plain.append(msg)
    return await render(engine, plain, tools)


async def render(engine: Engine[Any], messages: list[dict[str, Any]], tools: ToolSpec | None = None) -> str:
    """Render on a thread: a template is the model's code, and may take its time."""
    try:
        return await asyncio.to_thread(engine.render_chat, messages, tools=spec_tools(tools))
    except InvalidTools as exc:
        raise ApiError(400, str(exc), param=exc.field) from exc
    except ConfigError as exc:
        raise ApiError(400, str(exc), param="messages") from exc


def spec_tools(spec: ToolSpec | None) -> list[dict[str, Any]] | None:
    return list(spec.tools) if spec is not None else None


def read_request_tools(body: Any) -> ToolSpec | None:
    """The request's ``tools`` and ``tool_choice``, read (None: plain chat); a 400 naming the
    field when they cannot be used. The deprecated ``functions`` shape is refused."""
    if body.functions or body.function_call:
        raise ApiError(
            400, "functions and function_call are OpenAI's deprecated shape: send tools and tool_choice",
            param="functions", code="unsupported_parameter",
        )  # fmt: skip
    try:
        return read_tools(body.tools, body.tool_choice)
    except InvalidTools as exc:
        raise ApiError(400, str(exc), param=exc.field) from exc


def text_of(content: Any, where: str) -> str:
    """The text of a message's content: a string, or text parts/blocks (OpenAI's parts and
    Anthropic's blocks alike) joined by newlines; any other kind of part is a 400 naming ``where``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"{where} has a {part.type!r} part: this server takes text only", param=where)
        parts.append(part.text)
    return "\n".join(parts)


def dumps(value: Any) -> str:
    """Compact JSON, as the events on the wire carry it."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
