"""What the vLLM backend runs beside vLLM: the event loop that owns the engine, the capture of the
engine processes' output into logging, and the stat logger that keeps vLLM's own KV-cache numbers.

vLLM's ``AsyncLLM`` binds its output handler to the event loop it first runs on, so the backend
gives it a loop of its own on a daemon thread. Sync callers (any thread) and async callers (any
loop) reach it from there: the first through a thread-safe queue, the second by a wake-up of their
own loop, one per engine step rather than one per request. When the loading code names the loop
that will consume the streams (``unillm.backend.host_loop``: ``unillm serve`` does), the engine
runs on that loop instead, as vLLM's own server runs it, and its streams there need no hop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import select
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from unillm import ConfigError

__all__ = ["EngineLoop", "KVNumbers", "OutputCapture", "stat_logger_factory"]

T = TypeVar("T")
engine_log = logging.getLogger("unillm.vllm.engine")


class EngineLoop:
    """An asyncio loop where the ``AsyncLLM`` lives and its requests run: a loop of its own on a
    daemon thread, or ``host``, a loop the application runs (then nothing here starts or stops
    it, and ``stop()`` cancels only the requests submitted through this object)."""

    def __init__(self, host: asyncio.AbstractEventLoop | None = None) -> None:
        self.hosted = host is not None
        self._tasks: set[asyncio.Task[Any]] = set()  # hosted: the requests in flight, for stop()
        self._thread: threading.Thread | None = None
        if host is not None:
            self.loop = host
            return
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="unillm-vllm-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def on_loop(self) -> bool:
        """Whether the caller runs on this loop's own thread (where waiting for it would hang)."""
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def refuse_blocking(self) -> None:
        """ConfigError on the loop's own thread, where a blocking call would wait for itself."""
        if self.on_loop():
            raise ConfigError(
                "this blocking call would wait for the event loop it runs on, which also runs the "
                "vLLM engine (loaded for this loop): use the async methods (astream, agenerate) "
                "here, or call it from another thread (asyncio.to_thread)"
            )

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (from any other thread)."""
        if self.on_loop():
            coro.close()
            self.refuse_blocking()
        return asyncio.run_coroutine_threadsafe(self._own(coro), self.loop).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Start ``coro`` on the loop; returns a future (``cancel()`` stops it), a task when the
        caller is on the loop already."""
        if self.on_loop():
            task = self.loop.create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return task
        return asyncio.run_coroutine_threadsafe(self._own(coro), self.loop)

    def _own(self, coro: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
        """``coro``, counted among this object's tasks where ``stop()`` needs them (hosted: on a
        loop of its own, ``stop()`` cancels every task there)."""
        return self._tracked(coro) if self.hosted else coro

    async def _tracked(self, coro: Coroutine[Any, Any, T]) -> T:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            return await coro
        finally:
            self._tasks.discard(task)

    def stop(self) -> None:
        if self.loop.is_closed():
            return

        async def _cancel_all() -> None:
            me = asyncio.current_task()
            tasks = list(self._tasks) if self.hosted else asyncio.all_tasks()
            tasks = [t for t in tasks if t is not me]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.on_loop():  # hosted, closed from its own loop: cancel without waiting
            for t in list(self._tasks):
                t.cancel()
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(10)
        if self._thread is None:
            return  # the host's loop: its owner stops it
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


# ---- KV-cache numbers, from vLLM's own scheduler stats ----


@dataclass
class KVNumbers:
    """The latest scheduler reading and the prefix-cache totals since load."""

    usage: float = 0.0
    running: int = 0
    waiting: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    readings: int = 0


def stat_logger_factory(numbers: KVNumbers) -> Callable[..., Any]:
    """A vLLM stat-logger factory whose loggers write into ``numbers`` (imports vLLM)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Recorder(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is None:
                return
            numbers.usage = float(scheduler_stats.kv_cache_usage)
            numbers.running = int(scheduler_stats.num_running_reqs)
            numbers.waiting = int(scheduler_stats.num_waiting_reqs)
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None:
                if prefix.reset:
                    numbers.prefix_queries = numbers.prefix_hits = 0
                numbers.prefix_queries += int(prefix.queries)
                numbers.prefix_hits += int(prefix.hits)
            numbers.readings += 1

        def log_engine_initialized(self) -> None:
            pass

    return _Recorder


# ---- the engine processes' output, into logging ----


class OutputCapture:
    """Sends what vLLM and its engine processes print to the ``unillm.vllm.engine`` logger.

    vLLM starts its engine core (and workers) as child processes that print to the stdout and
    stderr they inherit. While ``redirect()`` is active, file descriptors 1 and 2 point into a pipe,
    so the processes started then write there for as long as they live; a reader thread turns each
    line into a DEBUG record, whatever level the line names: vLLM's warnings (a missing tcmalloc,
    Triton, each worker's weight-loading lines) are about vLLM, not about the caller's program,
    and what matters from them reaches the caller as the cause lines of a typed error. The last
    lines are kept for those error messages. Lines read while the redirect is on are held and logged after it
    ends: a log handler writing to stderr then would write into the pipe it is draining.
    """

    def __init__(self, keep: int = 400) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self._held: list[tuple[int, str]] | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._read_fd, self._write_fd = os.pipe()
        self._reader = threading.Thread(target=self._read, name="unillm-vllm-output", daemon=True)
        self._reader.start()

    @contextlib.contextmanager
    def redirect(self) -> Iterator[None]:
        import sys

        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        saved = [os.dup(1), os.dup(2)]
        with self._lock:
            self._held = []
        try:
            os.dup2(self._write_fd, 1)
            os.dup2(self._write_fd, 2)
            yield
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            with self._lock:
                held, self._held = self._held or [], None
            for level, line in held:
                engine_log.log(level, "%s", line)

    def release(self) -> None:
        """Close this process's end of the pipe (the engine processes keep theirs)."""
        if self._write_fd >= 0:
            os.close(self._write_fd)
            self._write_fd = -1

    def stop(self, timeout: float = 2.0) -> None:
        """Stop reading once the pipe is drained (processes that outlive the engine, such as
        multiprocessing's resource tracker, may hold it open until exit)."""
        self.release()
        self._stopping.set()
        self._reader.join(timeout)

    def tail(self, n: int = 12, *, matching: str | None = None) -> list[str]:
        lines = list(self.lines)
        if matching is not None:
            pattern = re.compile(matching, re.IGNORECASE)
            lines = [ln for ln in lines if pattern.search(ln)]
        return lines[-n:]

    def _read(self) -> None:
        with os.fdopen(self._read_fd, "rb", buffering=0) as pipe:
            pending = b""
            while True:
                ready, _, _ = select.select([pipe], [], [], 0.2)
                if not ready:
                    if self._stopping.is_set():
                        break
                    continue
                data = pipe.read(65536)
                if not data:
                    break
                pending += data
                *complete, pending = re.split(rb"[\r\n]", pending)
                for raw in complete:
                    self._emit(raw)
            if pending:
                self._emit(pending)

    def _emit(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip()
        if not line:
            return
        with self._lock:
            self.lines.append(line)
            if self._held is not None:
                self._held.append((logging.DEBUG, line))
                return
        engine_log.debug("%s", line)
