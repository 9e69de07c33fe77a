"""The step worker under the batching engines (exllamav2, mlx-lm): reads from other threads are
answered between two steps, however busy the engine is, and nothing waits on a closed worker."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import pytest

from unillm._contract._worker import Live, StepWorker
from unillm._errors import EngineClosed


class Counter(StepWorker):
    """Each request counts up, one per step (``step_s`` of simulated work), until it reaches its
    limit (``None``: never) or is removed."""

    def __init__(self, step_s: float = 0.002) -> None:
        super().__init__()
        self.step_s = step_s
        self.counts: dict[int, int] = {}
        self.limits: dict[int, int | None] = {}
        self.steps = 0
        self._next = 0
        self._start()

    def _add(self, payload: Any) -> int:
        self._next += 1
        self.counts[self._next], self.limits[self._next] = 0, payload
        return self._next

    def _remove(self, live: Live) -> None:
        assert live.key is not None
        del self.counts[live.key]

    def _step(self) -> Iterable[tuple[int, Any, bool]]:
        time.sleep(self.step_s)
        self.steps += 1
        out = []
        for key in list(self.counts):
            self.counts[key] += 1
            last = self.counts[key] == self.limits[key]
            out.append((key, self.counts[key], last))
            if last:
                del self.counts[key]
        return out

    def _reset(self) -> None:
        self.counts.clear()


def test_a_read_is_answered_while_a_request_runs_on() -> None:
    w = Counter()
    live = w.submit(None)  # runs until it is cancelled
    assert live.events.get() == 1
    for _ in range(20):
        # answered between two steps: the request is still in the engine, at a later count
        steps, counts = w.call(lambda: (w.steps, dict(w.counts)))
        assert steps >= 1 and counts == {live.key: steps}
    assert w.call(lambda: threading.current_thread().name) == Counter.thread_name
    w.cancel(live)
    assert w.call(lambda: dict(w.counts)) == {}
    w.close()


def test_a_read_on_an_idle_worker_wakes_it() -> None:
    w = Counter()
    assert w.call(lambda: w.steps) == 0
    live = w.submit(3)
    assert [live.events.get() for _ in range(3)] == [1, 2, 3]
    assert w.call(lambda: (w.steps, w.counts)) == (3, {})
    w.close()


def test_what_a_read_raises_reaches_the_caller_and_the_worker_carries_on() -> None:
    w = Counter()

    def broken() -> None:
        raise ValueError("bad read")

    with pytest.raises(ValueError, match="bad read"):
        w.call(broken)
    live = w.submit(2)
    assert [live.events.get() for _ in range(2)] == [1, 2]
    w.close()


def test_a_failed_step_fails_its_requests_and_the_worker_serves_the_next() -> None:
    w = Counter()
    real = w._step
    w._step = lambda: (_ for _ in ()).throw(RuntimeError("step failed"))  # type: ignore[method-assign]
    live = w.submit(5)
    err = live.events.get()
    assert isinstance(err, RuntimeError) and str(err) == "step failed"
    w._step = real  # type: ignore[method-assign]
    assert w.call(lambda: w.counts) == {}  # the engine was reset
    again = w.submit(1)
    assert again.events.get() == 1
    w.close()


def test_a_closed_worker_refuses_reads_and_requests_and_ends_those_in_flight() -> None:
    w = Counter()
    running = w.submit(None)
    assert running.events.get() == 1
    w.close()
    assert w.stopped
    # the request in flight ends with EngineClosed (after any events already queued)
    events = []
    while not isinstance(event := running.events.get(), BaseException):
        events.append(event)
    assert isinstance(event, EngineClosed)
    assert events == list(range(2, 2 + len(events)))
    with pytest.raises(EngineClosed):
        w.call(lambda: w.steps)
    with pytest.raises(EngineClosed):
        w.submit(1)


def test_what_arrives_while_the_worker_stops_is_answered() -> None:
    w = Counter()
    w._closed = True  # as close() does, before the worker's loop has seen it
    read: Future[int] = Future()
    w._inbox.put(("call", (lambda: 1, read)))  # a read and a request that raced the close
    late = Live(1)
    w._inbox.put(("add", late))
    w._wake.set()
    w.wait_stopped(timeout=10)
    assert w.stopped
    assert isinstance(read.exception(timeout=0), EngineClosed)
    assert isinstance(late.events.get(timeout=0), EngineClosed)


class Gathering(Counter):
    gather_s = 0.05  # capped by GATHER_MAX_S

    def __init__(self) -> None:
        self.first_step_size: int | None = None
        super().__init__()

    def _step(self) -> Iterable[tuple[int, Any, bool]]:
        if self.first_step_size is None:
            self.first_step_size = len(self.counts)
        return super()._step()


def test_requests_sent_together_start_in_one_step_when_the_worker_gathers() -> None:
    w = Gathering()
    lives = []
    for _ in range(4):  # a millisecond apart: each well within gather_s of the last
        lives.append(w.submit(3))
        time.sleep(0.001)
    assert [[lv.events.get() for _ in range(3)] for lv in lives] == [[1, 2, 3]] * 4
    assert w.first_step_size == 4
    w.close()
