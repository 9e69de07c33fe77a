"""The ingress deployment: takes each HTTP request from Serve's proxy, reads its body once (to the
server's limit), names the prompt's prefix for the router and hands the request to a model replica.

A replica that dies before its answer began (its process killed, its node gone) costs the client
nothing: the request goes to another replica, up to ``retries`` times. A whole (non-streamed) answer
is kept here until it is complete, so it is retried the same way; a stream that breaks after its first
bytes ends in the protocol's own error event (OpenAI's ``data: {"error": ...}``, Anthropic's
``event: error``), which every client reads as a failed request."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from unillm.server._anthropic import error_event as anthropic_error
from unillm.server._app import key_refusal, too_large
from unillm.server._config import ServerConfig
from unillm.server._errors import ApiError, error_response
from unillm.server._openai_wire import error_event as openai_error
from unillm.server.ray._metrics import decisions, gathered, pull
from unillm.server.ray._router import prefix_hashes, prefix_text

__all__ = ["Ingress", "ReplicaLost", "metrics_response", "reporting", "served_path"]

log = logging.getLogger("unillm.server.ray")
_LOST = (RayActorError, ActorUnavailableError)
# not passed on: set again by whoever writes the answer to the client
_HOP = frozenset({b"content-length", b"transfer-encoding", b"connection", b"keep-alive"})


class ReplicaLost(ApiError):
    """The replica answering a request died and no other could take it over."""

    def __init__(self, tries: int) -> None:
        super().__init__(
            503, f"the model replica answering this request stopped ({tries} tried); send it again",
            type_="server_error", code="replica_lost", headers={"Retry-After": "1"},
        )  # fmt: skip


class Ingress:
    """The application's ingress (``build_app`` wraps it in ``serve.deployment``)."""

    def __init__(
        self, model: Any, config: ServerConfig, retries: int = 2, stats_period_s: float = 2.0
    ) -> None:
        from ray import serve

        self.model = model.options(stream=True)
        self.config = config
        self.retries = retries
        key = config.resolved_api_key()
        self.key = key.encode() if key else None
        self.app = serve.get_replica_context().app_name
        self._reports = asyncio.get_running_loop().create_task(reporting(self.app, stats_period_s))

    async def __del__(self) -> None:
        self._reports.cancel()

    async def __call__(self, request: Request) -> Response:
        path = served_path(request.scope)
        headers = list(request.scope.get("headers") or ())
        if path == "/metrics":
            return await metrics_response(request, self.key, lambda: _ingress_metrics(self.app))
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > self.config.max_body_bytes:
                return error_response(request, too_large(self.config.max_body_bytes))
        prefix = _prefix(path, bytes(body), request.headers.get("content-type", ""))
        args = (request.method, path, request.scope.get("query_string", b""), headers, bytes(body))
        client = request.client
        call = {"client": (client.host, client.port) if client else None, "prefix": prefix}
        for attempt in range(self.retries + 1):
            answer = self.model.handle.remote(*args, **call)
            try:
                status, head = await answer.__anext__()
                if not _streams(head):
                    whole = b"".join([bytes(piece) async for piece in answer])
                    return Response(whole, status_code=status, headers=_headers(head))
            except _LOST as exc:
                log.warning("a replica was lost before answering (try %d): %s", attempt + 1, exc)
                continue
            return StreamingResponse(_relay(answer, path), status_code=status, headers=_headers(head))
        return error_response(request, ReplicaLost(self.retries + 1))


async def metrics_response(
    request: Request, key: bytes | None, text: Callable[[], Awaitable[str]]
) -> Response:
    """The application's ``/metrics`` (``text``, asked only once the API key passed), or the
    server's own refusal: the ingress's and, in the direct shape, every replica's."""
    refused = key_refusal(key, "/metrics", dict(request.scope.get("headers") or ()))
    if refused is not None:
        return error_response(request, refused)
    return Response(await text(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _ingress_metrics(app: str) -> str:
    """Every replica's metrics and this process's router decisions (the ingress runs the router)."""
    return gathered(await pull(app)) + decisions()


async def reporting(app: str, period_s: float) -> None:
    """Refresh the replicas' reports every ``period_s`` (the router reads their KV use there)."""
    while True:
        try:
            await pull(app)
        except Exception as exc:  # a cluster hiccup: the router goes by load until the next round
            log.warning("asking the replicas for their reports failed: %s", exc)
        await asyncio.sleep(period_s)


async def _relay(answer: Any, path: str) -> AsyncIterator[bytes]:
    try:
        async for piece in answer:
            yield bytes(piece)
    except _LOST as exc:
        log.warning("a replica was lost mid-stream: %s", exc)
        lost = ReplicaLost(1)
        event = anthropic_error(lost) if path.startswith("/v1/messages") else openai_error(lost)
        yield event.encode()
    finally:
        answer.cancel()


def served_path(scope: Mapping[str, Any]) -> str:
    """The request's path below the application's route prefix (Serve's ``root_path``)."""
    path, root = str(scope.get("path", "/")), str(scope.get("root_path", "")).rstrip("/")
    return path[len(root) :] or "/" if root and path.startswith(root + "/") else path


def _prefix(path: str, body: bytes, content_type: str) -> list[bytes]:
    if "json" not in content_type and content_type:
        return []
    try:
        parsed = json.loads(body)
    except ValueError:
        return []
    return prefix_hashes(prefix_text(path, parsed))


def _streams(head: list[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in head)


def _headers(head: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in head if k.lower() not in _HOP}
