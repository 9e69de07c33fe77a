"""Continuous batching for the MLX backend, over mlx-lm's ``BatchGenerator``.

The generator runs on a ``StepWorker`` thread (it is not thread-safe): any number of threads or
asyncio tasks generate at once and every decode step serves all of them together. A caller that
stops early (a broken stream, a cancelled task) has its sequence removed at the next step. The
caches of recently finished sequences are kept (``KeptCache``) for the next requests that share
a prefix with them. Used by ``unillm.engines.mlx`` only; it does not import that module.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from unillm.backend import Live, StepWorker, shared_prefix
from unillm.engines.mlx._model import cache_offset

__all__ = ["Batcher", "KeptCache", "Live", "finished"]


class _ThreadPool:
    """Daemon threads that run one job after another and wait, idle, for the next. Unlike
    ``ThreadPoolExecutor``'s, they are never joined at exit: a thread that ends while the
    interpreter shuts down takes MLX's stream with it and aborts the process."""

    def __init__(self) -> None:
        self._idle: queue.SimpleQueue[queue.SimpleQueue[Callable[[], None]]] = queue.SimpleQueue()

    def submit(self, job: Callable[[], None]) -> None:
        try:
            inbox = self._idle.get_nowait()
        except queue.Empty:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._work, args=(inbox,), name="unillm-mlx-worker", daemon=True).start()
        inbox.put(job)

    def _work(self, inbox: queue.SimpleQueue[Callable[[], None]]) -> None:
        while True:
            job = inbox.get()
            try:
                job()
            finally:
                self._idle.put(inbox)


# One thread per engine open at the same time, reused by the engines that come after.
_POOL = _ThreadPool()


class Batcher(StepWorker):
    """A ``BatchGenerator`` on a worker thread; events are ``GenerationBatch.Response``s."""

    thread_name = "unillm-mlx-batcher"
    # mlx-lm prefills up to prefill_batch_size of the prompts that wait at a step together;
    # where that is more than one (a GPU), prompts sent together should start together
    gather_s = 0.002

    def __init__(
        self,
        model: Any,
        eos_ids: Sequence[int],
        *,
        batch_size: int,
        prefill_batch_size: int | None,
        prefill_step_size: int,
        max_kv_size: int | None,
    ) -> None:
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator, StopSequences

        super().__init__()
        if prefill_batch_size is None:
            # Prefill is compute-bound on a CPU: eight prompts of 40-49 tokens prefilled together
            # took 1.87 s, one of 40 alone 0.22-0.24 s (the bench model, 2 cores), so together
            # they only make the first wait for the last. On a GPU a batch costs little more.
            on_cpu = mx.default_device().type == mx.DeviceType.cpu
            prefill_batch_size = 1 if on_cpu else min(batch_size, 8)

        def make() -> Any:
            return BatchGenerator(
                model,
                completion_batch_size=batch_size,
                prefill_batch_size=prefill_batch_size,
                prefill_step_size=prefill_step_size,
                max_kv_size=max_kv_size,
            )

        self._make = make
        self._gen = make()
        self._stop_at_eos = StopSequences([[e] for e in eos_ids])
        self._no_stop = StopSequences(None)
        self._start()

    def _start(self) -> None:
        # mlx-lm generates on a thread-local stream, and MLX never frees a thread's stream (nor
        # the native threads behind it) when the thread ends: a new worker thread per engine
        # leaked two native threads per load/close cycle. Workers reuse pooled threads instead.
        _POOL.submit(self._serve)

    def submit_prompt(
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
        """Queue a request; its responses (or an exception) arrive on ``live.events``, the last
        one with a ``finish_reason``."""
        return self.submit((prompt, max_tokens, sampler, processors, ignore_eos, cache, history))

    def _add(self, payload: Any) -> int:
        prompt, max_tokens, sampler, processors, ignore_eos, cache, history = payload
        (uid,) = self._gen.insert(
            [prompt],
            max_tokens=[max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[history] if history else None,
            samplers=[sampler],
            logits_processors=[processors or []],
            stop_sequences=[self._no_stop if ignore_eos else self._stop_at_eos],
        )
        return int(uid)

    def _remove(self, live: Live) -> None:
        self._gen.remove([live.key])

    def _step(self) -> Iterable[tuple[int, Any, bool]]:
        return [(r.uid, r, r.finish_reason is not None) for r in self._gen.next_generated()]

    def _reset(self) -> None:
        self._gen = self._make()

    def _shutdown(self) -> None:
        self._gen = None


def finished(r: Any) -> bool:
    """A ``BatchGenerator`` response that ends its sequence."""
    return r.finish_reason is not None


class KeptCache:
    """Batched mode's prefix reuse: the prompt caches of recently finished sequences, with the
    tokens each holds, kept for the next requests. A request takes the one sharing the longest
    prefix with it and trims it to that prefix (a sequence's cache serves one request at a time);
    the others stay for requests that share more with them.

    Several users at once each leave a sequence behind, so one kept cache would serve only the
    last of them (mlx_lm.server keeps several too). The kept caches together hold at most
    ``budget_tokens`` (one context's worth: the memory a single kept cache could already take)
    and ``max_entries`` entries; the least recently kept go first.
    """

    def __init__(
        self, cache_mod: Any, *, enabled: bool, budget_tokens: int | None = None, max_entries: int = 8
    ) -> None:
        self._mod = cache_mod  # mlx_lm.models.cache
        self._enabled = enabled and max_entries > 0
        self._budget = budget_tokens
        self._max = max_entries
        self._lock = threading.Lock()
        self._kept: list[tuple[list[Any], list[int], int]] = []  # (cache, tokens, held), oldest first

    def keep(self, r: Any) -> None:
        """Keep a finished sequence's cache (a ``GenerationBatch.Response``'s) if it can be trimmed."""
        cache = r.prompt_cache
        if not (self._enabled and cache and self._mod.can_trim_prompt_cache(cache)):
            return
        tokens = list(r.all_tokens or [])
        held = cache_offset(cache) or 0
        if held == 0 or (self._budget is not None and held > self._budget):
            return
        with self._lock:
            # an entry whose tokens this one extends can serve nobody this one cannot
            kept = [e for e in self._kept if e[1][: e[2]] != tokens[: e[2]]]
            kept.append((cache, tokens, held))
            while len(kept) > self._max or (
                self._budget is not None and sum(e[2] for e in kept) > self._budget
            ):
                kept.pop(0)
            self._kept = kept

    def take(self, ids: list[int]) -> tuple[list[Any] | None, int]:
        """The kept cache sharing the longest prefix with ``ids``, trimmed to it, and that prefix's
        length; ``(None, 0)`` when none shares anything (they all stay kept)."""
        with self._lock:
            best, share = -1, 0
            for i, (_, tokens, held) in enumerate(self._kept):
                n = shared_prefix(tokens[:held], ids)
                if n > share:
                    best, share = i, n
            if best < 0:
                return None, 0
            cache, _, held = self._kept.pop(best)
        if held - share > 0:
            self._mod.trim_prompt_cache(cache, held - share)
        return cache, share

    @property
    def tokens(self) -> int:
        """Tokens the kept caches hold."""
        return sum(e[2] for e in self._kept)

    def clear(self) -> None:
        with self._lock:
            self._kept = []
