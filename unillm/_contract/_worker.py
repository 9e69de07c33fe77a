"""A worker thread that owns an engine object which is not thread-safe (mlx-lm's
``BatchGenerator``, exllamav2's dynamic generator) and serves many callers through it.

Callers ``submit`` a request and read its events from their own queue; the worker adds requests,
advances the engine one step at a time (each step serves every request in flight: continuous
batching) and routes each step's events to their callers. A caller that stops early ``cancel``s
and its request leaves the engine at the next step. A step that raises fails the requests in
flight (the engine's state is suspect) and the worker carries on with a reset engine.

Other threads never touch the engine: they ``call`` a function, which the worker runs between
two steps. A lock shared with the worker would not do: the worker takes it again straight after
each step, and Python's locks are not fair, so a reader could wait out a whole generation.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

from unillm._errors import EngineClosed

__all__ = ["Live", "StepWorker"]

T = TypeVar("T")
#: the longest a worker waking from idle waits for more arrivals (see ``StepWorker.gather_s``)
GATHER_MAX_S = 0.02


class Live:
    """One request inside a worker: what was submitted, its key in the engine once added, and
    the queue its events (or the exception that ended it) arrive on."""

    __slots__ = ("events", "key", "payload")

    def __init__(self, payload: Any) -> None:
        self.payload = payload
        self.key: int | None = None
        self.events: queue.SimpleQueue[Any] = queue.SimpleQueue()


class StepWorker:
    """Base of the engine workers. Subclasses say how to add, remove and step; only the worker
    thread touches the engine (other threads read its state through ``call``)."""

    thread_name = "unillm-worker"
    #: Waking from idle, keep taking arrivals while each comes within this many seconds of the
    #: last (at most ``GATHER_MAX_S``), so that requests sent together start as one batch rather
    #: than one and then the rest; 0 starts at the first.
    gather_s: float = 0.0

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[int, Live] = {}
        self._closed = False
        self._ident: int | None = None  # the worker thread, once it runs
        self._finished = threading.Event()

    def _start(self) -> None:
        """Run the worker loop on a thread of its own (a subclass may reuse a pooled thread)."""
        threading.Thread(target=self._serve, name=self.thread_name, daemon=True).start()

    def _serve(self) -> None:
        self._ident = threading.get_ident()
        try:
            self._run()
        finally:
            self._finished.set()

    # ---- what a subclass implements (called on the worker thread) ----

    def _add(self, payload: Any) -> int:
        """Put a request into the engine; return its key there."""
        raise NotImplementedError

    def _remove(self, live: Live) -> None:
        """Take a request that is still in flight out of the engine."""
        raise NotImplementedError

    def _step(self) -> Iterable[tuple[int, Any, bool]]:
        """Advance the engine one step: ``(key, event, is_last)`` for each request it served."""
        raise NotImplementedError

    def _reset(self) -> None:
        """Drop everything in flight after a failed step."""

    def _shutdown(self) -> None:
        """Release the engine at close; by default, as after a failed step."""
        self._reset()

    # ---- called from any thread ----

    def submit(self, payload: Any) -> Live:
        if self._closed:
            raise EngineClosed("the engine is closed")
        live = Live(payload)
        self._inbox.put(("add", live))
        self._wake.set()
        return live

    def cancel(self, live: Live) -> None:
        """Drop a request whose caller no longer reads it (a no-op once it has finished)."""
        self._inbox.put(("remove", live))
        self._wake.set()

    def events(self, live: Live, last: Callable[[Any], bool]) -> Iterator[Any]:
        """The caller's side: ``live``'s events as they arrive, up to and including the one
        ``last`` says ends the request. An exception event (a failed step, a closed worker) is
        raised; a caller that stops reading first (a broken stream, a cancelled task) cancels the
        request, which leaves the engine at the next step."""
        finished = False
        try:
            while True:
                event = live.events.get()
                if isinstance(event, BaseException):
                    finished = True
                    raise event
                finished = last(event)
                yield event
                if finished:
                    return
        finally:
            if not finished:
                self.cancel(live)

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the worker thread before its next step and return what it returns (or
        raise what it raises). It waits for at most the step in progress, however busy the engine
        is. Raises ``EngineClosed`` once the worker has stopped."""
        if threading.get_ident() == self._ident:
            return fn()
        if self._closed:
            raise EngineClosed("the engine is closed")
        done: Future[T] = Future()
        self._inbox.put(("call", (fn, done)))
        self._wake.set()
        while not wait_futures([done], timeout=0.5).done:
            if self._finished.is_set() and not done.done():
                raise EngineClosed("the engine was closed before it could answer")
        return done.result()

    @property
    def stopped(self) -> bool:
        """The worker loop has ended (after close)."""
        return self._finished.is_set()

    def wait_stopped(self, timeout: float | None = None) -> bool:
        return self._finished.wait(timeout)

    @property
    def active(self) -> int:
        """Requests in the engine now."""
        return len(self._live)

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if threading.get_ident() != self._ident:
            self._finished.wait(timeout=30)

    # ---- the worker thread ----

    def _run(self) -> None:
        while not self._closed:
            self._drain()
            if not self._live:
                self._wake.wait()
                self._wake.clear()
                if self.gather_s:
                    self._gather()
                continue
            try:
                events = list(self._step())
            except Exception as exc:
                self._reset()
                for failed in self._live.values():
                    failed.events.put(exc)
                self._live.clear()
                continue
            for key, event, last in events:
                target = self._live.get(key)
                if target is None:
                    continue
                target.events.put(event)
                if last:
                    del self._live[key]
        self._shutdown()
        self._drain_after_close()
        for orphan in self._live.values():
            orphan.events.put(EngineClosed("the engine was closed while this request ran"))
        self._live.clear()

    def _gather(self) -> None:
        deadline = time.perf_counter() + GATHER_MAX_S
        while time.perf_counter() < deadline and self._wake.wait(self.gather_s):
            self._wake.clear()

    def _inbox_items(self) -> Iterator[tuple[str, Any]]:
        """What callers sent, until the inbox is empty."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain(self) -> None:
        for kind, item in self._inbox_items():
            if kind == "call":
                fn, done = item
                if done.set_running_or_notify_cancel():
                    try:
                        done.set_result(fn())
                    except BaseException as exc:  # handed to the caller, who raises it
                        done.set_exception(exc)
                continue
            live: Live = item
            if kind == "remove":
                if live.key is not None and self._live.pop(live.key, None) is not None:
                    self._remove(live)
                continue
            try:
                live.key = self._add(live.payload)
            except Exception as exc:
                live.events.put(exc)
                continue
            self._live[live.key] = live

    def _drain_after_close(self) -> None:
        """Answer what arrived while the worker stopped, so that no caller waits on it."""
        closed = "the engine was closed before it could answer"
        for kind, item in self._inbox_items():
            if kind == "call":
                item[1].set_exception(EngineClosed(closed))
            elif kind == "add":
                item.events.put(EngineClosed(closed))
