"""One replica of the model deployment: ``unillm serve``'s own app over one engine, loaded on the
node the replica lands on by the usual selection. The ingress hands it each HTTP request whole
(method, path, headers, body) and it answers through the app in process, so every route, limit,
error and metric is the server's; the answer goes back as a stream: the status and headers first,
then the body as the app writes it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from unillm.server._config import ServerConfig

__all__ = ["Head", "Replica", "asgi_stream"]

log = logging.getLogger("unillm.server.ray")

Head = tuple[int, list[tuple[bytes, bytes]]]
"""The first item of an answer: the status and the headers."""


async def asgi_stream(
    app: Any,
    method: str,
    path: str,
    query: bytes,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    client: tuple[str, int] | None = None,
    interval_s: float = 0.0,
) -> AsyncIterator[Head | bytes]:
    """Run one HTTP request through an ASGI ``app`` and yield its answer: ``(status, headers)``,
    then the body in pieces. Closing the iterator early is a client gone (``http.disconnect``).

    A piece goes at once when ``interval_s`` has passed since the last one went (the first always
    does); one written sooner waits out the interval, and whatever the app writes meanwhile goes
    with it: at most one piece per interval, each token late by less than it."""
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
        "root_path": "", "headers": headers, "client": client, "server": ("unillm-replica", 0),
    }  # fmt: skip
    out: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    gone = asyncio.Event()
    sent = False
    loop = asyncio.get_running_loop()
    last = float("-inf")  # when the last piece went

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await out.put(message)

    task = asyncio.create_task(app(scope, receive, send))
    try:
        while True:
            getting = asyncio.ensure_future(out.get())
            await asyncio.wait({getting, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getting.done():  # the app returned (or failed) with nothing more queued
                getting.cancel()
                if out.empty():
                    task.result()  # its exception, if any
                    return
                message = out.get_nowait()
            else:
                message = getting.result()
            if message["type"] == "http.response.start":
                yield message["status"], list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                # each piece is a message through Ray to the ingress, and another to the proxy:
                # what the app writes within the interval (or wrote while the last was on its
                # way) goes as one
                piece, more = bytearray(message.get("body", b"")), message.get("more_body", False)
                hold = last + interval_s - loop.time()
                if more and hold > 0:
                    await asyncio.wait({task}, timeout=hold)  # the app's end cuts it short
                while more and not out.empty():  # after the start, only body messages come
                    nxt = out.get_nowait()
                    piece += nxt.get("body", b"")
                    more = nxt.get("more_body", False)
                if piece:
                    last = loop.time()
                    yield bytes(piece)
                if not more:
                    return
    finally:
        gone.set()  # the app hears the client gone, and has a moment to end its own way
        if not task.done():
            await asyncio.wait({task}, timeout=1.0)
        if not task.done():
            task.cancel()
        with contextlib.suppress(BaseException):
            await task


class Replica:
    """The model deployment's class (``build_app`` wraps it in ``serve.deployment``)."""

    async def __init__(self, config: ServerConfig, stream_interval_ms: float = 0.0) -> None:  # type: ignore[misc]
        from unillm.server import create_app
        from unillm.server._pool import Pool, served_config

        self.config = config
        self.interval_s = stream_interval_ms / 1000
        self.pool = Pool(config)
        for spec in config.models:  # loaded before the replica takes requests
            engine = await asyncio.to_thread(_load, served_config(spec, config))
            self.pool.adopt(spec.alias, engine)
        self.server = create_app(config, pool=self.pool)
        self._stack = contextlib.AsyncExitStack()
        await self._stack.enter_async_context(self.server.router.lifespan_context(self.server))
        self.name, self.node = _replica_name(), _node_id()
        from unillm.server.ray._metrics import RayExport

        self._export = RayExport()

    async def handle(
        self,
        method: str,
        path: str,
        query: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        client: tuple[str, int] | None = None,
        prefix: list[bytes] | None = None,  # read by the router, not here
    ) -> AsyncIterator[Head | bytes]:
        """Answer one HTTP request (``asgi_stream``), adding this replica's name and node as headers
        (``x-unillm-replica``, ``x-unillm-node``)."""
        stream = asgi_stream(self.server, method, path, query, headers, body, client, self.interval_s)
        async for item in stream:
            if isinstance(item, tuple):
                status, head = item
                yield (
                    status,
                    [
                        *head,
                        (b"x-unillm-replica", self.name.encode()),
                        (b"x-unillm-node", self.node.encode()),
                    ],
                )
            else:
                yield item

    def metrics(self) -> str:
        """This replica's Prometheus exposition (the server's /metrics)."""
        from prometheus_client import generate_latest

        return generate_latest(self.server.state.unillm.metrics.registry).decode()

    def record_routing_stats(self) -> dict[str, Any]:
        """What the router reads (Serve calls this every ``request_routing_stats_period_s``): the KV
        cache's fill and prefix hits, summed over the models, and the metrics for the ingress."""
        used = capacity = hits = queries = 0
        for slot in self.pool.slots.values():
            engine = slot.engine
            if engine is None or not engine.loaded:
                continue
            try:
                kv = engine.kv_stats()
            except Exception:  # an engine that cannot tell: routed by load only
                continue
            used += kv.used_tokens or 0
            capacity += kv.capacity_tokens or 0
            hits += kv.prefix_cache_hits or 0
            queries += kv.prefix_cache_queries or 0
        text = self.metrics()
        try:
            self._export.push(text)
        except Exception as exc:  # the export is best effort; routing must go on
            log.warning("exporting the metrics to Ray failed: %s", exc)
        return {
            "replica": self.name,
            "node": self.node,
            "kv_usage": used / capacity if capacity else None,
            "prefix_cache_hits": hits,
            "prefix_cache_queries": queries,
            "metrics": text,
        }

    async def check_health(self) -> None:
        if not self.pool.ready:
            raise RuntimeError("the replica's models are not loaded")

    async def __del__(self) -> None:
        self.server.state.unillm.begin_shutdown()
        await self._stack.aclose()


def _load(config: Any) -> Any:
    from unillm import load_engine

    return load_engine(config)


def _replica_name() -> str:
    from ray import serve

    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside Serve (tests of the class itself)
        return "local"


def _node_id() -> str:
    import ray

    try:
        return str(ray.get_runtime_context().get_node_id())
    except Exception:
        return "local"
