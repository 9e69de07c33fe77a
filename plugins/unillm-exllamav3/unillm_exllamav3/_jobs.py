"""The job runner over exllamav3's ``Generator``, on a ``unillm.backend.StepWorker`` thread.

The generator is not thread-safe: only the worker touches it. Callers hand it jobs and read their
jobs' streaming result dicts from their own queue, so any number of threads or asyncio tasks
generate at once and each ``iterate()`` advances all of their jobs together (continuous
batching). A caller that stops early has its job cancelled at the next step, which frees its cache
pages. A job that exllamav3 (1.6) fails alone (its prompt's forward pass raised: an ``error``
result) ends its caller's stream with that exception, and the others carry on; a step that raises
fails them all (``StepWorker``). Other threads read the generator's state with ``call``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from unillm.backend import StepWorker

__all__ = ["JobRunner", "job_done"]


def job_done(r: dict[str, Any]) -> bool:
    """A job's result dict that ends the job (``StepWorker.events``' ``last``)."""
    return bool(r["eos"])


class JobRunner(StepWorker):
    """A ``Generator`` on a worker thread; ``submit(job)`` returns the job's ``Live``, whose
    events are the job's streaming result dicts (the last with ``eos`` set)."""

    thread_name = "unillm-exllamav3-jobs"
    gather_s = 0.002  # requests sent together start as one batch

    def __init__(self, generator: Any) -> None:
        super().__init__()
        self._gen = generator
        self._start()

    def _add(self, payload: Any) -> int:
        return int(self._gen.enqueue(payload))

    def _remove(self, live: Any) -> None:
        self._gen.cancel(live.payload)

    def _step(self) -> Iterable[tuple[int, Any, bool]]:
        out: list[tuple[int, Any, bool]] = []
        for r in self._gen.iterate():
            if r["stage"] == "streaming":
                out.append((r["serial"], r, bool(r["eos"])))
            elif r["stage"] == "error":  # the job was dropped with its pages: raise it to its caller
                out.append((r["serial"], r["error"], True))
        return out

    def _reset(self) -> None:
        self._gen.clear_queue()

    def _shutdown(self) -> None:
        self._gen.clear_queue()
        close = getattr(self._gen, "close", None)  # exllamav3 1.6: frees its host buffers and pools
        if close is not None:
            close()
        self._gen = None  # let the generator, its cache and its GPU memory go
