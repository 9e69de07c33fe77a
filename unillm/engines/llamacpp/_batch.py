"""Continuous batching for the llama.cpp backend, through llama-cpp-python's low-level API.

One context holds ``parallel`` sequences in a unified KV cache (``n_seq_max``, ``kv_unified``):
every step is one ``llama_decode`` over a batch holding the next token of each sequence that is
decoding and, in the room left under ``n_batch``, chunks of the prompts still being prefilled, so a
long prompt shares steps with the running streams instead of stalling them. Each sequence samples
from its own row of the step's logits with its own sampler chain (seed, penalties, bias, format),
so its tokens do not depend on what else is in the batch; a finished or cancelled sequence frees
its cells at once.

The context is driven from the worker thread only: llama.cpp's CPU build runs OpenMP, and every OS
thread that calls ``llama_decode`` gets a pool of worker threads of its own (two pools halve the
decode rate). Requests wait for a free sequence when all ``parallel`` are running.

Prefix cache: the cells of recently finished sequences are kept (an LRU bounded in tokens by
``keep_tokens`` and by the ``parallel`` spare sequence ids, evicted first when the cache runs out of
cells), and a new request that shares a prefix with a running or kept sequence copies those cells
(``llama_memory_seq_cp``) instead of computing them again, taking a kept sequence over when that
is where its prefix is. Kept cells are not free: in the unified cache every step's attention spans
every occupied cell, so on the bench model eight streams ran at 0.7x with eight finished sequences
kept beside them (measured); hence the token bound.

Used by ``unillm.engines.llamacpp`` only; it does not import that module.
"""

from __future__ import annotations

import ctypes
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from unillm.backend import Live, StepWorker, TopLogprobs, logprobs_from_logits, shared_prefix

__all__ = ["Batcher", "Job", "context_params", "finished", "llama_logprobs"]

#: What a request's stream gets per step: ``(token or None, logprobs or None, finish reason or None)``.
Event = tuple[int | None, Any, Literal["stop", "length"] | None]


def finished(event: Event) -> bool:
    """The event that ends a request's stream (its finish reason is set)."""
    return event[2] is not None


def llama_logprobs(ctx: Any, n_vocab: int, tok: int, k: int) -> tuple[float, ...] | TopLogprobs:
    """One token's logprobs from a llama.cpp context's last raw logits (``get_logits_ith(-1)``),
    which the sampler chain's penalties, bias and temperature never touch (they work on a copy)."""
    import numpy as np

    return logprobs_from_logits(np.ctypeslib.as_array(ctx.get_logits_ith(-1), shape=(n_vocab,)), tok, k)


@dataclass
class Job:
    """A request as the worker runs it: prompt ids, its sampler chain (the worker owns and frees
    it from here on), the ids that end it, how many tokens it may generate, its logprobs."""

    ids: list[int]
    sampler: Any
    stop_ids: frozenset[int]
    max_tokens: int
    logprobs: int | None
    on_start: Callable[[int], None] | None = None  # told the cached prompt tokens when it starts


class _Seq:
    __slots__ = ("job", "key", "last", "n", "pos", "seq", "todo", "tokens")

    def __init__(self, key: int, job: Job) -> None:
        self.key = key
        self.job = job
        self.seq = -1  # llama.cpp's sequence id, once it has one
        self.pos = 0  # cells it holds (positions 0 .. pos-1)
        self.todo: list[int] = []  # prompt tokens not yet evaluated
        self.tokens: list[int] = []  # what its cells hold, for prefix reuse
        self.last = -1  # the token sampled last, evaluated at the next step
        self.n = 0  # tokens generated


