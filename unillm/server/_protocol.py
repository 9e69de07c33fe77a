"""The connection limits ``unillm serve`` adds to uvicorn's HTTP protocol (httptools).

uvicorn closes a kept-alive connection ``timeout_keep_alive`` seconds after a response, but holds
forever one that never sends a request, or sends its headers a byte at a time, and takes any
number of connections and of header bytes. This protocol closes a connection whose request head
is not complete within ``header_timeout_s`` (from the connection's start, or from the request's
first byte), answers 431 past ``max_header_bytes`` or ``max_headers``, and 503 to a connection
beyond ``max_connections``; each answer is OpenAI's JSON error, and each closed connection is
counted in ``unillm:closed_connections``.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncio import TimerHandle, Transport

    from unillm.server._state import State

__all__ = ["protocol_for"]

log = logging.getLogger("unillm.server")

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


def protocol_for(state: State) -> type | None:
    """uvicorn's httptools protocol with ``state.config``'s limits; None without httptools (then
    uvicorn's own h11 protocol runs, without them: ``unillm serve`` says so)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None
    config = state.config
    closed = state.metrics.closed_connections

    class Protocol(HttpToolsProtocol):  # type: ignore[misc]
        _head_timer: TimerHandle | None = None
        _head_bytes = 0
        _head_count = 0
        _refused = False

        def connection_made(self, transport: Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > config.max_connections:
                self._refuse(503, f"this server holds {config.max_connections} connections at most "
                             "(max_connections); retry in a moment", "too_many_connections")  # fmt: skip
                return
            self._start_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_head_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # answered and closing: the rest is not read
            super().data_received(data)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes = self._head_count = 0
            if self._head_timer is None:  # a later request on a kept-alive connection
                self._start_head_timer()

        def on_url(self, url: bytes) -> None:
            self._count(len(url), 0)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            if self._count(len(name) + len(value) + 4, 1):
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._stop_head_timer()
            if self._refused:
                return
            super().on_headers_complete()

        def _count(self, size: int, headers: int) -> bool:
            self._head_bytes += size
            self._head_count += headers
            if self._refused:
                return False
            if self._head_bytes > config.max_header_bytes or self._head_count > config.max_headers:
                self._refuse(431, f"the request line and headers are larger than this server takes "
                             f"({config.max_header_bytes} bytes, {config.max_headers} headers)",
                             "headers_too_large")  # fmt: skip
                return False
            return True

        def _start_head_timer(self) -> None:
            self._head_timer = self.loop.call_later(config.header_timeout_s, self._head_late)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request is being answered: the head came in time
            self._refuse(408, f"no complete request within {config.header_timeout_s:g} s "
                         "(header_timeout_s)", "header_timeout")  # fmt: skip

        def _refuse(self, status: int, message: str, why: str) -> None:
            self._refused = True
            self._stop_head_timer()
            closed.labels(why).inc()
            log.info("closing a connection from %s: %s", (self.client or ("-",))[0], message)
            body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                         "param": None, "code": why}}).encode()  # fmt: skip
            head = (
                b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n" % (status, _REASONS[status], len(body))
            )
            if status == 503:
                head += b"retry-after: 1\r\n"
            if not self.transport.is_closing():
                self.transport.write(head + b"\r\n" + body)
                self.transport.close()

    return Protocol


def uvicorn_options(state: State) -> dict[str, Any]:
    """What ``uvicorn.Config`` takes from ``state.config``: the protocol above, the idle timeout."""
    protocol = protocol_for(state)
    options: dict[str, Any] = {"timeout_keep_alive": state.config.idle_timeout_s}
    if protocol is not None:
        options["http"] = protocol
    return options
