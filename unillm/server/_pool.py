"""The served models: loading (eager or on first request), admission, idle unloading, eviction.

Every alias has an ``Admission``: ``running`` requests generate at once (1 for an engine that runs
one sequence at a time, the server's ``max_running`` for a batching one), the rest wait in arrival
order, at most ``max_queue`` of them; one more gets ``Busy`` (429 with Retry-After), so the queue
never grows without bound. Loading runs on a thread, so the event loop keeps answering meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from unillm._contract._loops import host_loop_for
from unillm._errors import UnillmError

if TYPE_CHECKING:
    from unillm._contract._engine import Engine
    from unillm._types import EngineConfig
    from unillm.server._config import ModelSpec, ServerConfig

__all__ = ["Admission", "Busy", "Pool", "ShuttingDown", "Slot", "UnknownModel"]

log = logging.getLogger("unillm.server")


#: The concurrency a served model's engine is loaded for when its table sets none: what the
#: selector plans and chooses for, and the sequences an engine that batches by it (llama.cpp's
#: ``parallel``) decodes together; requests past it wait in the engine, up to max_running.
SERVED_SEQUENCES = 8


def served_config(spec: ModelSpec, server: ServerConfig) -> EngineConfig:
    """The engine config a served model loads with: its table's, and when the table sets no
    ``concurrency``, the users a server expects at once (``SERVED_SEQUENCES``, at most its
    ``max_running``). One rule for ``unillm serve``'s loads at start and the pool's on demand."""
    config = spec.engine
    if config.concurrency is None:
        running = spec.max_running or server.max_running
        config = config.model_copy(update={"concurrency": min(running, SERVED_SEQUENCES)})
    return config


class UnknownModel(UnillmError, LookupError):
    """A request named a model that is not one of the server's aliases."""

    def __init__(self, name: str, aliases: list[str]) -> None:
        self.name = name
        served = ", ".join(aliases)
        if "/" in name or "\\" in name:  # never echo a path back, nor look it up
            super().__init__(f"`model` names models by alias, not by path; this server serves: {served}")
            return
        shown = name if len(name) <= 80 else name[:80] + "..."
        super().__init__(f"the model {shown!r} does not exist; this server serves: {served}")


