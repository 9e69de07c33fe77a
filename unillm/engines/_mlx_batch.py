"""Continuous batching for the MLX backend, over mlx-lm's ``BatchGenerator``.

One worker thread owns the ``BatchGenerator`` (it is not thread-safe): callers hand it requests
through an inbox and read their tokens from their own queue, so any number of threads or asyncio
tasks generate at once and every decode step serves all of them together. A caller that stops
early (a broken stream, a cancelled task) has its sequence removed at the next step.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["Batcher", "Live"]


class Live:
    """One request inside the batcher: its uid there and the queue its responses arrive on."""

    __slots__ = ("events", "uid")

    def __init__(self) -> None:
        self.uid: int | None = None
        self.events: queue.SimpleQueue[Any] = queue.SimpleQueue()


class Batcher:
    """Runs a ``BatchGenerator`` on a worker thread and routes its responses to the callers."""

    def __init__(
        self,
        model: Any,
        eos_ids: Sequence[int],
        *,
        batch_size: int,
        prefill_step_size: int,
        max_kv_size: int | None,
    ) -> None:
        from mlx_lm.generate import BatchGenerator, StopSequences

        def make() -> Any:
            return BatchGenerator(
                model,
                completion_batch_size=batch_size,
                prefill_batch_size=min(batch_size, 8),
                prefill_step_size=prefill_step_size,
                max_kv_size=max_kv_size,
            )

        self._make = make
        self._gen = make()
        self._stop_at_eos = StopSequences([[e] for e in eos_ids])
        self._no_stop = StopSequences(None)
        self._inbox: queue.SimpleQueue[tuple[str, Live, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[int, Live] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="unillm-mlx-batcher", daemon=True)
        self._thread.start()

    # ---- called from any thread ----

    def submit(
        self,
        prompt: list[int],
        *,
        max_tokens: int,
        sampler: Any,
        processors: list[Any] | None,
        ignore_eos: bool,
        cache: list[Any] | None = None,
        history: list[int] | None = None,
    ) -> Live:
        """Queue a request; its ``GenerationBatch.Response``s (or an exception) arrive on
        ``live.events``, the last one with a ``finish_reason``."""
        live = Live()
        args = (prompt, max_tokens, sampler, processors, ignore_eos, cache, history)
        self._inbox.put(("insert", live, args))
        self._wake.set()
        return live

    def cancel(self, live: Live) -> None:
        """Drop a request that its caller no longer reads."""
        self._inbox.put(("remove", live, None))
        self._wake.set()

    @property
    def active(self) -> int:
        return len(self._live)

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=30)

    # ---- the worker thread ----

    def _run(self) -> None:
        while not self._closed:
            self._drain()
            if not self._live:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                responses = self._gen.next_generated()
            except Exception as exc:  # the batch is unusable: fail its requests, start afresh
                for failed in self._live.values():
                    failed.events.put(exc)
                self._live.clear()
                self._gen = self._make()
                continue
            for r in responses:
                target = self._live.get(r.uid)
                if target is None:
                    continue
                target.events.put(r)
                if r.finish_reason is not None:
                    del self._live[r.uid]
        for orphan in self._live.values():
            orphan.events.put(RuntimeError("the engine was closed"))

    def _drain(self) -> None:
        gen = self._gen
        while True:
            try:
                kind, live, args = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "remove":
                if live.uid is not None and self._live.pop(live.uid, None) is not None:
                    gen.remove([live.uid])
                continue
            prompt, max_tokens, sampler, processors, ignore_eos, cache, history = args
            try:
                (uid,) = gen.insert(
                    [prompt],
                    max_tokens=[max_tokens],
                    caches=[cache] if cache is not None else None,
                    all_tokens=[history] if history else None,
                    samplers=[sampler],
                    logits_processors=[processors or []],
                    stop_sequences=[self._no_stop if ignore_eos else self._stop_at_eos],
                )
            except Exception as exc:
                live.events.put(exc)
                continue
            live.uid = uid
            self._live[uid] = live
