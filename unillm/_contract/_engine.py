"""The Engine base class: the contract every backend implements.

A backend writes a handful of small methods (``_load``, ``_encode``, ``_stream``, ``_close`` and
the tokenizer pair); everything a user calls is derived here once: ``stream`` wraps ``_stream``
with parameter validation, stop strings, max-token accounting, usage and timings; ``generate`` is a
fold over ``stream``; ``chat`` renders the chat template (with the request's tools, whose calls are
parsed from the reply onto the stream's last chunk) and streams; the async methods mirror the
sync ones (natively on the caller's event loop for a batching backend with ``_astream``, vLLM;
otherwise the sync stream on a thread of its own). Backends that cannot batch are serialized by
a lock, so callers from many threads (or asyncio tasks) never interleave inside the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from time import perf_counter
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from unillm._chat._tools import InvalidTools, ToolSpec, parse_tool_calls, read_tools
from unillm._contract._checks import check_text, check_token_ids
from unillm._contract._embed import EmbedJob, check_rerank, check_task, rank
from unillm._contract._facts import Facts
from unillm._contract._lifetime import GUARDED, Lifetime, guarded
from unillm._contract._run import (
    FORMAT_NEVER_DROPPED,
    RawPiece,
    Request,
    RequestState,
    Run,
    afold,
    fold,
    iterate_in_thread,
)
from unillm._errors import (
    ConfigError,
    GenerationError,
    UnillmError,
    UnillmWarning,
    UnsupportedParameter,
    warn,
)
from unillm._types import (
    Availability,
    Capabilities,
    ChatMessage,
    Chunk,
    Completion,
    Cost,
    Embeddings,
    EngineConfig,
    Fallback,
    KVStats,
    Pooling,
    Reranked,
    SamplingParams,
    Suitability,
)

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "ALWAYS_HANDLED",
    "Engine",
    "Messages",
    "NoOptions",
    "Request",
    "RequestState",
    "Tools",
    "UnillmWarning",
    "chat_request",
    "check_text",
    "check_token_ids",
    "finish_with_calls",
    "forced_params",
    "render",
]

Prompt = str | Sequence[int]
P = TypeVar("P")
Messages = Sequence[ChatMessage | Mapping[str, Any]]
Params = SamplingParams | Mapping[str, Any] | None
Tools = Sequence[Mapping[str, Any]]  # OpenAI's shape: {"type": "function", "function": {...}}
ToolChoice = str | Mapping[str, Any] | None  # "auto", "none", "required" or {"type": "function", ...}


class NoOptions(BaseModel):
    """A backend without load options."""

    model_config = ConfigDict(extra="forbid")


# The shortest context the default fallback steps go down to.
_MIN_CONTEXT = 1024
#: Sampling parameters the base class honours for every backend, whatever it declares.
ALWAYS_HANDLED = frozenset({"max_tokens", "stop"})


class Engine(Lifetime, Generic[P]):
    """Base class of every backend. Subclass it, fill the class data, write ``_stream``.

    Class data a backend declares:

    - ``name``: the backend's registry name (``"llama.cpp"``).
    - ``formats``: model formats it reads (``{"gguf"}``).
    - ``capabilities``: what it can do, including the sampling parameters it honours.
    - ``Options``: a pydantic model (``extra="forbid"``) of its load options.
    - ``install_hint``: the command that installs its engine.

    Class methods the selector and ``auto_engine`` call, every one of them cheap and import-free
    (a plugin implements them the same way a built-in does; docs/plugins.md):

    - ``available()``: whether it can run here.
    - ``suitability(hardware, model, workload, plan=None)``: its score and hard rules for a case.
    - ``capabilities_for(options)``: what an engine with these load options can do.
    - ``fallbacks(config, facts)``: what to try, in order, when loading runs out of memory.
    - ``probe_build(hardware, findings)``: its installed build, for ``unillm doctor``.

    ``facts`` (model, machine, plan: ``unillm.backend.Facts``) is what ``auto_engine`` learned
    while choosing; ``_load`` reads it instead of inspecting the model or probing again.
    """

    name: ClassVar[str] = ""
    formats: ClassVar[frozenset[str]] = frozenset()
    capabilities: ClassVar[Capabilities] = Capabilities()
    Options: ClassVar[type[BaseModel]] = NoOptions
    install_hint: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in GUARDED:
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "_unillm_guarded", False):
                setattr(cls, name, guarded(fn))

    # ---- discovery (class level, cheap: never imports the engine) ----

    @classmethod
    def available(cls) -> Availability:
        """Whether this backend can run here. Must not import the engine."""
        return Availability(True)

    @classmethod
    def suitability(cls, hardware: Any, model: Any, workload: Any, plan: Any = None) -> Suitability:
        """How well this backend fits a model (``ModelInfo``) on ``hardware`` under ``workload``
        (and the memory ``plan``, when there is one); the default only checks the model format
        and scores 1.0 when it reads it. Hard rules are blockers. The selector adds the decision
        guide's bonus (docs/selection.md has the scale)."""
        fmt = getattr(model, "format", None)
        if fmt in cls.formats:
            return Suitability(1.0, reasons=(f"reads {fmt}",))
        return Suitability(0.0, blockers=(f"does not read {fmt} (reads {', '.join(sorted(cls.formats))})",))

    @classmethod
    def capabilities_for(cls, options: Any) -> Capabilities:
        """What an engine loaded with ``options`` (an ``Options`` instance) can do; the default is
        the class's ``capabilities``. Override when an option changes them (a batch size)."""
        return cls.capabilities

    @classmethod
    def fallbacks(cls, config: EngineConfig, facts: Facts) -> Sequence[Fallback]:
        """The steps ``auto_engine`` may take, cheapest first, when loading with ``config`` runs
        out of memory; each applies on top of the ones before. The default shortens the context:
        to the model's trained length when more was asked (free), then by halves down to 1024.
        A backend adds its own (a quantized KV cache, fewer layers on the GPU) to these."""
        model = facts.model
        asked = config.context_length or (facts.workload.context_length if facts.workload else None)
        if not asked:
            return ()
        steps: list[Fallback] = []
        trained = getattr(model, "context_length", None)
        if isinstance(trained, int) and _MIN_CONTEXT <= trained < asked:
            asked = trained  # more context than the model was trained for is no use
            steps.append(_context_step(trained, Cost.FREE))
        while asked > _MIN_CONTEXT:
            asked = max(_MIN_CONTEXT, asked // 2)
            steps.append(_context_step(asked, Cost.CAPABILITY))
        return steps

    @classmethod
    def probe_build(cls, hardware: Any, findings: list[str]) -> Any:
        """The installed engine build (``unillm.backend.EngineBuild``: version, devices it can
        use) without importing it, or None when it is not installed; appends to ``findings``
        what keeps it from using ``hardware``'s accelerators. The default reports nothing."""
        return None

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
        #: What ``auto_engine`` chose and why (``unillm.Selection``), when it chose this engine.
        self.selection: Any = None
        #: The model, machine and plan (``Facts``); computed on first use when not handed in.
        self.facts: Facts = Facts(config.model)
        #: What this engine can do with its load options (``capabilities_for``).
        self.capabilities: Capabilities = type(self).capabilities_for(self.options)  # type: ignore[misc]
        Lifetime.__init__(self)
        #: The end-of-sequence ids this engine stops on (unillm._inspect._eos); set by the backend at load.
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

    def _stream(self, prepared: Any, params: SamplingParams, req: RequestState) -> Iterator[RawPiece]:
        """Yield ``(text_delta, token_ids, logprobs_or_None)`` per step; fill ``req``.

        Stop at EOS (``req.finish_reason = "stop"``) or at ``params.max_tokens``
        (``"length"``). When the consumer stops early, the generator is closed: clean up in a
        ``finally``. Stop strings and usage are handled by the caller.
        """
        raise NotImplementedError

    def _astream(
        self, prepared: Any, params: SamplingParams, req: RequestState
    ) -> AsyncGenerator[RawPiece, None]:
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

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (OpenAI's ``logprobs[].bytes``): a token that is
        one byte of a multi-byte character is that byte, where ``detokenize`` shows U+FFFD.
        Default: ``detokenize``'s text as UTF-8, exact wherever a token is whole characters."""
        return self.detokenize([token_id]).encode()

    def kv_stats(self) -> KVStats:
        """The KV cache now; fields the engine cannot tell are None."""
        return KVStats()

    def reset(self) -> None:
        """Empty the KV cache, so the next request evaluates its whole prompt. Default: no-op."""

    #: The vocabulary size, once loaded (backends set it): ids outside it are refused at the edge.
    vocab_size: int | None = None
    #: The context window in tokens (prompt plus completion), once loaded (backends set it).
    context_length: int | None = None
    #: What the engine was loaded for: "generate", "embed" or "rerank" (a backend that embeds sets
    #: it at load from ``unillm.backend.task_for``; docs/embeddings.md); None where the engine
    #: cannot tell (a server's model): the server then refuses what its model does not do.
    task: str | None = "generate"
    #: How an embedding engine pools (``unillm.backend.pooling_for`` at load); None: not known here.
    pooling: Pooling | None = "last"
    #: The longest input ``embed`` takes, in tokens (None: the context window).
    max_embed_tokens: int | None = None
    #: Whether ``_embed`` pools any way per call (else only the loaded ``pooling``).
    pools_per_call: ClassVar[bool] = False
    #: Whether the engine tokenizes embed inputs itself (a server does): ``_embed`` then gets the
    #: inputs as given (text or ids) and returns (vectors, prompt tokens); the limit is its own.
    embeds_text: ClassVar[bool] = False

    # ---- embeddings and rerank (docs/embeddings.md): a backend writes _embed and _rerank ----

    def _embed(self, batch: list[Any], pooling: Any) -> Any:
        """The pooled, unnormalized vectors of ``batch`` (token id lists), one row each, in one
        call: the engine batches inside it. A backend with ``capabilities.embeddings`` writes it."""
        raise ConfigError(f"{self.name} does not compute embeddings")

    async def _aembed(self, batch: list[Any], pooling: Any) -> Any:
        """``_embed`` on the caller's event loop (a natively async backend writes it)."""
        return await asyncio.to_thread(self._embed_gated, batch, pooling)

    def _rerank(self, query: str, documents: list[str]) -> tuple[list[float], int]:
        """Each document's relevance score to ``query`` from the model's own scoring, and the
        tokens scored. A backend that loads cross-encoders writes it."""
        raise ConfigError(f"{self.name} does not rerank")

    @property
    def embed_limit(self) -> int | None:
        """The longest input ``embed`` takes, in tokens."""
        return self.max_embed_tokens or self.context_length

    def embed(
        self,
        texts: str | Sequence[str] | Sequence[Sequence[int]],
        *,
        pooling: Pooling | None = None,
        normalize: bool = True,
        dimensions: int | None = None,
        truncate: bool = False,
    ) -> Embeddings:
        """The vectors of ``texts`` (one text, a list of them, or token id lists), batched in the
        engine: pooled (the loaded pooling unless ``pooling`` says, where the engine can),
        cut to the first ``dimensions`` (Matryoshka) and ``normalize``d to unit length. An input
        longer than ``embed_limit`` is refused, or cut to it with ``truncate=True``."""
        job = EmbedJob.of(self, texts, pooling, normalize, dimensions, truncate)
        if self.embeds_text:
            raw, tokens = self._embed_gated(job.inputs, job.pooling)
            return job.finish(raw, tokens, ())
        batch, cut = self._embed_inputs(job)
        return job.finish(self._embed_gated(batch, job.pooling), sum(map(len, batch)), cut)

    async def aembed(
        self,
        texts: str | Sequence[str] | Sequence[Sequence[int]],
        *,
        pooling: Pooling | None = None,
        normalize: bool = True,
        dimensions: int | None = None,
        truncate: bool = False,
    ) -> Embeddings:
        """Async ``embed`` (natively on the caller's loop where the backend is async)."""
        job = EmbedJob.of(self, texts, pooling, normalize, dimensions, truncate)
        if self.embeds_text:
            raw, tokens = await self._aembed(job.inputs, job.pooling)
            return job.finish(raw, tokens, ())
        # tokenizing many inputs is CPU work: off the caller's loop, which serves other requests
        batch, cut = await asyncio.to_thread(self._embed_inputs, job)
        return job.finish(await self._aembed(batch, job.pooling), sum(map(len, batch)), cut)

    def rerank(self, query: str, documents: Sequence[str], *, top_n: int | None = None) -> Reranked:
        """``documents`` ordered by relevance to ``query`` as the loaded reranker (a cross-encoder,
        ``task="rerank"``) scores them; ``top_n`` keeps the first n."""
        docs = check_rerank(self, query, documents, top_n)
        with self._busy():
            self._enter()
            try:
                scores, tokens = self._rerank(query, docs)
            finally:
                self._leave()
        return rank(scores, tokens, top_n, len(docs))

    async def arerank(self, query: str, documents: Sequence[str], *, top_n: int | None = None) -> Reranked:
        """Async ``rerank``."""
        return await asyncio.to_thread(self.rerank, query, documents, top_n=top_n)

    def _embed_inputs(self, job: EmbedJob) -> tuple[list[list[int]], tuple[int, ...]]:
        self._enter()
        try:
            return job.encode(self)
        finally:
            self._leave()

    def _embed_gated(self, batch: list[Any], pooling: Any) -> Any:
        with self._busy():
            self._enter()
            try:
                return self._embed(batch, pooling)
            except UnillmError:
                raise
            except Exception as exc:
                raise GenerationError(f"{self.name} failed while embedding: {exc}") from exc
            finally:
                self._leave()

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
        sp = self._params(params, overrides)
        return fold(self.stream(prompt, sp), sp)

    # ---- derived: chat (the messages and tools rendered under the chat template, then streamed) ----

    def render_chat(
        self, messages: Messages, *, add_generation_prompt: bool = True, tools: Tools | None = None
    ) -> str:
        """The prompt text ``messages`` become under the chat template (sandboxed Jinja), with
        ``tools`` (OpenAI's shape) in its ``tools`` variable when given."""
        spec = read_tools(tools) if tools else None
        return render(self, messages, add_generation_prompt, spec.tools if spec else None)

    def stream_chat(
        self,
        messages: Messages,
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        tools: Tools | None = None,
        tool_choice: ToolChoice = None,
        **overrides: Any,
    ) -> Iterator[Chunk]:
        """Stream the assistant's reply to ``messages``. With ``tools`` (OpenAI's shape), the last
        chunk carries the ``tool_calls`` parsed from the reply (``finish_reason`` "tool_calls");
        ``tool_choice`` "required" or a named tool constrains decoding to a call (docs/structured.md)."""
        prompt, sp, spec = chat_request(self, messages, params, overrides, tools, tool_choice)
        return calls_in(self.stream(prompt, sp), spec)

    def chat(
        self,
        messages: Messages,
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        tools: Tools | None = None,
        tool_choice: ToolChoice = None,
        **overrides: Any,
    ) -> Completion:
        """The assistant's whole reply to ``messages``; ``tools`` as in ``stream_chat``."""
        sp = self._params(params, overrides)
        return fold(self.stream_chat(messages, sp, **_tool_args(tools, tool_choice)), sp)

    async def astream_chat(
        self,
        messages: Messages,
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        tools: Tools | None = None,
        tool_choice: ToolChoice = None,
        **overrides: Any,
    ) -> AsyncIterator[Chunk]:
        """Async ``stream_chat``."""
        prompt, sp, spec = chat_request(self, messages, params, overrides, tools, tool_choice)
        async for chunk in acalls_in(self.astream(prompt, sp), spec):
            yield chunk

    async def achat(
        self,
        messages: Messages,
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        tools: Tools | None = None,
        tool_choice: ToolChoice = None,
        **overrides: Any,
    ) -> Completion:
        """Async ``chat``."""
        sp = self._params(params, overrides)
        return await afold(self.astream_chat(messages, sp, **_tool_args(tools, tool_choice)), sp)

    # ---- async mirrors: native for a batching backend's _astream, else the sync path on a thread ----

    async def astream(
        self, prompt: Prompt, params: SamplingParams | Mapping[str, Any] | None = None, **overrides: Any
    ) -> AsyncIterator[Chunk]:
        """Async ``stream``; cancelling the consuming task stops generation at the next token. A
        batching backend's native ``_astream`` runs on the caller's loop, any other on a thread."""
        if self._native_async():
            sp = self._params(params, overrides)
            t0 = perf_counter()
            async for chunk in self._adrive(self._prepare(prompt, sp), sp, t0):
                yield chunk
            return
        gen = await asyncio.to_thread(self.stream, prompt, params, **overrides)
        async for chunk in iterate_in_thread(gen):
            yield chunk

    async def agenerate(
        self, prompt: Prompt, params: SamplingParams | Mapping[str, Any] | None = None, **overrides: Any
    ) -> Completion:
        """Async ``generate``."""
        sp = self._params(params, overrides)
        return await afold(self.astream(prompt, sp), sp)

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
        unsupported = [n for n in sp.non_default() if n not in supported and n not in ALWAYS_HANDLED]
        if not unsupported:
            return sp
        if "response_format" in unsupported:  # never dropped, whatever the policy says
            raise UnsupportedParameter(self.name, unsupported, hint=FORMAT_NEVER_DROPPED)
        policy = self.config.unsupported_params
        if policy == "strict":
            raise UnsupportedParameter(self.name, unsupported)
        if policy == "warn":
            warn(f"{self.name} ignores {', '.join(unsupported)} (unsupported_params='warn')")
        fields = SamplingParams.model_fields
        update = {n: fields[n].default for n in unsupported if n in fields}
        if "top_logprobs" in unsupported and "logprobs" not in unsupported:
            update["logprobs"] = 0  # the chosen token's logprob, without the alternatives
        return sp.model_copy(update=update)

    def _prepare(self, prompt: Prompt, params: SamplingParams) -> Any:
        """Check the prompt's type and encode it (inside the gate: encoding uses the engine)."""
        if self.task != "generate":
            check_task(self, "generate")
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
            req = RequestState()
            run = Run(params)
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

    async def _adrive(self, prepared: Any, params: SamplingParams, t0: float) -> AsyncIterator[Chunk]:
        """``_drive`` for a backend with a native ``_astream`` (batching engines only)."""
        req = RequestState()
        run = Run(params)
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


for _name in GUARDED:
    setattr(Engine, _name, guarded(getattr(Engine, _name)))


def _context_step(n: int, cost: Cost) -> Fallback:
    return Fallback(f"context_length={n}", cost, config={"context_length": n}, context_length=n)


# ---- chat: what the chat methods, the server and the vLLM backend share ----


def _tool_args(tools: Any, tool_choice: Any) -> dict[str, Any]:
    """Only the tool arguments given: a backend that overrides ``stream_chat`` with the signature
    it had before tools (``messages, params, **overrides``) keeps working for plain chats."""
    args: dict[str, Any] = {}
    if tools is not None:
        args["tools"] = tools
    if tool_choice is not None:
        args["tool_choice"] = tool_choice
    return args


def render(
    engine: Engine[Any],
    messages: Any,
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """``Engine.render_chat``: ``tools`` already read (``read_tools``)."""
    from unillm._chat._template import no_chat_template, render_chat_template

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
    engine._enter()
    try:
        template = engine.config.chat_template or engine._chat_template()
        special = engine._special_tokens()
    finally:
        engine._leave()
    if template is None:
        raise no_chat_template(engine.config.model)
    source = "the engine config's chat_template" if engine.config.chat_template else engine.config.model
    return render_chat_template(
        template, msgs, add_generation_prompt=add_generation_prompt, source=source, tools=tools, **special
    )


def forced_params(engine: Engine[Any], params: SamplingParams, spec: ToolSpec) -> SamplingParams:
    """``params`` with decoding held to a call of ``spec``'s tools when it forces one; a backend
    that cannot constrain its output refuses (a forced call is never left to chance)."""
    if not spec.forced:
        return params
    if params.response_format is not None:
        raise InvalidTools(
            "tool_choice",
            f"{spec.choice!r} constrains the reply to a tool call, which response_format would "
            "constrain too; pass one of them",
        )
    if "response_format" not in engine.capabilities.sampling:
        raise UnsupportedParameter(
            engine.name,
            ["tool_choice"],
            hint=f"tool_choice={spec.choice!r} needs constrained decoding, which this backend lacks "
            "(no response_format in its capabilities.sampling): use tool_choice='auto', or a backend "
            "that has it.",
        )
    return SamplingParams(
        **{**params.model_dump(exclude_unset=True), "response_format": spec.response_format()}
    )


def chat_request(
    engine: Engine[Any],
    messages: Any,
    params: SamplingParams | Mapping[str, Any] | None,
    overrides: Mapping[str, Any],
    tools: Any,
    tool_choice: Any,
) -> tuple[str, SamplingParams, ToolSpec | None]:
    """The prompt, the sampling parameters and the read tools (None: plain chat) of one chat. The
    prompt comes from ``engine.render_chat``, which a backend may override (vLLM renders as vLLM
    does); ``tools`` is passed only when there are some, so an override without it still works."""
    spec = read_tools(tools, tool_choice)
    sp = engine._params(params, overrides)
    if spec is None:
        return engine.render_chat(messages), sp, None
    prompt = engine.render_chat(messages, tools=list(spec.tools))
    return prompt, forced_params(engine, sp, spec), spec


def finish_with_calls(last: Chunk, text: str, spec: ToolSpec) -> Chunk:
    """The stream's last chunk, carrying the calls parsed from the whole ``text``; its
    ``finish_reason`` is ``tool_calls`` when there are any. A forced call that does not parse is
    ``ToolCallParseError``."""
    _, calls = parse_tool_calls(text, spec.names, forced=spec.forced, finish_reason=last.finish_reason)
    if not calls:
        return last
    return dataclasses.replace(last, finish_reason="tool_calls", tool_calls=calls)


def calls_in(chunks: Iterator[Chunk], spec: ToolSpec | None) -> Iterator[Chunk]:
    """``chunks`` as they come, the last one with the calls (nothing to do without tools)."""
    return chunks if spec is None else _calls_in(chunks, spec)


def _calls_in(chunks: Iterator[Chunk], spec: ToolSpec) -> Iterator[Chunk]:
    parts: list[str] = []
    try:
        for chunk in chunks:
            parts.append(chunk.text)
            yield chunk if chunk.finish_reason is None else finish_with_calls(chunk, "".join(parts), spec)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


async def acalls_in(chunks: AsyncIterator[Chunk], spec: ToolSpec | None) -> AsyncIterator[Chunk]:
    """``calls_in`` for an async stream."""
    parts: list[str] = []
    try:
        async for chunk in chunks:
            parts.append(chunk.text)
            if spec is not None and chunk.finish_reason is not None:
                yield finish_with_calls(chunk, "".join(parts), spec)
            else:
                yield chunk
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
