"""The ASGI app: routes, the edge every request passes (key, body size, access log), and the
lifespan that loads the models, unloads idle ones and closes them all on shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from unillm.server import _anthropic, _completions, _embeddings, _openai
from unillm.server._config import ServerConfig
from unillm.server._errors import ApiError, error_response, install, shutting_down
from unillm.server._generate import RequestRecord
from unillm.server._pool import Pool
from unillm.server._request import adapter_of, chat_prompt, engine_for, record_of, served_adapters
from unillm.server._schemas import DetokenizeRequest, TokenizeRequest
from unillm.server._state import State
from unillm.server._writer import Writer

__all__ = ["State", "create_app"]

log = logging.getLogger("unillm.server")
access = logging.getLogger("unillm.server.access")
# Reachable without the key: a load balancer's probes.
_OPEN = frozenset({"/health", "/ready"})


def create_app(config: ServerConfig, *, pool: Pool | None = None) -> FastAPI:
    """The server as an ASGI app (run it with uvicorn, or ``unillm serve``).

    Models not yet loaded when it starts load in the background (``/ready`` says when), unless
    ``config.lazy``: then each loads on its first request.
    """

    pool = pool or Pool(config)
    state = State(config, pool)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(pool.reaper(), name="unillm-reaper")]
        if not config.lazy:
            tasks.append(asyncio.create_task(_load_at_start(state), name="unillm-load"))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await pool.close()

    app = _App(title="unillm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.unillm = state
    install(app, state.paths)
    app.include_router(_openai.router)
    app.include_router(_completions.router)
    app.include_router(_anthropic.router)
    app.include_router(_embeddings.router)
    _add_routes(app, state)
    app.add_middleware(Edge, state=state)
    return app


async def _load_at_start(state: State) -> None:
    try:
        await state.pool.load_all()
    except Exception as exc:
        from unillm.server._errors import public_message

        state.load_error = public_message(exc, state.paths)
        log.error("loading the models failed: %s", state.load_error)


def _add_routes(app: FastAPI, state: State) -> None:
    pool = state.pool

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        models = {s.alias: s.loaded for s in pool.slots.values()}
        if pool.ready:
            return JSONResponse({"ready": True, "models": models})
        body = {"ready": False, "models": models, "error": state.load_error}
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        data = []
        for s in pool.slots.values():
            backend = s.backend or s.spec.engine.backend
            data.append({"id": s.alias, "object": "model", "created": 0, "owned_by": "unillm",
                         "backend": backend, "loaded": s.loaded, **_served(s.engine)})  # fmt: skip
            # each named LoRA adapter is a model of its own, as vLLM lists them, where the backend
            # switches adapters per request (or is not loaded yet, so cannot tell)
            loaded = s.engine is not None and s.engine.loaded
            per_request = not loaded or "lora" in s.engine.capabilities.sampling  # type: ignore[union-attr]
            for name in served_adapters(s.spec.engine) if per_request else ():
                data.append({"id": f"{s.alias}:{name}", "object": "model", "created": 0,
                             "owned_by": "unillm", "parent": s.alias, "loaded": s.loaded})  # fmt: skip
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/models/{alias}")
    async def model(alias: str) -> JSONResponse:
        base, adapter = adapter_of(state, alias)
        s = pool.slot(base)
        found = {"id": s.alias, "object": "model", "created": 0, "owned_by": "unillm"}
        return JSONResponse(found if adapter is None else {**found, "id": alias, "parent": base})

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give either prompt or messages", param="prompt")
        _, engine = await engine_for(state, body.model, record_of(request))
        text = body.prompt if body.prompt is not None else await chat_prompt(engine, body.messages or [])
        ids = await asyncio.to_thread(_checked(engine.tokenize), text)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": engine.context_length})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
        _, engine = await engine_for(state, body.model, record_of(request))
        vocab = engine.vocab_size
        bad = [t for t in body.tokens if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise ApiError(
                400, f"token ids {bad[:5]} are outside the vocabulary (0..{vocab})", param="tokens"
            )
        return JSONResponse({"prompt": await asyncio.to_thread(_checked(engine.detokenize), body.tokens)})

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        data = await asyncio.to_thread(generate_latest, state.metrics.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)


class _App(FastAPI):
    """FastAPI, keeping the connection's transport in the scope (the server's own ``send``,
    uvicorn's, is only seen here, outside every middleware): the stream writer reads whether its
    buffer has room, and aborts it when the client reads nothing (a close would wait for the
    unsent bytes to drain)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            transport = getattr(getattr(send, "__self__", None), "transport", None)
            if all(
                hasattr(transport, a) for a in ("abort", "get_write_buffer_size", "get_write_buffer_limits")
            ):
                scope["unillm.transport"] = transport
        await super().__call__(scope, receive, send)


_TRANSPORT = ("abort", "get_write_buffer_size", "get_write_buffer_limits")  # what Writer uses


