"""``/v1/embeddings`` in OpenAI's shape, and ``/v1/rerank`` (also ``/v2/rerank`` and ``/rerank``)
in Jina's and Cohere's: the engine's ``aembed`` and ``arerank`` behind the same admission, metrics
and access log as generation.

The engine batches a request's inputs itself (one ``aembed`` call each request). What it refuses
is a 400 carrying its own words: an empty input, one longer than the model embeds at once (the
limit named; ``"truncate": true`` cuts it instead), a model loaded for another task. A model that
is not a reranker is refused on the rerank routes, never given scores made up from embeddings.
"""

from __future__ import annotations

import base64
import secrets
import time
from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from unillm._errors import ConfigError, ContextLengthExceeded
from unillm.server._errors import ApiError
from unillm.server._request import engine_for, record_of, unless_gone

# FastAPI reads the body models from the annotations at runtime
from unillm.server._schemas import EmbeddingRequest, RerankRequest

if TYPE_CHECKING:
    from unillm._contract._engine import Engine
    from unillm._types import Usage

__all__ = ["router"]

router = APIRouter()
T = TypeVar("T")


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
    inputs: Any = body.input  # one list of token ids is one input, which the type does not say
    if not inputs:  # "" or []: the engine would say "embed()", the client sent "input"
        raise ApiError(400, "input is empty: send a text, a list of texts or token ids", param="input")

    def embed(engine: Engine[Any]) -> Awaitable[Any]:
        return engine.aembed(inputs, dimensions=body.dimensions, truncate=body.truncate)

    alias, done = await _run(request, body.model, embed, "input")
    vectors = done.array()
    if body.encoding_format == "base64":  # little-endian float32, as OpenAI's clients decode it
        rows: list[Any] = [base64.b64encode(v.astype("<f4", copy=False).tobytes()).decode() for v in vectors]
    else:
        rows = done.vectors
    data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)]
    tokens = done.usage.prompt_tokens
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return JSONResponse({"object": "list", "data": data, "model": alias, "usage": usage})


@router.post("/v1/rerank")
@router.post("/v2/rerank")
@router.post("/rerank")
async def rerank(body: RerankRequest, request: Request) -> JSONResponse:
    docs = [d if isinstance(d, str) else d.text for d in body.documents]

    def ranked(engine: Engine[Any]) -> Awaitable[Any]:
        return engine.arerank(body.query, docs, top_n=body.top_n)

    alias, done = await _run(request, body.model, ranked, "documents")
    results = []
    for r in done.results:
        result: dict[str, Any] = {"index": r.index, "relevance_score": r.score}
        if body.return_documents:
            result["document"] = {"text": docs[r.index]}
        results.append(result)
    tokens = done.usage.prompt_tokens
    return JSONResponse({
        "id": "rerank-" + secrets.token_hex(12),
        "model": alias,
        "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},  # Jina's and vLLM's
        "meta": {"billed_units": {"input_tokens": tokens}},  # Cohere's
    })  # fmt: skip


async def _run(
    request: Request, model: str, work: Callable[[Engine[Any]], Awaitable[T]], field: str
) -> tuple[str, T]:
    """``work`` on the alias's engine inside its admission (429 when its queue is full, 503 once
    shutting down), timed and counted as generation is; the engine's refusals as 400s."""
    state, record = request.app.state.unillm, record_of(request)
    slot, engine = await engine_for(state, model, record)
    arrived = perf_counter()
    if record.adapter is not None:
        raise ApiError(400, f"{model!r} names a LoRA adapter, which applies to generation only; "
                       f"send the model {slot.alias!r}", param="model")  # fmt: skip
    m = state.metrics.labels(slot.alias, engine.name)
    assert slot.admission is not None
    async with slot.admission.slot(slot.alias):
        m.queue.observe(perf_counter() - arrived)
        try:
            done: Any = await unless_gone(request, work(engine))
        except ContextLengthExceeded as exc:
            # the engine's words name the input and the limit; the knob here is the body's
            message = str(exc).replace("pass truncate=True", 'send "truncate": true')
            raise ApiError(400, message, param=field, code="context_length_exceeded") from exc
        except ConfigError as exc:
            raise ApiError(400, str(exc), param=_param(engine, str(exc), field)) from exc
        finally:
            slot.last_used = time.monotonic()  # idle time counts from the end of the last request
    usage: Usage = done.usage
    record.prompt_tokens, record.completion_tokens = usage.prompt_tokens, 0
    m.prompt_tokens.inc(usage.prompt_tokens)
    m.e2e.observe(perf_counter() - arrived)
    return slot.alias, done


def _param(engine: Engine[Any], message: str, field: str) -> str:
    """The request field a refusal is about: the model when it was loaded for another task."""
    for name in ("dimensions", "top_n", "query"):
        if message.startswith(name) or message.startswith(f"the {name}"):
            return name
    wanted = "embed" if field == "input" else "rerank"
    return "model" if engine.task not in (wanted, None) else field
