"""A worker thread that owns an engine object which is not thread-safe (mlx-lm's
``BatchGenerator``, exllamav2's dynamic generator) and serves many callers through it.

Callers ``submit`` a request and read its events from their own queue; the worker adds requests,
advances the engine one step at a time (each step serves every request in flight: continuous
batching) and routes each step's events to their callers. A caller that stops early ``cancel``s
and its request leaves the engine at the next step. A step that raises fails the requests in
flight (the engine's state is suspect) and the worker carries on with a reset engine.

An async caller ``asubmit``s on its event loop and reads with ``aevents``: the worker hands that
request's events to the loop through the loop's ``Mailbox``, one wake-up per step for all the
requests the loop has in flight, with no thread of the caller's own in between.

Other threads never touch the engine: they ``call`` a function, which the worker runs between
two steps. A lock shared with the worker would not do: the worker takes it again straight after
each step, and Python's locks are not fair, so a reader could wait out a whole generation.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

from unillm._errors import EngineClosed

__all__ = ["Live", "Mailbox", "Mailboxes", "StepWorker"]

T = TypeVar("T")
#: the longest a worker waking from idle waits for more arrivals (see ``StepWorker.gather_s``)
GATHER_MAX_S = 0.02


class Mailbox:
    """Hands items from another thread to one consumer event loop.

    Items posted while a delivery is pending ride along with it, so the consumer loop wakes once
    per engine step however many of its requests produced something in that step.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: list[tuple[asyncio.Queue[Any], Any]] = []
        self._lock = threading.Lock()

    def post(self, to: asyncio.Queue[Any], item: Any) -> None:
        with self._lock:
            self._items.append((to, item))
            if len(self._items) > 1:
                return  # a delivery is already scheduled
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            with self._lock:
                self._items.clear()

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for to, item in items:
            to.put_nowait(item)


class Mailboxes:
    """One ``Mailbox`` per consumer loop, made on first use (forgotten with the loop)."""

    def __init__(self) -> None:
        self._boxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def of(self, loop: asyncio.AbstractEventLoop) -> Mailbox:
        with self._lock:
            box = self._boxes.get(loop)
            if box is None:
                box = self._boxes[loop] = Mailbox(loop)
            return box


class Live:
    """One request inside a worker: what was submitted, its key in the engine once added, and
    where its events (or the exception that ended it) go: a thread-safe queue for a sync caller,
    an ``asyncio.Queue`` reached through the caller loop's mailbox for an async one."""

    __slots__ = ("events", "key", "payload", "post")

    def __init__(self, payload: Any, mailbox: Mailbox | None = None) -> None:
        self.payload = payload
        self.key: int | None = None
        self.events: Any = queue.SimpleQueue() if mailbox is None else asyncio.Queue()
        self.post = None if mailbox is None else mailbox.post

    def put(self, item: Any) -> None:
        """Hand ``item`` to the caller (from the worker thread)."""
        if self.post is None:
            self.events.put(item)
        else:
            self.post(self.events, item)


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
        self._mailboxes = Mailboxes()

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
        """Send a request from a sync caller; read it with ``events``."""
        return self._send(Live(payload))

    def asubmit(self, payload: Any) -> Live:
        """Send a request from a coroutine on the running loop; read it with ``aevents``."""
        return self._send(Live(payload, self._mailboxes.of(asyncio.get_running_loop())))

    def _send(self, live: Live) -> Live:
        if self._closed:
            raise EngineClosed("the engine is closed")
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

    async def aevents(self, live: Live, last: Callable[[Any], bool]) -> AsyncIterator[Any]:
        """``events`` for a request sent with ``asubmit``, on its loop."""
        finished = False
        try:
            while True:
                event = await live.events.get()
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
                    failed.put(exc)
                self._live.clear()
                continue
            for key, event, last in events:
                target = self._live.get(key)
                if target is None:
                    continue
                target.put(event)
                if last:
                    del self._live[key]
        self._shutdown()
        self._drain_after_close()
        for orphan in self._live.values():
            orphan.put(EngineClosed("the engine was closed while this request ran"))
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
                live.put(exc)
                continue
            self._live[live.key] = live

    def _drain_after_close(self) -> None:
        """Answer what arrived while the worker stopped, so that no caller waits on it."""
        closed = "the engine was closed before it could answer"
        for kind, item in self._inbox_items():
            if kind == "call":
                item[1].set_exception(EngineClosed(closed))
            elif kind == "add":
                item.put(EngineClosed(closed))