class Batcher(StepWorker):
    """A llama.cpp context of ``parallel`` sequences on a worker thread."""

    thread_name = "unillm-llamacpp-batcher"
    gather_s = 0.002  # requests sent together start in the same step

    def __init__(
        self,
        llama_cpp: Any,
        model: Any,
        params: Any,
        *,
        parallel: int,
        keep_tokens: int,
        n_batch: int,
        n_vocab: int,
        decode_error: Callable[[Exception], Exception],
    ) -> None:
        from llama_cpp._internals import LlamaContext

        super().__init__()
        self._lc = llama_cpp
        self.parallel = parallel
        self._keep_tokens = keep_tokens
        # a step never holds more tokens than the context takes at once (past it llama.cpp aborts)
        self._n_batch = min(n_batch, params.n_batch)
        self._n_vocab = n_vocab
        self._decode_error = decode_error
        self._ctx = LlamaContext(model=model, params=params, verbose=False)
        self._mem = llama_cpp.llama_get_memory(self._ctx.ctx)
        self._batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)  # room for any step
        self._free = self._all_ids()
        self._running: dict[int, _Seq] = {}
        self._waiting: deque[_Seq] = deque()
        self._kept: OrderedDict[int, list[int]] = OrderedDict()  # seq id -> tokens its cells hold
        self._kept_cells = 0
        self._keys = itertools.count()
        self.queries = 0  # prompt tokens asked for, and those found in the cache
        self.hits = 0
        self._start()

    # ---- numbers (read from any thread; each is one attribute read) ----

    @property
    def used_cells(self) -> int:
        running = sum(s.pos for s in list(self._running.values()))
        return running + self._kept_cells

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def sequence_tokens(self) -> tuple[int, ...]:
        """The cells each running sequence holds."""
        return tuple(s.pos for s in list(self._running.values()))

    # ---- the worker thread ----

    def _add(self, payload: Any) -> int:
        s = _Seq(next(self._keys), payload)
        self._waiting.append(s)
        return s.key

    def _remove(self, live: Live) -> None:
        s = self._running.pop(live.key, None) if live.key is not None else None
        if s is not None:
            self._release(s, keep=False)
            return
        for w in list(self._waiting):
            if w.key == live.key:
                self._waiting.remove(w)
                w.job.sampler.close()

    def _admit(self) -> None:
        """Give waiting requests a sequence, reusing the longest prefix the cache holds."""
        while self._waiting and len(self._running) < self.parallel:
            s = self._waiting.popleft()
            ids = s.job.ids
            src, cached = -1, 0
            for seq, tokens in [*self._kept.items(), *((r.seq, r.tokens) for r in self._running.values())]:
                n = shared_prefix(tokens, ids)
                if n > cached:
                    src, cached = seq, n
            if src in self._kept:  # a finished sequence's cells: take them over
                self._kept_cells -= len(self._kept.pop(src))
                s.seq = src
                self._lc.llama_memory_seq_rm(self._mem, src, cached, -1)
            else:
                s.seq = self._free_id()
                if cached:
                    self._lc.llama_memory_seq_cp(self._mem, src, s.seq, 0, cached)
            s.pos = cached
            s.tokens = list(ids[:cached])
            s.todo = list(ids[cached:])
            self.queries += len(ids)
            self.hits += cached
            if s.job.on_start is not None:
                s.job.on_start(cached)
            self._running[s.key] = s

    def _free_id(self) -> int:
        if not self._free:
            self._evict()  # the kept sequences hold every spare id: drop the oldest
        return self._free.popleft()

    def _evict(self) -> bool:
        if not self._kept:
            return False
        seq, tokens = self._kept.popitem(last=False)
        self._kept_cells -= len(tokens)
        self._lc.llama_memory_seq_rm(self._mem, seq, -1, -1)
        self._free.append(seq)
        return True

    def _release(self, s: _Seq, *, keep: bool) -> None:
        s.job.sampler.close()
        if keep and 0 < len(s.tokens) <= self._keep_tokens:
            self._kept[s.seq] = s.tokens
            self._kept_cells += len(s.tokens)
            while self._kept_cells > self._keep_tokens:
                self._evict()  # the least recently used first
            return
        self._lc.llama_memory_seq_rm(self._mem, s.seq, -1, -1)
        self._free.append(s.seq)

    def _step(self) -> Iterable[tuple[int, Any, bool]]:
        self._admit()
        b = self._batch
        b.n_tokens = 0
        rows: list[tuple[_Seq, int]] = []
        budget = self._n_batch
        for s in self._running.values():  # decoding first: one token each
            if not s.todo and s.last >= 0:
                rows.append((s, self._put(s.last, s, True)))
                s.tokens.append(s.last)
                budget -= 1
        fed = False
        for s in self._running.values():  # then prompt chunks in the room left
            room = budget if budget > 0 or fed else 1  # a step full of decoding still reads a prompt token
            if not s.todo or room <= 0:
                continue
            chunk, s.todo = s.todo[:room], s.todo[room:]
            fed = True
            for j, tok in enumerate(chunk):
                i = self._put(tok, s, not s.todo and j == len(chunk) - 1)
            s.tokens.extend(chunk)
            budget -= len(chunk)
            if not s.todo:
                rows.append((s, i))
        if b.n_tokens == 0:
            return []
        self._decode()
        events: list[tuple[int, Any, bool]] = []
        for s, i in rows:
            job = s.job
            tok = job.sampler.sample(self._ctx, i)
            lp = None if job.logprobs is None else self._row_logprobs(i, tok, job.logprobs)
            if tok in job.stop_ids:
                del self._running[s.key]
                self._release(s, keep=True)
                events.append((s.key, (None, None, "stop"), True))
                continue
            s.n += 1
            s.last = tok
            done = s.n >= job.max_tokens
            events.append((s.key, (tok, lp, "length" if done else None), done))
            if done:
                del self._running[s.key]
                self._release(s, keep=True)
        return events

    def _row_logprobs(self, i: int, tok: int, k: int) -> tuple[float, ...] | TopLogprobs:
        """A sequence's logprobs from its row ``i`` of the step's raw logits (the sampler chain
        works on a copy: penalties, bias and temperature never touch them)."""
        import numpy as np

        row = np.ctypeslib.as_array(self._ctx.get_logits_ith(i), shape=(self._n_vocab,))
        return logprobs_from_logits(row, tok, k)

    def _put(self, tok: int, s: _Seq, logits: bool) -> int:
        b = self._batch
        i = b.n_tokens
        b.token[i] = tok
        b.pos[i] = s.pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = s.seq
        b.logits[i] = logits
        b.n_tokens = i + 1
        s.pos += 1
        return i

    def _decode(self) -> None:
        while True:
            rc = self._lc.llama_decode(self._ctx.ctx, self._batch)
            if rc == 1 and self._evict():  # no room for the batch: drop a kept prefix and retry
                continue
            if rc != 0:
                raise self._decode_error(RuntimeError(f"llama_decode returned {rc}"))
            return

    def _all_ids(self) -> deque[int]:
        """Every sequence id the context has, all free."""
        return deque(range(self._ctx.params.n_seq_max))

    def _reset(self) -> None:
        for s in [*self._running.values(), *self._waiting]:
            s.job.sampler.close()
        self._running.clear()
        self._waiting.clear()
        self._kept.clear()
        self._kept_cells = 0
        self._lc.llama_memory_clear(self._mem, True)
        self._free = self._all_ids()

    def clear(self) -> None:
        """Drop the kept prefixes (on the worker thread, between steps)."""

        def drop() -> None:
            while self._evict():
                pass

        self.call(drop)

    def _shutdown(self) -> None:
        self._reset()
        self._lc.llama_batch_free(self._batch)
        self._ctx.close()


def context_params(llama_cpp: Any, base: Any, *, n_ctx: int, n_seq: int, n_batch: int, n_ubatch: int) -> Any:
    """A copy of ``base`` (the ``Llama`` object's context parameters: threads, KV type, flash
    attention) for ``n_seq`` sequences sharing ``n_ctx`` cells, ``n_batch`` tokens a step. The batch
    sizes are set here, not copied: llama-cpp-python caps the ``Llama``'s at its own (small)
    context, and a step of more tokens than the context's ``n_batch`` aborts the process, as does a
    context whose ``n_batch`` is below ``n_seq`` (its output buffer is sized by it). The steps
    themselves keep to the ``n_batch`` asked, but for one token per running sequence."""
    params = llama_cpp.llama_context_params()
    ctypes.memmove(ctypes.byref(params), ctypes.byref(base), ctypes.sizeof(params))
    params.n_ctx = n_ctx
    params.n_seq_max = n_seq
    params.kv_unified = True
    params.n_batch = max(n_batch, n_seq)
    params.n_ubatch = min(n_ubatch, params.n_batch)
    return params
