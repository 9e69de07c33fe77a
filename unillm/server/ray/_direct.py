"""The direct shape of the application, for a Ray Serve that runs HAProxy in front
(``RAY_SERVE_ENABLE_HA_PROXY=1``, Ray's high-throughput mode): clients' connections go from HAProxy
straight to a model replica's own HTTP port, with no Python proxy and no unillm ingress between.

HAProxy asks the router deployment (:class:`DirectRouter`, ``POST /internal/route`` with the request's
body, as ``RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1`` has it send) which replica takes each
request; the router names the prompt's prefix and asks the model deployment's request router (the
prefix router) for a replica, as the ingress does in the other shape. The replica
(:class:`DirectReplica`) answers with ``unillm serve``'s app in process, so every route, limit, error
and metric is the server's; its ``/metrics`` is the whole application's (every replica's series,
labelled, and the routers' decisions), as the ingress's is.

What HAProxy does, not unillm: a request whose replica cannot be reached is sent to another
(``retry-on conn-failure``, ``option redispatch``); one whose replica died after taking it gets
HAProxy's 502, which the official clients send again; a replica lost mid-answer cuts the client's
connection, which every client reads as a failed request."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from unillm.server._config import ServerConfig
from unillm.server.ray._ingress import metrics_response, reporting, served_path
from unillm.server.ray._metrics import decisions, gathered, pull, pull_decisions
from unillm.server.ray._replica import Replica
from unillm.server.ray._router import prefix_hashes, prefix_text

__all__ = ["DirectReplica", "DirectRouter", "haproxy_enabled"]

log = logging.getLogger("unillm.server.ray")
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def haproxy_enabled() -> bool:
    """Whether Ray Serve runs HAProxy in front, as Serve read its environment here (once, when
    ``ray.serve`` was imported)."""
    from ray.serve._private import constants

    return bool(constants.RAY_SERVE_ENABLE_HA_PROXY)


async def _lifespan(receive: Receive, send: Send) -> None:
    """Serve runs the ASGI app's lifespan; the replica ran the server's own when it loaded."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def _plain(
    method: Callable[[Scope, Receive, Send], Awaitable[None]],
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """A bound method as a plain ASGI function (Serve's uvicorn takes a bound method for ASGI 2)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await method(scope, receive, send)

    return app


class DirectReplica(Replica):
    """A model replica that is the application's HTTP ingress (``build_app`` wraps it in
    ``serve.ingress()``, which calls ``__serve_build_asgi_app__``)."""

    async def __serve_build_asgi_app__(self) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        from ray import serve

        self.app_name = serve.get_replica_context().app_name
        key = self.config.resolved_api_key()
        self.key = key.encode() if key else None
        return _plain(self.asgi)

    async def asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        if scope["type"] != "http":
            return await self.server(scope, receive, send)
        path = served_path(scope)
        if path == "/metrics":
            return await self._metrics(scope, receive, send)
        # the server's routes (and its metrics' route label) as unillm serve sees them
        scope = {**scope, "path": path, "raw_path": path.encode(), "root_path": ""}
        named = [(b"x-unillm-replica", self.name.encode()), (b"x-unillm-node", self.node.encode())]

        async def send_named(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *named]}
            await send(message)

        await self.server(scope, receive, send_named)

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The application's metrics: every replica's, labelled, and the routers' decisions."""

        async def text() -> str:
            return gathered(await pull(self.app_name)) + decisions(*await pull_decisions(self.app_name))

        response = await metrics_response(Request(scope, receive), self.key, text)
        await response(scope, receive, send)


class DirectRouter:
    """The ingress request router HAProxy asks (``build_app`` binds it to the model deployment)."""

    def __init__(self, model: Any, config: ServerConfig, stats_period_s: float = 2.0) -> None:
        import asyncio

        from ray import serve

        self.model = model
        self.model._init()
        self.config = config
        self.app_name = serve.get_replica_context().app_name
        self._reports = asyncio.get_running_loop().create_task(reporting(self.app_name, stats_period_s))

    async def __del__(self) -> None:
        self._reports.cancel()

    async def __serve_build_asgi_app__(self) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        return _plain(self.asgi)

    def record_routing_stats(self) -> dict[str, Any]:
        """What this process's prefix routers decided (the replicas' ``/metrics`` asks, through
        the method Serve gives every replica)."""
        from unillm.server.ray._metrics import DECISIONS, SEEN

        return {"decisions": dict(DECISIONS), "replicas": SEEN["replicas"]}

    async def asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        request = Request(scope, receive)
        if served_path(scope) != "/internal/route" or request.method != "POST":
            return await JSONResponse({"status": "ok"})(scope, receive, send)
        body = await request.body()
        try:
            picked = await self.route(body)
        except Exception as exc:  # no replica (yet), or the cluster failing: HAProxy answers 503
            log.warning("choosing a replica failed: %s", exc)
            return await JSONResponse({"detail": str(exc)}, status_code=503)(scope, receive, send)
        await JSONResponse(picked)(scope, receive, send)

    async def route(self, body: bytes) -> dict[str, Any]:
        """The replica for a request of ``body``: ``{"host", "port", "replica_id"}`` (HAProxy's
        contract). A body cut short by HAProxy's buffer is not JSON: routed by load."""
        try:
            parsed = json.loads(body) if len(body) <= self.config.max_body_bytes else None
        except ValueError:
            parsed = None
        hashes = prefix_hashes(prefix_text(None, parsed))
        # _reserve=False: the request itself goes through HAProxy, not Serve's handle
        async with self.model.choose_replica(prefix=hashes, _reserve=False) as selection:
            replica = selection._replica
            endpoint = replica.backend_http_endpoint
            if endpoint is None:
                raise RuntimeError(f"replica {selection.replica_id} has no HTTP port")
            host, port = endpoint
            return {"host": host, "port": port, "replica_id": replica.replica_id.to_full_id_str()}
