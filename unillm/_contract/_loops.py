"""The event loop an application will consume an engine's async streams on, when the code loading
the engine says so.

A backend whose engine is asyncio-native (vLLM's ``AsyncLLM``) runs it on a loop of its own by
default, so that sync callers on any thread and async callers on any loop all reach it; each token
then crosses from that loop's thread to the caller's. An application that consumes every stream on
one loop (``unillm serve``) loads its engines inside ``host_loop_for(loop)``; such a backend reads
``host_loop()`` at load and runs its engine on that loop instead, which saves the hop.
``asyncio.to_thread`` copies the context, so a load sent to a thread from the loop still sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["host_loop", "host_loop_for"]

_HOST: ContextVar[asyncio.AbstractEventLoop | None] = ContextVar("unillm_host_loop", default=None)


def host_loop() -> asyncio.AbstractEventLoop | None:
    """The loop that will consume the streams of engines loaded now, or None (nobody said)."""
    return _HOST.get()


@contextlib.contextmanager
def host_loop_for(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """Engines loaded inside this block (on this thread, or in a copy of its context) may run on
    ``loop``. Their sync methods must then not be called on ``loop``'s own thread."""
    token = _HOST.set(loop)
    try:
        yield
    finally:
        _HOST.reset(token)
