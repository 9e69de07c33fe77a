"""An engine's lifetime: the gate every call into the engine passes, so ``close()`` from any
thread never frees the engine under a step in progress, and the one-at-a-time lock.

``Engine`` inherits ``Lifetime``; a backend never calls these itself. ``guarded`` wraps the public
methods a backend writes (``tokenize``, ``detokenize``, ``kv_stats``, ``reset``) the same way.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

from unillm._contract._checks import check_text, check_token_ids
from unillm._errors import EngineClosed, GenerationError
from unillm._types import Capabilities

__all__ = ["GUARDED", "Lifetime", "guarded"]

# How long close() waits for another thread's step in progress before leaving the free to it.
_CLOSE_WAIT_S = 30.0
# Public methods a backend writes that touch the engine: the base class guards them (EngineClosed
# on a closed engine, and close() never frees the engine under them), for plugins too.
GUARDED = ("tokenize", "detokenize", "kv_stats", "reset")


class Lifetime:
    """Loaded or not, threads inside, streams to clean up; ``close()`` and the gate."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]  # an Engine sets its own per instance (capabilities_for)
    vocab_size: int | None

    def __init__(self) -> None:
        self._loaded = False
        self._ever_loaded = False
        self._busy_lock = threading.Lock()
        self._busy_owner: int | None = None
        # Threads inside the engine right now, and the suspended streams whose clean-up must run
        # before the engine is freed.
        self._gate = threading.Lock()
        self._inside = 0
        self._freed = threading.Event()
        self._freed.set()
        self._streams: weakref.WeakSet[Any] = weakref.WeakSet()

    if TYPE_CHECKING:

        def _close(self) -> None: ...  # the backend's (Engine._close)

    def close(self) -> None:
        """Free the model and its memory. Safe to call twice, and from any thread.

        Streams still open end with ``EngineClosed`` at their next step; none touches freed
        memory. A one-at-a-time engine is freed once no thread is inside it (close() waits up to
        ``_CLOSE_WAIT_S`` for a step in progress on another thread, else the last thread out frees
        it); a batching engine's worker ends the requests in flight itself.
        """
        with self._gate:
            if not self._loaded:
                return
            self._loaded = False
            now = self._inside == 0 or self.capabilities.batching
        if now:
            self._free()
        else:
            self._freed.wait(_CLOSE_WAIT_S)

    def _free(self) -> None:
        """Run the suspended streams' clean-up, then release the engine (once)."""
        with self._gate:
            if self._freed.is_set():
                return
            self._freed.set()
        if not self.capabilities.batching:
            for raw in list(self._streams):
                with contextlib.suppress(Exception):
                    raw.close()
        self._close()

    def _enter(self) -> None:
        """Count this thread inside the engine; EngineClosed when it is closed or not loaded."""
        with self._gate:
            if not self._loaded:
                raise self._closed_error()
            self._inside += 1

    def _leave(self) -> None:
        with self._gate:
            self._inside -= 1
            last = self._inside == 0 and not self._loaded and not self._freed.is_set()
        if last:
            self._free()

    def _closed_error(self) -> EngineClosed:
        if self._freed.is_set() and not self._ever_loaded:
            return EngineClosed(f"{self.name}: call load() (or use `with`) before using the engine")
        return EngineClosed(f"{self.name}: the engine is closed; load() it again or open a new one")

    @property
    def loaded(self) -> bool:
        return self._loaded

    @contextmanager
    def _busy(self) -> Iterator[None]:
        if self.capabilities.batching:
            yield
            return
        me = threading.get_ident()
        if self._busy_owner == me:
            raise GenerationError(
                f"{self.name} runs one sequence at a time and this thread already has a stream "
                "open on it; finish or close() that stream first"
            )
        with self._busy_lock:
            self._busy_owner = me
            try:
                yield
            finally:
                self._busy_owner = None

    def _close_raw(self, raw: Any, gated: bool) -> None:
        """Close a backend's raw stream (its clean-up may use the engine) unless the engine was
        freed already, in which case close() ran that clean-up before freeing it."""
        close = getattr(raw, "close", None)  # a generator; a plain iterator has nothing to close
        if close is None:
            return
        if not gated:
            close()
            return
        with self._gate:
            if self._freed.is_set():
                return
            self._inside += 1
        try:
            close()
        finally:
            self._leave()


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a public method a backend writes) behind the engine's lifetime gate, its
    arguments checked the way every backend needs: text must be text, ids ids of the vocabulary."""
    name = fn.__name__

    @functools.wraps(fn)
    def gate(self: Lifetime, *args: Any, **kwargs: Any) -> Any:
        if name == "tokenize" and args:
            check_text(args[0], "tokenize() takes")
        elif name == "detokenize" and args:
            args = (check_token_ids(args[0], self.vocab_size), *args[1:])
        self._enter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self._leave()

    gate._unillm_guarded = True  # type: ignore[attr-defined]
    return gate