def _checked(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        try:
            return fn(*args)
        except NotImplementedError as exc:
            raise ApiError(400, str(exc), code="unsupported") from exc

    return call


class Edge:
    """Pure ASGI middleware: the API key, the body's size and pace, refusals while shutting down,
    the access log, the per-route request counter, and the writer that stands between a stream
    and its client's socket."""

    def __init__(self, app: Any, state: State) -> None:
        self.app = app
        self.state = state
        self.limit = state.config.max_body_bytes
        self.key = state.api_key.encode() if state.api_key else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        record = scope["unillm.record"] = RequestRecord()
        status = [500]
        writer: Writer | None = None

        async def sending(message: dict[str, Any]) -> None:
            nonlocal writer
            if writer is not None:
                await writer.send(message)
                return
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                if _streams(message):
                    writer = Writer(send, scope, self.state)
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await self._answer(scope, refusal, sending)
                return
            await self.app(scope, self._bounded(scope, receive), sending)
        except _TooLarge:
            await self._answer(scope, too_large(self.limit), sending)
        except _TooSlow:
            await self._answer(scope, _too_slow(self.state.config.body_timeout_s), sending)
        finally:
            if writer is not None:
                await writer.done()
            if record.pinned is not None:
                record.pinned.pins -= 1
            path = scope.get("path", "")
            self.state.metrics.requests.labels(_route(path), str(status[0])).inc()
            if self.state.config.access_log:
                _log_access(scope, status[0], record, time.perf_counter() - started)

    def _refusal(self, scope: dict[str, Any]) -> ApiError | None:
        if self.state.stopping and scope.get("path") not in _OPEN:
            return shutting_down()
        headers = dict(scope.get("headers") or ())
        refused = key_refusal(self.key, str(scope.get("path", "")), headers)
        if refused is not None:
            return refused
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return too_large(self.limit)
        return None

    def _bounded(self, scope: dict[str, Any], receive: Any) -> Any:
        """``receive``, counting a body sent without a length (chunked) against the limit, and
        waiting at most ``body_timeout_s`` for each of its parts (not for the disconnect that a
        response listens for once the body is in)."""
        seen = [0]
        limit = self.limit
        timeout = self.state.config.body_timeout_s
        whole = [False]

        async def bounded() -> dict[str, Any]:
            if whole[0]:
                return await receive()  # type: ignore[no-any-return]
            try:
                message: dict[str, Any] = await asyncio.wait_for(receive(), timeout)
            except TimeoutError:
                raise _TooSlow() from None
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > limit:
                    raise _TooLarge()
                whole[0] = not message.get("more_body", False)
            return message

        return bounded

    async def _answer(self, scope: dict[str, Any], err: ApiError, send: Any) -> None:
        request = Request(scope)
        await error_response(request, err)(scope, _no_body, send)


def key_refusal(key: bytes | None, path: str, headers: dict[bytes, bytes]) -> ApiError | None:
    """The 401 for a request to ``path`` without ``key`` (as a bearer token or ``x-api-key``), or
    ``None`` when it may pass: no key is set, it sent the key, or the path is a probe."""
    if key is None or path in _OPEN:
        return None
    given = headers.get(b"x-api-key")
    auth = headers.get(b"authorization", b"")
    if auth[:7].lower() == b"bearer ":
        given = auth[7:].strip()
    if given is not None and hmac.compare_digest(given, key):
        return None
    how = (
        "'x-api-key: <key>'"  # what Anthropic's clients send
        if path.startswith("/v1/messages")
        else "'Authorization: Bearer <key>'"
    )
    return ApiError(
        401, f"a valid API key is required: send it as {how}", type_="authentication_error",
        code="invalid_api_key",
    )  # fmt: skip


class _TooLarge(HTTPException):
    """Raised from ``receive``: FastAPI passes an HTTPException through its body parsing."""

    def __init__(self) -> None:
        super().__init__(413)


class _TooSlow(HTTPException):
    """Raised from ``receive`` when the next part of a body is later than ``body_timeout_s``."""

    def __init__(self) -> None:
        super().__init__(408)


def _too_slow(timeout: float) -> ApiError:
    return ApiError(408, f"the request body did not arrive within {timeout:g} s; send it faster",
                    code="request_timeout", headers={"Connection": "close"})  # fmt: skip


def _streams(start: dict[str, Any]) -> bool:
    headers = start.get("headers", ())
    return any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


async def _no_body() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


def too_large(limit: int) -> ApiError:
    """The 413 for a body over ``limit`` bytes (the server's and the Ray ingress's)."""
    return ApiError(413, f"the request body is larger than this server takes ({limit} bytes)",
                    code="request_too_large")  # fmt: skip


_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
           "/v1/embeddings", "/v1/rerank", "/v2/rerank", "/rerank", "/v1/models", "/tokenize",
           "/detokenize", "/health", "/ready", "/metrics")  # fmt: skip


def _route(path: str) -> str:
    if path in _ROUTES:
        return path
    return "/v1/models/{alias}" if path.startswith("/v1/models/") else "other"  # no label per stray URL


def _log_access(scope: dict[str, Any], status: int, r: RequestRecord, total: float) -> None:
    if not access.isEnabledFor(logging.INFO):
        return
    client = scope.get("client") or ("-", 0)
    ttft = f"{r.ttft_s:.3f}s" if r.ttft_s is not None else "-"
    access.info(
        '%s "%s %s" %d model=%s in=%s out=%s ttft=%s total=%.3fs%s',
        client[0], scope.get("method", "-"), _route(scope.get("path", "")), status, r.alias or "-",
        r.prompt_tokens if r.prompt_tokens is not None else "-",
        r.completion_tokens if r.completion_tokens is not None else "-", ttft, total,
        f" finish={r.finish}" if r.finish else "",
    )  # fmt: skip


def _served(engine: Any) -> dict[str, Any]:
    """What a loaded model's engine honours, for clients that adapt (vLLM's ``max_model_len``, the
    sampling parameters its backend takes: anything else is a 400), whether it batches, and what
    it is loaded for (``task``: generate, embed or rerank) and how it pools, where it can tell."""
    if engine is None or not engine.loaded:
        return {}
    caps = engine.capabilities
    return {
        "max_model_len": engine.context_length,
        "sampling": sorted(caps.sampling),
        "batching": caps.batching,
        "task": engine.task,
        "pooling": engine.pooling if engine.task == "embed" else None,
    }
