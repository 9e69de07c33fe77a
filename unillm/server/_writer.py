"""The bytes of a streamed answer on their way to the client.

Generation never waits on a client's socket. While the connection's buffer has room, an event goes
straight to the server (uvicorn writes it at once); when the client has fallen behind, events are
queued here and a task sends them, all that is queued in one write, so the route goes on and a
model's place in the batch (or its only slot) is freed when generation ends, however slowly the
client reads. A client that takes nothing for ``write_timeout_s`` is cut off: its connection is
aborted (a close would wait for the unsent bytes), which ends the request and frees its sequence if
it still runs; the event is logged and counted (``unillm:stalled_clients``). What one request may
queue is bounded by the tokens it may ask for (``max_tokens``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unillm.server._state import State

__all__ = ["Writer"]

log = logging.getLogger("unillm.server")


class Writer:
    """One streamed response's sender: ``send`` waits only while the connection's buffer has
    room; ``done`` waits for the last byte (or for the cut-off)."""

    __slots__ = ("_cut", "_send", "_state", "_task", "_transport", "_wake", "_where", "queue")

    def __init__(self, send: Any, scope: dict[str, Any], state: State) -> None:
        self._send = send
        self._transport = scope.get("unillm.transport")
        self._state = state
        self._where = scope
        self.queue: deque[dict[str, Any]] = deque()
        self._wake = asyncio.Event()
        self._cut = False
        self._task: asyncio.Task[None] | None = None

    async def send(self, message: dict[str, Any]) -> None:
        if self._cut:
            return  # the client is gone: nothing more goes out
        if (self._task is None or self._task.done()) and self._room():
            await self._send(message)  # the buffer has room: uvicorn writes without waiting
            return
        self.queue.append(message)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def done(self) -> None:
        """Wait until everything queued is sent or the client is cut off; a cancelled caller (the
        server's own shutdown) leaves the task to end with the connection."""
        if self._task is not None:
            await asyncio.shield(self._task)

    def _room(self) -> bool:
        """Whether a write now would not wait: uvicorn waits once the transport's buffer passed
        its high-water mark, until it is back under the low one. Unknown (another server): no."""
        t = self._transport
        if t is None:
            return False
        return t.get_write_buffer_size() <= t.get_write_buffer_limits()[0]  # type: ignore[no-any-return]

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        queue = self.queue
        while queue and not self._cut:
            message = queue.popleft()
            if message["type"] == "http.response.body" and queue:
                message = _joined(message, queue)
            timer = loop.call_later(self._state.config.write_timeout_s, self._stalled)
            try:
                await self._send(message)
            except OSError:  # the connection is gone (a server that raises on a closed one)
                self._cut = True
                queue.clear()
            finally:
                timer.cancel()

    def _stalled(self) -> None:
        self._cut = True
        self.queue.clear()
        self._state.metrics.stalled.inc()
        client = self._where.get("client") or ("-", 0)
        log.warning(
            "%s:%s %s: the client took none of its answer for %g s (write_timeout_s); its request "
            "is cancelled and its connection closed", client[0], client[1], self._where.get("path", ""),
            self._state.config.write_timeout_s,
        )  # fmt: skip
        if self._transport is not None:
            self._transport.abort()  # the waiting write returns: the connection is lost
        elif self._task is not None:
            self._task.cancel()


def _joined(first: dict[str, Any], queue: deque[dict[str, Any]]) -> dict[str, Any]:
    """``first`` and the body messages queued behind it as one (the client had fallen behind)."""
    parts = [first["body"]]
    more = first.get("more_body", False)
    while more and queue and queue[0]["type"] == "http.response.body":
        nxt = queue.popleft()
        parts.append(nxt["body"])
        more = nxt.get("more_body", False)
    return {"type": "http.response.body", "body": b"".join(parts), "more_body": more}
