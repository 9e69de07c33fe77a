"""The Engine base class: the contract every backend implements.

A backend writes a handful of small methods (``_load``, ``_encode``, ``_stream``, ``_close`` and
the tokenizer pair); everything a user calls is derived here once: ``stream`` wraps ``_stream``
with parameter validation, stop strings, max-token accounting, usage and timings; ``generate`` is a
fold over ``stream``; ``chat`` renders the chat template and streams; the async methods mirror the
sync ones through a worker thread. Backends that cannot batch are serialized by a lock, so callers
from many threads (or asyncio tasks) never interleave inside the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from time import perf_counter
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from unillm._errors import (
    ConfigError,
    EngineClosed,
    GenerationError,
    UnillmError,
    UnillmWarning,
    UnsupportedParameter,
    warn,
)
from unillm._stop import StopMatcher
from unillm._types import (
    Availability,
    Capabilities,
    ChatMessage,
    Chunk,
    Completion,
    EngineConfig,
    FinishReason,
    KVStats,
    SamplingParams,
    Suitability,
    Timings,
    Usage,
)

if TYPE_CHECKING:
    from typing_extensions import Self

    from unillm._auto import Selection

__all__ = ["Engine", "NoOptions", "Request", "UnillmWarning"]

Prompt = str | Sequence[int]
Messages = Sequence[ChatMessage | Mapping[str, Any]]
P = TypeVar("P")


class NoOptions(BaseModel):
    """A backend without load options."""

    model_config = ConfigDict(extra="forbid")


class Request:
    """Per-request bookkeeping a backend's ``_stream`` fills in as it learns things.

    ``prompt_tokens`` must be set; the rest are optional. ``prefill_s``/``decode_s`` come from the
    engine's own counters when it has them (otherwise unillm's wall clock is used).
    """

    __slots__ = (
        "cached_tokens",
        "decode_s",
        "finish_reason",
        "peak_memory_bytes",
        "prefill_s",
        "prompt_tokens",
        "queue_s",
    )

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.cached_tokens: int | None = None
        self.finish_reason: FinishReason | None = None
        self.prefill_s: float | None = None
        self.decode_s: float | None = None
        self.peak_memory_bytes: int | None = None
        self.queue_s: float | None = None


RawPiece = tuple[str, tuple[int, ...], "tuple[float, ...] | None"]
# Sampling parameters the base class honours for every backend.
_BASE_HANDLED = frozenset({"max_tokens", "stop"})
# How long close() waits for another thread's step in progress before leaving the free to it.
_CLOSE_WAIT_S = 30.0
# Public methods a backend writes that touch the engine: the base class guards them (EngineClosed
# on a closed engine, and close() never frees the engine under them), for plugins too.
_GUARDED = ("tokenize", "detokenize", "kv_stats", "reset")


class Engine(Generic[P]):
    """Base class of every backend. Subclass it, fill the class data, write ``_stream``.

    Class data a backend declares:

    - ``name``: the backend's registry name (``"llama.cpp"``).
    - ``formats``: model formats it reads (``{"gguf"}``).
    - ``capabilities``: what it can do, including the sampling parameters it honours.
    - ``Options``: a pydantic model (``extra="forbid"``) of its load options.
    - ``install_hint``: the command that installs its engine.
    """

    name: ClassVar[str] = ""
    formats: ClassVar[frozenset[str]] = frozenset()
    capabilities: ClassVar[Capabilities] = Capabilities()
    Options: ClassVar[type[BaseModel]] = NoOptions
    install_hint: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in _GUARDED:
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "_unillm_guarded", False):
                setattr(cls, name, _guarded(fn))

    # ---- discovery (class level, cheap: never imports the engine) ----

    @classmethod
    def available(cls) -> Availability:
        """Whether this backend can run here. Must not import the engine."""
        return Availability(True)

    @classmethod
    def suitability(cls, hardware: Any, model: Any, workload: Any) -> Suitability:
        """How well this backend fits; the default only checks the model format."""
        fmt = getattr(model, "format", None)
        if fmt in cls.formats:
            return Suitability(1.0, reasons=(f"reads {fmt}",))
        return Suitability(0.0, blockers=(f"does not read {fmt} (reads {', '.join(sorted(cls.formats))})",))

    # ---- lifecycle ----

    def __init__(self, config: EngineConfig | Mapping[str, Any] | None = None, /, **kwargs: Any):
        if config is None:
            config = EngineConfig(**kwargs)
        elif isinstance(config, Mapping):
            config = EngineConfig(**{**config, **kwargs})
        elif kwargs:
            config = EngineConfig(**{**config.model_dump(exclude_unset=True), **kwargs})
        self.config: EngineConfig = config
        self.options: P = self._validate_options(config.options_for(self.name))  # type: ignore[assignment]
        self.selection: Selection | None = None
        self._loaded = False
        self._ever_loaded = False
        self._busy_lock = threading.Lock()
        self._busy_owner: int | None = None
        # Lifetime (see close()): threads inside the engine right now, and the suspended streams
        # whose clean-up must run before the engine is freed.
        self._gate = threading.Lock()
        self._inside = 0
        self._freed = threading.Event()
        self._freed.set()
        self._streams: weakref.WeakSet[Any] = weakref.WeakSet()
        #: The end-of-sequence ids this engine stops on (unillm._eos); set by the backend at load.
        self.eos_token_ids: frozenset[int] = frozenset()

    @classmethod
    def _validate_options(cls, options: Mapping[str, Any]) -> BaseModel:
        try:
            return cls.Options(**options)
        except ValidationError as exc:
            known = ", ".join(cls.Options.model_fields) or "(none)"
            err = ConfigError.from_validation(exc, f"{cls.name} options")
            raise ConfigError(f"{err}\nvalid {cls.name} options: {known}") from exc

    def load(self) -> Self:
        """Load the model (the heavy import happens here). Returns the engine, loaded."""
        if not self._loaded:
            # a close() that waited out its bound frees the engine when the last thread leaves it
            self._freed.wait()
            self._load()
            self._freed.clear()
            self._loaded = self._ever_loaded = True
        return self

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

    def __enter__(self) -> Self:
        return self.load()

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    async def __aenter__(self) -> Self:
        return await asyncio.to_thread(self.load)

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "loaded" if self._loaded else "not loaded"
        return f"<{type(self).__name__} {self.name!r} model={self.config.model!r} {state}>"

    # ---- what a backend implements ----

    def _load(self) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        """Release the engine; the default drops nothing."""

    def _encode(self, prompt: Prompt, params: SamplingParams) -> Any:
        """Prepare a prompt before any engine work (tokenize, check the context); runs eagerly in
        ``stream()`` so bad prompts fail at the call, not at the first ``next()``."""
        return prompt

    def _stream(self, prepared: Any, params: SamplingParams, req: Request) -> Iterator[RawPiece]:
        """Yield ``(text_delta, token_ids, logprobs_or_None)`` per step; fill ``req``.

        Stop at EOS (``req.finish_reason = "stop"``) or at ``params.max_tokens``
        (``"length"``). When the consumer stops early, the generator is closed: clean up in a
        ``finally``. Stop strings and usage are handled by the caller.
        """
        raise NotImplementedError

    def _astream(self, prepared: Any, params: SamplingParams, req: Request) -> AsyncGenerator[RawPiece, None]:
        """Optional, for batching backends whose engine is asynchronous: ``_stream`` as an async
        generator, used by ``astream`` instead of a thread per request."""
        raise NotImplementedError

    def _native_async(self) -> bool:
        return self.capabilities.batching and type(self)._astream is not Engine._astream

    def _chat_template(self) -> str | None:
        """The model's own chat template, if it has one."""
        return None

    def _special_tokens(self) -> dict[str, str]:
        """Special token strings the chat template may use (``bos_token``, ``eos_token``)."""
        return {}

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` as this engine sees them (special tokens parsed)."""
        raise NotImplementedError(f"{self.name} does not expose its tokenizer")

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""
        raise NotImplementedError(f"{self.name} does not expose its tokenizer")

    def kv_stats(self) -> KVStats:
        """The KV cache now; fields the engine cannot tell are None."""
        return KVStats()

    def reset(self) -> None:
        """Empty the KV cache, so the next request evaluates its whole prompt. Default: no-op."""

    #: The vocabulary size, once loaded (backends set it): ids outside it are refused at the edge.
    vocab_size: int | None = None

    # ---- derived: what users call ----

    def stream(
        self, prompt: Prompt, params: SamplingParams | Mapping[str, Any] | None = None, **overrides: Any
    ) -> Iterator[Chunk]:
        """Stream a completion of ``prompt`` (text or token ids), one ``Chunk`` per step.

        The last chunk carries ``finish_reason``, ``usage`` and ``timings``. Breaking out of the
        loop stops generation at the next token and leaves the engine usable.
        """
        sp = self._params(params, overrides)
        t0 = perf_counter()
        prepared = self._prepare(prompt, sp)
        return self._drive(prepared, sp, t0)

    def generate(
        self, prompt: Prompt, params: SamplingParams | Mapping[str, Any] | None = None, **overrides: Any
    ) -> Completion:
        """The whole completion of ``prompt``: a fold over ``stream``."""
        return _fold(self.stream(prompt, params, **overrides))

    def render_chat(self, messages: Messages, *, add_generation_prompt: bool = True) -> str:
        """The prompt text ``messages`` become under the chat template (sandboxed Jinja)."""
        from unillm._chat import render_chat_template

        if isinstance(messages, (str, bytes, Mapping)) or not hasattr(messages, "__iter__"):
            raise ConfigError(
                f"chat() takes a list of messages, got {type(messages).__name__}; pass "
                "[{'role': 'user', 'content': '...'}]"
            )
        msgs = [ChatMessage.coerce(m) for m in messages]
        if not msgs:
            raise ConfigError("chat() needs at least one message")
        for m in msgs:
            check_text(m.content, "chat content must be")
        self._enter()
        try:
            template = self.config.chat_template or self._chat_template()
            special = self._special_tokens()
        finally:
            self._leave()
        if template is None:
            raise ConfigError(
                f"{self.config.model!r} has no chat template; pass chat_template='...' (a Jinja "
                "template) in the engine config, or use generate() with a plain prompt"
            )
        source = "the engine config's chat_template" if self.config.chat_template else self.config.model
        return render_chat_template(
            template, msgs, add_generation_prompt=add_generation_prompt, source=source, **special
        )

    def stream_chat(
        self, messages: Messages, params: SamplingParams | Mapping[str, Any] | None = None, **overrides: Any
    ) -> Iterator[Chunk]:
        """Stream the assistant's reply to ``messages``."""
        return self.stream(self.render_chat(messages), params, **overrides)

    def chat(
        self, messages: Messages, params: SamplingParams | Mapping[str, Any] | None = None, **overrides: Any
    ) -> Completion:
        """The assistant's whole reply to ``messages``."""
        return _fold(self.stream_chat(messages, params, **overrides))

    # ---- async mirrors: the sync path in a worker thread ----

    async def astream(
        self, prompt: Prompt, params: SamplingParams | Mapping[str, Any] | None = None, **overrides: Any
    ) -> AsyncIterator[Chunk]:
        """Async ``stream``. Cancelling the consuming task stops generation at the next token.

        A batching backend with a native ``_astream`` runs on the caller's event loop; any other
        runs its sync ``stream`` on a thread of its own.
        """
        if self._native_async():
            sp = self._params(params, overrides)
            t0 = perf_counter()
            async for chunk in self._adrive(self._prepare(prompt, sp), sp, t0):
                yield chunk
            return
        gen = await asyncio.to_thread(self.stream, prompt, params, **overrides)
        async for chunk in _iterate_in_thread(gen):
            yield chunk

    async def agenerate(
        self, prompt: Prompt, params: SamplingParams | Mapping[str, Any] | None = None, **overrides: Any
    ) -> Completion:
        """Async ``generate``."""
        return await _afold(self.astream(prompt, params, **overrides))

    async def astream_chat(
        self, messages: Messages, params: SamplingParams | Mapping[str, Any] | None = None, **overrides: Any
    ) -> AsyncIterator[Chunk]:
        """Async ``stream_chat``."""
        async for chunk in self.astream(self.render_chat(messages), params, **overrides):
            yield chunk

    async def achat(
        self, messages: Messages, params: SamplingParams | Mapping[str, Any] | None = None, **overrides: Any
    ) -> Completion:
        """Async ``chat``."""
        return await _afold(self.astream_chat(messages, params, **overrides))

    # ---- the shared machinery ----

    def _params(
        self, params: SamplingParams | Mapping[str, Any] | None, overrides: Mapping[str, Any]
    ) -> SamplingParams:
        if params is None:
            sp = SamplingParams(**overrides)
        elif isinstance(params, SamplingParams):
            sp = (
                params
                if not overrides
                else SamplingParams(**{**params.model_dump(exclude_unset=True), **overrides})
            )
        elif isinstance(params, Mapping):
            sp = SamplingParams(**{**params, **overrides})
        else:
            raise ConfigError(f"params must be SamplingParams or a dict, got {type(params).__name__}")
        vocab = self.vocab_size
        if vocab is not None:
            bad = [t for t in (*sp.stop_token_ids, *(sp.logit_bias or ())) if t >= vocab]
            if bad:
                raise ConfigError(
                    f"token ids {sorted(set(bad))[:5]} in stop_token_ids/logit_bias are outside "
                    f"the vocabulary of {self.config.model!r} (0..{vocab - 1})"
                )
        supported = self.capabilities.sampling
        unsupported = [n for n in sp.non_default() if n not in supported and n not in _BASE_HANDLED]
        if not unsupported:
            return sp
        policy = self.config.unsupported_params
        if policy == "strict":
            raise UnsupportedParameter(self.name, unsupported)
        if policy == "warn":
            warn(f"{self.name} ignores {', '.join(unsupported)} (unsupported_params='warn')")
        fields = SamplingParams.model_fields
        return sp.model_copy(update={n: fields[n].default for n in unsupported})

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

    def _prepare(self, prompt: Prompt, params: SamplingParams) -> Any:
        """Check the prompt's type and encode it (inside the gate: encoding uses the engine)."""
        if isinstance(prompt, str):
            check_text(prompt)
        elif not self.capabilities.token_prompts:
            raise ConfigError(f"{self.name} takes text prompts only, got {type(prompt).__name__}")
        else:
            prompt = check_token_ids(prompt, self.vocab_size)
        self._enter()
        try:
            return self._encode(prompt, params)
        finally:
            self._leave()

    def _drive(self, prepared: Any, params: SamplingParams, t0: float) -> Iterator[Chunk]:
        # The per-token path: keep it to a few attribute loads and one Chunk per step. t0 is the
        # call to stream(): TTFT includes tokenizing and any wait for a busy engine. Each step of
        # a one-at-a-time engine runs inside the lifetime gate, so close() from any thread never
        # frees the engine under it; a batching engine's worker does that job itself.
        with self._busy():
            req = Request()
            run = _Run(params)
            step = run.step
            gated = not self.capabilities.batching
            enter, leave = self._enter, self._leave
            raw = self._stream(prepared, params, req)
            self._streams.add(raw)
            try:
                while True:
                    if gated:
                        enter()
                        try:
                            piece = next(raw, None)
                        finally:
                            leave()
                    elif not self._loaded:
                        raise self._closed_error()
                    else:
                        piece = next(raw, None)
                    if piece is None:
                        break
                    chunk = step(*piece)
                    if chunk is None:
                        break
                    yield chunk
            except UnillmError:
                raise
            except Exception as exc:
                raise GenerationError(f"{self.name} failed while generating: {exc}") from exc
            finally:
                self._streams.discard(raw)
                self._close_raw(raw, gated)
            yield run.last(req, t0)

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

    async def _adrive(self, prepared: Any, params: SamplingParams, t0: float) -> AsyncIterator[Chunk]:
        """``_drive`` for a backend with a native ``_astream`` (batching engines only)."""
        req = Request()
        run = _Run(params)
        step = run.step
        raw = self._astream(prepared, params, req)
        try:
            async for text, ids, lp in raw:
                if not self._loaded:
                    raise self._closed_error()
                chunk = step(text, ids, lp)
                if chunk is None:
                    break
                yield chunk
        except UnillmError:
            raise
        except Exception as exc:
            raise GenerationError(f"{self.name} failed while generating: {exc}") from exc
        finally:
            await raw.aclose()
        yield run.last(req, t0)


class _Run:
    """One request's accounting between the backend's raw pieces and the user's chunks: stop
    strings, the max-token cut, the final chunk's usage and timings. Shared by both drivers."""

    __slots__ = ("finish", "first", "max_tokens", "n", "stops", "tail")

    def __init__(self, params: SamplingParams) -> None:
        self.first = 0.0
        self.n = 0
        self.max_tokens = params.max_tokens
        self.stops = StopMatcher(params.stop) if params.stop else None
        self.finish: FinishReason | None = None
        self.tail: RawPiece = ("", (), None)

    def step(self, text: str, ids: tuple[int, ...], lp: tuple[float, ...] | None) -> Chunk | None:
        """The chunk for one raw piece, or None when this piece ends the completion."""
        if not self.first:
            self.first = perf_counter()
        self.n += len(ids)
        stops = self.stops
        out = text if stops is None else stops.feed(text)
        if stops is not None and stops.stopped:
            self.finish, self.tail = "stop", (out, ids, lp)
            return None
        if self.n >= self.max_tokens:
            self.finish, self.tail = "length", (out, ids, lp)
            return None
        return Chunk(out, ids, None, None, None, lp)

    def last(self, req: Request, t0: float) -> Chunk:
        """The final chunk: what the cut held back, the finish reason, usage and timings."""
        end = perf_counter()
        text, ids, lp = self.tail
        if self.stops is not None and not self.stops.stopped:
            text += self.stops.flush()
        return Chunk(
            text,
            ids,
            self.finish or req.finish_reason or "stop",
            Usage(req.prompt_tokens, self.n, req.cached_tokens),
            _timings(req, t0, self.first or end, end, self.n),
            lp,
        )


def _timings(req: Request, t0: float, first: float, end: float, n: int) -> Timings:
    ttft = first - t0
    if req.prefill_s is not None and req.decode_s is not None:
        prefill, decode, source = req.prefill_s, req.decode_s, "engine"
    else:
        prefill, decode, source = ttft, end - first, "wall"
    cached = req.cached_tokens or 0
    evaluated = req.prompt_tokens - cached
    return Timings(
        ttft_s=ttft,
        prefill_s=prefill,
        decode_s=decode,
        total_s=end - t0,
        prefill_tokens_per_s=evaluated / prefill if prefill > 0 and evaluated > 0 else None,
        # the first token comes out of prefill; decode makes the other n - 1
        decode_tokens_per_s=(n - 1) / decode if decode > 0 and n > 1 else None,
        source=source,  # type: ignore[arg-type]
        peak_memory_bytes=req.peak_memory_bytes,
        queue_s=req.queue_s,
    )


def _fold(chunks: Iterator[Chunk]) -> Completion:
    parts: list[str] = []
    ids: list[int] = []
    lps: list[float] = []
    last: Chunk | None = None
    for last in chunks:
        parts.append(last.text)
        ids.extend(last.token_ids)
        if last.logprobs is not None:
            lps.extend(last.logprobs)
    return _completion(parts, ids, lps, last)


async def _afold(chunks: AsyncIterator[Chunk]) -> Completion:
    parts: list[str] = []
    ids: list[int] = []
    lps: list[float] = []
    last: Chunk | None = None
    async for last in chunks:
        parts.append(last.text)
        ids.extend(last.token_ids)
        if last.logprobs is not None:
            lps.extend(last.logprobs)
    return _completion(parts, ids, lps, last)


def _completion(parts: list[str], ids: list[int], lps: list[float], last: Chunk | None) -> Completion:
    if last is None or last.finish_reason is None or last.usage is None or last.timings is None:
        raise GenerationError("the stream ended without its final chunk")
    return Completion(
        "".join(parts), tuple(ids), last.finish_reason, last.usage, last.timings, tuple(lps) if lps else None
    )


_DONE = object()


async def _iterate_in_thread(gen: Iterator[Chunk]) -> AsyncIterator[Chunk]:
    """Run a sync chunk iterator in a worker thread, handing chunks to the event loop.

    When the consumer stops (cancelled, or breaks out), the worker is told to stop and closes the
    generator in its own thread at the next token, which releases the engine. Each stream has a
    thread of its own, not one of the loop's default executor (min(32, cores + 4) threads), which
    would queue concurrent requests to a batching engine behind one another.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    stop = threading.Event()

    def put(item: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is gone; nobody is listening
            stop.set()

    def work() -> None:
        try:
            for chunk in gen:
                if stop.is_set():
                    break
                put(chunk)
        except BaseException as exc:
            put(_Raised(exc))
        finally:
            gen.close()  # type: ignore[attr-defined]
            put(_DONE)

    threading.Thread(target=work, name="unillm-astream", daemon=True).start()
    try:
        while True:
            item = await queue.get()
            if item is _DONE:
                break
            if isinstance(item, _Raised):
                raise item.exc
            yield item
    finally:
        stop.set()


class _Raised:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a public method a backend writes) behind the engine's lifetime gate, its
    arguments checked the way every backend needs: text must be text, ids ids of the vocabulary."""
    name = fn.__name__

    @functools.wraps(fn)
    def guarded(self: Engine[Any], *args: Any, **kwargs: Any) -> Any:
        if name == "tokenize" and args:
            check_text(args[0], "tokenize() takes")
        elif name == "detokenize" and args:
            args = (check_token_ids(args[0], self.vocab_size), *args[1:])
        self._enter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self._leave()

    guarded._unillm_guarded = True  # type: ignore[attr-defined]
    return guarded


for _name in _GUARDED:
    setattr(Engine, _name, _guarded(getattr(Engine, _name)))


def check_text(text: Any, what: str = "the prompt is") -> str:
    """``text`` as a str that encodes (no lone surrogates); ConfigError otherwise."""
    if not isinstance(text, str):
        raise ConfigError(f"{what} a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(
            f"the text holds a lone surrogate {text[exc.start]!r} at position {exc.start}, which is "
            "not valid Unicode; decode your input with errors='replace' (or fix its source)"
        ) from None
    return text


def check_token_ids(ids: Any, vocab: int | None) -> list[int]:
    """``ids`` as a list of ints inside the vocabulary (when known); ConfigError otherwise.

    Floats, booleans, strings and bytes are refused rather than coerced: ``int(2.7)`` would
    silently pick another token, and bytes iterate as numbers.
    """
    if isinstance(ids, (str, bytes, bytearray, memoryview, Mapping)) or not hasattr(ids, "__iter__"):
        raise ConfigError(
            f"token ids must be a sequence of ints, got {type(ids).__name__}; pass text as a str"
        )
    out: list[int] = []
    for t in ids:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise ConfigError(f"token ids must be ints, got {t!r} ({type(t).__name__})")
        out.append(t.__index__())
    if vocab is not None:
        bad = [t for t in out if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
    return out