class Busy(UnillmError):
    """Too many requests wait for a model (or no model can be unloaded to make room): retry later."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(message)


class ShuttingDown(UnillmError):
    """The server is shutting down: a request that waits or arrives now is answered 503."""

    def __init__(self) -> None:
        super().__init__(
            "the server is shutting down; retry in a moment (on another instance, or once it is back)"
        )


class Admission:
    """At most ``running`` requests at once; up to ``queue`` more wait in arrival order."""

    def __init__(self, running: int, queue: int) -> None:
        self.limit = running
        self.queue = queue
        self.running = 0
        self.waiting = 0
        self._free = asyncio.Semaphore(running)
        self._closed = asyncio.Event()  # set when the server is shutting down

    def close(self) -> None:
        """The server is shutting down: the requests waiting, and any that come, get a 503."""
        self._closed.set()

    @contextlib.asynccontextmanager
    async def slot(self, alias: str) -> AsyncIterator[None]:
        if self._closed.is_set():
            raise ShuttingDown()
        if self._free.locked() and self.waiting >= self.queue:
            raise Busy(
                f"{alias!r} has {self.running} requests running and {self.waiting} waiting (the most "
                "this server queues); retry after a moment"
            )
        self.waiting += 1
        try:
            if not self._free.locked():
                await self._free.acquire()
            else:
                await self._wait()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._free.release()

    async def _wait(self) -> None:
        """Wait for a free place in arrival order, or for the shutdown (then a 503)."""
        acquire = asyncio.ensure_future(self._free.acquire())
        closed = asyncio.ensure_future(self._closed.wait())
        try:
            await asyncio.wait((acquire, closed), return_when=asyncio.FIRST_COMPLETED)
            if self._closed.is_set():
                raise ShuttingDown()
        except BaseException:  # cancelled (the client left) or refused: give back a place taken
            if acquire.done() and not acquire.cancelled():
                self._free.release()
            acquire.cancel()
            raise
        finally:
            closed.cancel()

    @property
    def in_use(self) -> int:
        return self.running + self.waiting


class Slot:
    """One alias: its spec, its engine when loaded, and its admission."""

    def __init__(self, spec: ModelSpec, server: ServerConfig) -> None:
        self.spec = spec
        self.alias = spec.alias
        self.engine: Engine[Any] | None = None
        self.backend: str | None = None  # once loaded: the backend that serves it
        self.last_used = 0.0
        self.admission: Admission | None = None
        self.loads = 0  # how many times it was loaded (a reload after TTL counts again)
        # requests holding its engine, from the hand-out to their end: it is never unloaded
        # under them (admission counts them only once they reach the queue)
        self.pins = 0
        self._server = server
        self._loading = asyncio.Lock()

    @property
    def loaded(self) -> bool:
        return self.engine is not None and self.engine.loaded

    @property
    def busy(self) -> bool:
        return self.pins > 0 or (self.admission is not None and self.admission.in_use > 0)

    def _admission_for(self, engine: Engine[Any]) -> Admission:
        running = (self.spec.max_running or self._server.max_running) if engine.capabilities.batching else 1
        queue = self.spec.max_queue if self.spec.max_queue is not None else self._server.max_queue
        return Admission(running, queue)


class Pool:
    """The aliases a server serves, loaded on start or on demand."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        loader: Callable[[Any], Engine[Any]] | None = None,
        fits: Callable[[ModelSpec], bool] | None = None,
    ) -> None:
        self.config = config
        self.slots = {spec.alias: Slot(spec, config) for spec in config.models}
        self._loader = loader or _load
        self._fits = fits or _fits_now
        # held while a model makes room and loads: one that is loading counts against max_loaded
        # (and the memory plan) before it is loaded, so two never load into the same room
        self._placing = asyncio.Lock()
        self._closed = False

    @property
    def aliases(self) -> list[str]:
        return list(self.slots)

    def slot(self, alias: str) -> Slot:
        found = self.slots.get(alias) if isinstance(alias, str) else None
        if found is None:
            raise UnknownModel(str(alias), self.aliases)
        return found

    @property
    def ready(self) -> bool:
        """Every model that loads at start has loaded (lazy ones count as ready, and so does one
        unloaded after its TTL: it loads again on demand)."""
        return self.config.lazy or all(s.loads > 0 for s in self.slots.values())

    def adopt(self, alias: str, engine: Engine[Any]) -> None:
        """Serve an engine loaded elsewhere (the CLI loads before it starts listening)."""
        slot = self.slot(alias)
        self._installed(slot, engine)

    def _installed(self, slot: Slot, engine: Engine[Any]) -> None:
        slot.engine = engine
        slot.backend = engine.name
        slot.admission = slot._admission_for(engine)
        slot.last_used = time.monotonic()
        slot.loads += 1

    async def engine(self, alias: str) -> tuple[Slot, Engine[Any]]:
        """The loaded engine of ``alias``, loading it first if it is not (other models may be
        unloaded to make room: the least recently used, idle ones)."""
        slot = self.slot(alias)
        engine = slot.engine
        if engine is None or not engine.loaded:
            async with slot._loading:
                if slot.engine is None or not slot.engine.loaded:
                    async with self._placing:
                        await self._make_room(slot)
                        await self._load(slot)
            engine = slot.engine
            assert engine is not None
        slot.last_used = time.monotonic()
        return slot, engine

    async def load_all(self) -> None:
        """Load every model that is not lazy, one after another."""
        for slot in self.slots.values():
            if not slot.loaded:
                async with slot._loading:
                    if not slot.loaded:
                        await self._load(slot)

    async def _load(self, slot: Slot) -> None:
        if self._closed:
            raise Busy("the server is shutting down", retry_after_s=5)
        started = time.perf_counter()
        log.info("loading %s (%s)", slot.alias, slot.spec.engine.backend or "auto")
        # an engine that can run on this loop does (host_loop_for: vLLM), saving a hop a token
        with host_loop_for(asyncio.get_running_loop()):
            engine = await asyncio.to_thread(self._loader, served_config(slot.spec, self.config))
        self._installed(slot, engine)
        log.info("loaded %s on %s in %.1f s", slot.alias, engine.name, time.perf_counter() - started)

    async def _make_room(self, slot: Slot) -> None:
        """Unload idle models, least recently used first, until ``slot`` may load: under
        ``max_loaded``, and (when others are loaded) the memory plan says it fits."""
        while True:
            loaded = [s for s in self.slots.values() if s.loaded and s is not slot]
            over = self.config.max_loaded is not None and len(loaded) >= self.config.max_loaded
            if not over and (not loaded or await asyncio.to_thread(self._fits, slot.spec)):
                return
            idle = sorted((s for s in loaded if not s.busy), key=lambda s: s.last_used)
            if not idle:
                why = f"{len(loaded)} models are loaded (max_loaded)" if over else "it does not fit"
                raise Busy(f"cannot load {slot.alias!r} now: {why} and all are busy; retry later", 5)
            await self.unload(idle[0], why="to make room for " + slot.alias)

    async def unload(self, slot: Slot, *, why: str) -> None:
        engine, slot.engine = slot.engine, None
        if engine is not None:
            log.info("unloading %s (%s)", slot.alias, why)
            await asyncio.to_thread(engine.close)

    async def reap_idle(self, now: float | None = None) -> list[str]:
        """Unload the models idle longer than the TTL; the names unloaded."""
        ttl = self.config.ttl_s
        if ttl is None:
            return []
        now = time.monotonic() if now is None else now
        gone = []
        for slot in self.slots.values():
            if slot.loaded and not slot.busy and now - slot.last_used >= ttl:
                await self.unload(slot, why=f"idle for {ttl:g} s")
                gone.append(slot.alias)
        return gone

    async def reaper(self) -> None:
        """Run ``reap_idle`` every quarter TTL (at most every 30 s) until cancelled."""
        ttl = self.config.ttl_s
        if ttl is None:
            return
        while True:
            await asyncio.sleep(min(ttl / 4, 30.0))
            try:
                await self.reap_idle()
            except Exception:  # one engine failing to close must not end the reaper
                log.exception("unloading an idle model failed")

    async def close(self) -> None:
        self._closed = True
        for slot in self.slots.values():
            await self.unload(slot, why="shutdown")


def _load(config: Any) -> Engine[Any]:
    from unillm._choose._auto import load_engine

    return load_engine(config)


def _fits_now(spec: ModelSpec) -> bool:
    """Whether the memory plan says ``spec``'s model fits in what this machine has free now.
    A model unillm cannot size counts as fitting: the load itself then decides."""
    from unillm._choose._auto import workload_for
    from unillm._choose._registry import default_registry
    from unillm._hardware import detect_hardware
    from unillm._plan._estimate import plan

    try:
        info = default_registry().inspect_model(spec.engine.model)
        workload = workload_for(spec.engine.model_copy(update={"concurrency": 1}), info)
        return plan(info, detect_hardware(), workload).fits
    except UnillmError:
        return True
