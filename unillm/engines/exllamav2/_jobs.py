"""The ExLlamaV2 backend's job runner, over exllamav2's ``ExLlamaV2DynamicGenerator``.

The generator runs on a ``StepWorker`` thread (it is not thread-safe): callers hand it jobs and
read their jobs' result dicts from their own queue, so any number of threads or asyncio tasks
generate at once and every ``iterate()`` advances all of their jobs together. A caller that stops
early (a broken stream, a cancelled task) has its job cancelled at the next step, which frees its
cache pages. Read the generator's state from another thread with ``call``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from unillm.backend import Live, StepWorker

__all__ = ["JobRunner", "Live", "job_done"]


def job_done(r: dict[str, Any]) -> bool:
    """A job's result dict that ends the job (``StepWorker.events``' ``last``)."""
    return bool(r["eos"])


class JobRunner(StepWorker):
    """A dynamic generator on a worker thread; ``submit(job)`` returns the job's ``Live``, whose
    events are the job's streaming result dicts (the last with ``eos`` set)."""

    thread_name = "unillm-exllamav2-jobs"

    def __init__(self, generator: Any) -> None:
        super().__init__()
        self._gen = generator
        self._start()

    def _add(self, payload: Any) -> int:
        return int(self._gen.enqueue(payload))

    def _remove(self, live: Live) -> None:
        self._gen.cancel(live.payload)

    def _step(self) -> Iterable[tuple[int, Any, bool]]:
        return [(r["serial"], r, bool(r["eos"])) for r in self._gen.iterate() if r["stage"] == "streaming"]

    def _reset(self) -> None:
        self._gen.clear_queue()

    def _shutdown(self) -> None:
        self._gen.clear_queue()
        self._gen = None  # let the generator, its cache and its GPU memory go
