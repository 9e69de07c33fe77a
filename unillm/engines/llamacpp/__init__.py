"""llama.cpp through llama-cpp-python: GGUF models on CPUs, Apple GPUs and one NVIDIA/AMD GPU.

The adapter drives llama.cpp's token loop itself (evaluate, sample, decode one token) instead of
``Llama.create_completion``, which re-detokenizes the whole completion at every token and so slows
down as the output grows. Prefix reuse is explicit: the longest common prefix with what the KV
cache already holds is kept, and the cached count is reported in ``Usage``. Prefill and decode
times come from llama.cpp's own counters.

Never across several GPUs (a hard rule): on a multi-GPU machine the model runs on ``main_gpu``.
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from unillm import BackendUnavailable, ConfigError
from unillm.backend import (
    STANDARD_SAMPLING,
    Availability,
    Capabilities,
    Cost,
    Engine,
    EngineConfig,
    Facts,
    Fallback,
    KVStats,
    Pooling,
    RawPiece,
    RequestState,
    SamplingParams,
    Suitability,
    check_chat_template,
    check_prompt,
    compile_error,
    compile_error_types,
    context_for,
    eos_from_gguf_metadata,
    gguf_chat_template,
    gguf_in,
    installed,
    kv_dtype,
    pooling_for,
    shared_prefix,
    task_for,
    warn,
)
from unillm.backend.lora import one_adapter
from unillm.engines.llamacpp._batch import Batcher, Event, Job, context_params, finished, llama_logprobs
from unillm.engines.llamacpp._draft import Speculation, check_request, load_drafter, no_step
from unillm.engines.llamacpp._embed import checked_task, embed_batch, embed_kwargs
from unillm.engines.llamacpp._format import Formats
from unillm.engines.llamacpp._load import (
    LlamaLog,
    check_fits,
    checked_header,
    eval_error,
    fewer_gpu_layers,
    full_metadata,
    gguf_adapter,
    load_error,
    model_shape,
    no_chat_handlers,
)
from unillm.engines.llamacpp._options import LLAMACPP_MEMORY, LlamaCppOptions

if TYPE_CHECKING:
    from llama_cpp import Llama

__all__ = ["LLAMACPP_MEMORY", "LlamaCppEngine", "LlamaCppOptions"]

INSTALL_HINT = (
    "pip install 'unillm[llamacpp]'  (builds from source; for NVIDIA GPUs prefix "
    'CMAKE_ARGS="-DGGML_CUDA=on", for AMD "-DGGML_HIP=on")'
)
# KV cache element type -> its ggml type id (llama.cpp's type_k / type_v); its size is unillm._inspect._kv's
_GGML_KV_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}


class LlamaCppEngine(Engine[LlamaCppOptions]):
    """GGUF models through llama-cpp-python."""

    name: ClassVar[str] = "llama.cpp"
    #: its memory as measured for the planner (measured: the comment above)
    memory = LLAMACPP_MEMORY
    formats: ClassVar[frozenset[str]] = frozenset({"gguf"})
    capabilities: ClassVar[Capabilities] = Capabilities(
        sampling=STANDARD_SAMPLING | {"response_format"},  # through llguidance (engines/llamacpp/_format.py)
        lora=True,
        embeddings=True,  # loaded with task="embed": a pooling context (engines/llamacpp/_embed.py)
        devices=frozenset({"cpu", "cuda", "metal", "rocm", "vulkan"}),
        speculative=True,
    )
    Options: ClassVar[type[BaseModel]] = LlamaCppOptions
    install_hint: ClassVar[str | None] = INSTALL_HINT

    # ---- availability ----

    @classmethod
    def available(cls) -> Availability:
        return installed(("llama_cpp", "llama-cpp-python"), hint=INSTALL_HINT)

    @classmethod
    def suitability(cls, hardware: Any, model: Any, workload: Any, plan: Any = None) -> Suitability:
        fit = super().suitability(hardware, model, workload)
        if fit.blockers:
            return fit
        # A hard rule of the field: llama.cpp never splits one model across several GPUs, so a
        # model that needs more than the largest GPU holds is not for it on a multi-GPU machine.
        gpus = getattr(hardware, "gpus", ()) or ()
        if len(gpus) > 1 and plan is not None:
            biggest = max(g.memory_total_bytes for g in gpus)
            if plan.total_bytes > biggest:
                gib = 2**30
                return Suitability(
                    fit.score,
                    fit.reasons,
                    (
                        f"needs {plan.total_bytes / gib:.1f} GiB, more than one GPU "
                        f"({biggest / gib:.1f} GiB) holds, and llama.cpp never splits a model across GPUs",
                    ),
                )
        return Suitability(fit.score, (*fit.reasons, "uses one GPU at most (never split across GPUs)"))

    @classmethod
    def capabilities_for(cls, options: Any) -> Capabilities:
        """With ``parallel`` > 1 the engine batches (several sequences in one context)."""
        if (getattr(options, "parallel", None) or 1) > 1:
            return dataclasses.replace(cls.capabilities, batching=True)
        return cls.capabilities

    @classmethod
    def fallbacks(cls, config: EngineConfig, facts: Facts) -> Sequence[Fallback]:
        """The base steps (a shorter context), then llama.cpp's own: a q8_0 KV cache when the
        options leave it at f16, and, on a machine with a GPU, fewer layers on it: what the plan
        says fits (else half the model's layers, or half of an explicit ``n_gpu_layers``), then
        half again down to 1."""
        opts = config.options_for(cls.name)
        steps = [*super().fallbacks(config, facts)]
        if opts.get("kv_cache_type", "f16") == "f16":
            steps.append(
                Fallback(
                    "kv_cache_type=q8_0", Cost.QUALITY, options={"kv_cache_type": "q8_0"}, kv_cache_dtype="q8"
                )
            )
        hardware = facts.hardware
        if hardware is not None and hardware.gpus:
            for n in fewer_gpu_layers(opts.get("n_gpu_layers"), facts):
                steps.append(Fallback(f"n_gpu_layers={n}", Cost.SPEED, options={"n_gpu_layers": n}))
        return steps

    @classmethod
    def probe_build(cls, hardware: Any, findings: list[str]) -> Any:
        from unillm.engines.llamacpp._build import build  # the build's devices, from its libraries

        return build(hardware, findings)

    # ---- load ----

    def _load(self) -> None:
        opts = self.options
        self._path = gguf_in(self.config.model) or Path(self.config.model)
        # what auto_engine read while choosing (or, built directly, read now): never re-read here
        info = self.facts.model
        header = checked_header(self.facts.gguf_header, self._path)  # ModelNotFound / ModelFormatError
        shape = model_shape(info, header)
        avail = self.available()
        if not avail.available:
            raise BackendUnavailable(self.name, avail.reason, INSTALL_HINT)
        try:
            import llama_cpp
        except (ImportError, OSError) as exc:
            raise BackendUnavailable(self.name, f"llama_cpp failed to import: {exc}", INSTALL_HINT) from exc

        if opts.n_ctx and self.config.context_length and opts.n_ctx != self.config.context_length:
            raise ConfigError(
                f"context_length={self.config.context_length} and options n_ctx={opts.n_ctx} "
                "disagree; set only one"
            )
        trained = shape.trained_context
        n_ctx = context_for(
            self.name, self.config.model, opts.n_ctx or self.config.context_length, trained,
            longer="allow_longer_context=True", allowed=opts.allow_longer_context,
        )  # fmt: skip
        self.task = checked_task(task_for(self.config, info), self.config.model, opts.draft_model)
        embedding = self.task == "embed"
        parallel = 1 if embedding else self._parallel(opts)
        gpu_layers = opts.n_gpu_layers
        if gpu_layers is None or gpu_layers == "auto":
            gpu_layers = -1 if llama_cpp.llama_supports_gpu_offload() else 0
        kv_type, dtype = _GGML_KV_TYPES[opts.kv_cache_type], kv_dtype(opts.kv_cache_type)
        if gpu_layers == 0 and not opts.skip_memory_check:
            check_fits(shape, n_ctx * parallel, dtype, self.config.model)
        kwargs: dict[str, Any] = {
            # batching: the sequences' context is made below; this one serves the tokenizer only
            "n_ctx": n_ctx if parallel == 1 else min(n_ctx, 256),
            "n_gpu_layers": gpu_layers,
            "split_mode": llama_cpp.LLAMA_SPLIT_MODE_NONE,  # one GPU, never split
            "main_gpu": opts.main_gpu,
            "n_batch": opts.n_batch,
            "n_ubatch": min(opts.n_ubatch, opts.n_batch),
            "flash_attn": opts.flash_attn or opts.kv_cache_type != "f16",
            "type_k": kv_type,
            "type_v": kv_type,
            "use_mmap": opts.use_mmap,
            "use_mlock": opts.use_mlock,
            "verbose": opts.verbose,
        }
        if opts.n_threads:
            kwargs["n_threads"] = opts.n_threads
        if opts.n_threads_batch:
            kwargs["n_threads_batch"] = opts.n_threads_batch
        if opts.seed is not None:
            kwargs["seed"] = opts.seed
        if embedding:  # one decode takes any input up to the context, pooled by llama.cpp
            self.pooling = pooling_for(self.config, info)
            kwargs.update(embed_kwargs(llama_cpp, self.pooling, n_ctx))
        if (lora := one_adapter(self.config, self.name)) is not None:  # scaled by its own alpha
            kwargs.update(lora_path=str(gguf_adapter(lora, self.name, self.facts)), lora_scale=1.0)

        own_template = self.config.chat_template is None
        template = gguf_chat_template(header.metadata)
        if own_template and template is not None:
            check_chat_template(template, source=str(self._path))  # a broken one fails at load
        with LlamaLog(llama_cpp) as log, no_chat_handlers(llama_cpp):
            try:
                llm = llama_cpp.Llama(model_path=str(self._path), **kwargs)
            except compile_error_types() as exc:  # Llama() compiles the file's chat templates
                raise compile_error(exc, str(self._path), loader="llama-cpp-python") from exc
            except (ValueError, RuntimeError, OSError) as exc:
                raise load_error(exc, log.text(), header, self.config.model) from exc
        metadata = full_metadata(llm, header, check_template=own_template, source=str(self._path))
        self._llm: Llama = llm
        self._lc = llama_cpp
        self._draft = load_drafter(llama_cpp, opts.draft_model, opts.num_draft_tokens, kwargs, llm)
        self._vocab = llm._model.vocab
        self._n_vocab = llm.n_vocab()
        # llama.cpp may round the context up (to 256), but llama-cpp-python sizes its token record
        # by the requested n_ctx: the usable context is the smaller of the two.
        self._n_ctx = self.context_length = min(llm.n_ctx(), len(llm.input_ids))
        self._batcher: Batcher | None = None
        # what this engine does with the parallel it got (a draft model or LoRA: 1)
        self.capabilities = type(self).capabilities_for(opts.model_copy(update={"parallel": parallel}))  # type: ignore[misc]
        if parallel > 1:
            self._n_ctx = self.context_length = n_ctx
            params = context_params(
                llama_cpp, llm.context_params, n_ctx=n_ctx * parallel, n_seq=min(2 * parallel, 256),
                n_batch=opts.n_batch, n_ubatch=opts.n_ubatch,
            )  # fmt: skip
            # the context holds parallel x n_ctx cells: llama.cpp warns that this passes the trained
            # context, but each sequence is held to n_ctx (checked against the trained one above)
            with LlamaLog(llama_cpp, handled=("llama_context: n_ctx_seq",)) as log:
                try:
                    self._batcher = Batcher(
                        llama_cpp, llm._model, params, parallel=parallel, n_batch=opts.n_batch,
                        keep_tokens=n_ctx if opts.prefix_cache_tokens is None else opts.prefix_cache_tokens,
                        n_vocab=llm.n_vocab(), decode_error=eval_error,
                    )  # fmt: skip
                except (ValueError, RuntimeError, OSError) as exc:
                    llm.close()
                    raise load_error(exc, log.text(), header, self.config.model) from exc

        self.vocab_size = self._n_vocab
        self.eos_token_ids = eos_from_gguf_metadata(
            metadata,
            to_id=self._one_token,
            vocab_size=self._n_vocab,
        )
        # response formats through llguidance over llama.cpp's vocabulary (built on first use)
        self._formats = Formats(self._vocab, self._n_vocab, self.eos_token_ids)
        bos = llm.token_bos()
        self._bos_text = llm.detokenize([bos], special=True).decode("utf-8", "replace") if bos >= 0 else ""
        self._perf = llama_cpp.llama_perf_context
        self._perf_reset = llama_cpp.llama_perf_context_reset
        self._pieces: dict[int, bytes] = {}  # token -> its bytes
        self._queries = 0
        self._hits = 0
        self._kv_dtype = opts.kv_cache_type
        self._kv_bytes_per_token = shape.kv_bytes_per_token(dtype)

    # ---- embed ----

    def _embed(self, batch: list[list[int]], pooling: Pooling) -> Any:
        return embed_batch(self._lc, self._llm, batch)

    # ---- stream ----

    def _encode(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        llm = self._llm
        if isinstance(prompt, str):
            # A chat template that already wrote the BOS text must not get a second BOS.
            add_special = not (self._bos_text and prompt.startswith(self._bos_text))
            ids = llm.tokenize(prompt.encode("utf-8"), add_bos=add_special, special=True)
        else:
            ids = list(prompt)  # the base class checked the ids against the vocabulary
        check_prompt(ids, self._n_ctx, params.max_tokens)
        if (fmt := params.output_format) is not None:
            self._formats.check(fmt)  # refused at the call, not at the first token
        check_request(self._draft, params)  # what speculative decoding cannot do
        return ids

    def _parallel(self, opts: LlamaCppOptions) -> int:
        """Sequences to batch: the option, else the config's concurrency; 1 (with a warning that
        says why) for speculative decoding and LoRA, which run on the one-sequence path."""
        asked = opts.parallel or max(1, min(self.config.concurrency or 1, 256))
        if asked > 1 and (opts.draft_model or self.config.lora_adapters()):
            why = "draft_model" if opts.draft_model else "a LoRA adapter"
            warn(
                f"llama.cpp: {asked} sequences at once (parallel) were asked, but {why} runs one "
                "request at a time: batching is off for this engine"
            )
            return 1
        return asked

    def _stream(self, ids: list[int], params: SamplingParams, req: RequestState) -> Iterator[RawPiece]:
        if self._batcher is not None:
            return self._stream_batched(ids, params, req)
        return self._stream_one(ids, params, req)

    def _stream_batched(
        self, ids: list[int], params: SamplingParams, req: RequestState
    ) -> Iterator[RawPiece]:
        batcher = self._batcher  # close() drops the attribute while this stream may still run
        assert batcher is not None
        job, read = self._job(ids, params, req)
        # the worker's events up to the last one; leaving early cancels the sequence
        with closing(batcher.events(batcher.submit(job), last=finished)) as events:  # type: ignore[type-var]
            for event in events:
                if (piece := read(event)) is not None:
                    yield piece

    async def _astream(
        self, ids: list[int], params: SamplingParams, req: RequestState
    ) -> AsyncGenerator[RawPiece, None]:
        """``_stream_batched`` on the caller's loop: the worker hands each step's tokens to the
        loop directly, with no thread per request in between."""
        batcher = self._batcher
        assert batcher is not None  # only a batching engine streams natively
        if params.response_format is not None:  # its matcher compiles off the loop
            job, read = await asyncio.to_thread(self._job, ids, params, req)
        else:
            job, read = self._job(ids, params, req)
        events = batcher.aevents(batcher.asubmit(job), last=finished)
        try:
            async for event in events:  # type: ignore[attr-defined]
                if (piece := read(event)) is not None:
                    yield piece
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    def _job(
        self, ids: list[int], params: SamplingParams, req: RequestState
    ) -> tuple[Job, Callable[[Event], RawPiece | None]]:
        """A request for the batcher, and what turns each of its events into a piece (None for
        the end of a stopped sequence), filling ``req``."""
        req.prompt_tokens = len(ids)
        stop_ids = frozenset(params.stop_token_ids).union(() if params.ignore_eos else self.eos_token_ids)
        if params.response_format is not None:
            stop_ids |= self._formats.eos  # as on the one-sequence path: a complete format ends

        def started(cached: int) -> None:
            req.cached_tokens = cached

        job = Job(
            ids, self._sampler(params), stop_ids, min(params.max_tokens, self._n_ctx - len(ids)),
            params.logprobs, on_start=started,
        )  # fmt: skip
        decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        pieces, llm = self._pieces, self._llm

        def read(event: Event) -> RawPiece | None:
            tok, lp, finish = event
            if finish is not None:
                req.finish_reason = finish
            if tok is None:
                return None
            piece = pieces.get(tok)
            if piece is None:
                piece = pieces[tok] = llm.detokenize([tok])
            return decode(piece), (tok,), lp

        return job, read

    def _stream_one(self, ids: list[int], params: SamplingParams, req: RequestState) -> Iterator[RawPiece]:
        llm, ctx = self._llm, self._llm._ctx
        n_prompt = len(ids)
        req.prompt_tokens = n_prompt

        # Keep the longest prefix the KV cache already holds; re-evaluate at least one token so
        # the logits are fresh.
        cached = shared_prefix(llm.input_ids[: llm.n_tokens], ids)
        if cached and not ctx.kv_cache_seq_rm(-1, cached, -1):
            cached = 0
        llm.n_tokens = cached
        req.cached_tokens = cached
        self._queries += n_prompt
        self._hits += cached

        sampler = self._sampler(params)
        perf_reset, perf = self._perf_reset, self._perf
        perf_reset(ctx.ctx)
        try:
            llm.eval(ids[cached:])
        except Exception as exc:
            llm.n_tokens = 0
            raise eval_error(exc) from exc
        # llama.cpp books its timings when it synchronizes, i.e. at the next sample: the prefill's
        # time is known after the first sample, each decode step's after the following one.
        prefill_ms = -1.0

        step = self._decode_step() if self._draft is None else no_step  # Speculation evaluates
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        decode = decoder.decode
        pieces = self._pieces
        # the model's declared end-of-sequence set, never llama.cpp's guess by token name
        stop_ids = frozenset(params.stop_token_ids).union(() if params.ignore_eos else self.eos_token_ids)
        if params.response_format is not None:
            stop_ids |= self._formats.eos  # a complete format allows only these: they end it
        want_lp, k = params.logprobs is not None, params.logprobs or 0
        max_tokens = min(params.max_tokens, self._n_ctx - n_prompt)
        n = 0
        spec = None if self._draft is None else Speculation(llm, sampler, self._draft, max_tokens, req)
        try:
            while True:
                tok = sampler.sample(ctx, -1) if spec is None else next(spec)
                if prefill_ms < 0:
                    p = perf(ctx.ctx)
                    prefill_ms = p.t_p_eval_ms + p.t_eval_ms
                if tok in stop_ids:
                    req.finish_reason = "stop"
                    return
                piece = pieces.get(tok)
                if piece is None:  # first sight of this token: ask llama.cpp once, then remember
                    piece = pieces[tok] = llm.detokenize([tok])
                n += 1
                yield decode(piece), (tok,), llama_logprobs(ctx, self._n_vocab, tok, k) if want_lp else None
                if n >= max_tokens:
                    req.finish_reason = "length"
                    return
                step(tok)
        finally:
            if prefill_ms >= 0:
                p = perf(ctx.ctx)
                req.prefill_s = prefill_ms / 1000
                req.decode_s = (p.t_p_eval_ms + p.t_eval_ms - prefill_ms) / 1000 + getattr(spec, "seconds", 0)
            sampler.close()

    def _decode_step(self) -> Any:
        """A function that evaluates one sampled token: ``Llama.eval`` without its per-call
        bookkeeping (a KV-cache trim, a Python loop over the batch), which costs a few percent of
        a small model's decode step. Falls back to ``Llama.eval`` if the internals differ."""
        import llama_cpp

        llm = self._llm
        batch = getattr(getattr(llm, "_batch", None), "batch", None)
        if batch is None or not hasattr(batch, "token"):
            return lambda tok: llm.eval((tok,))
        batch.seq_id[0][0] = 0
        batch.n_seq_id[0] = 1
        batch.logits[0] = True
        token, pos, input_ids = batch.token, batch.pos, llm.input_ids
        decode, ctx = llama_cpp.llama_decode, llm._ctx.ctx

        def step(tok: int) -> None:
            n_past = llm.n_tokens
            batch.n_tokens = 1
            token[0] = tok
            pos[0] = n_past
            rc = decode(ctx, batch)
            if rc != 0:
                raise eval_error(RuntimeError(f"llama_decode returned {rc}"))
            input_ids[n_past] = tok
            llm.n_tokens = n_past + 1

        return step

    def _sampler(self, params: SamplingParams) -> Any:
        from llama_cpp._internals import LlamaSampler

        s = LlamaSampler()
        fmt = params.output_format
        if fmt is not None:  # first in the chain: every later sampler sees only allowed tokens
            try:
                self._formats.add(s, fmt)
            except BaseException:
                s.close()
                raise
        if params.logit_bias:
            s.add_logit_bias(self._n_vocab, {int(k): float(v) for k, v in params.logit_bias.items()})
        if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
            s.add_penalties(
                self._n_vocab,
                64,
                params.repetition_penalty,
                params.frequency_penalty,
                params.presence_penalty,
            )
        if params.temperature == 0.0:
            s.add_greedy()
            return s
        seed = params.seed if params.seed is not None else self.options.seed
        if params.top_k:
            s.add_top_k(params.top_k)
        if params.top_p < 1.0:
            s.add_top_p(params.top_p, 1)
        if params.min_p > 0.0:
            s.add_min_p(params.min_p, 1)
        s.add_temp(params.temperature)
        s.add_dist(seed if seed is not None else 0xFFFFFFFF)  # LLAMA_DEFAULT_SEED: random
        return s

    def _one_token(self, text: str) -> int | None:
        ids = self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        return ids[0] if len(ids) == 1 else None

    # ---- chat and tokenizer ----

    def _chat_template(self) -> str | None:
        return gguf_chat_template(self._llm.metadata)

    def _special_tokens(self) -> dict[str, str]:
        llm = self._llm

        def text(tok: int) -> str:
            return llm.detokenize([tok], special=True).decode("utf-8", "replace") if tok >= 0 else ""

        return {"bos_token": text(llm.token_bos()), "eos_token": text(llm.token_eos())}

    def tokenize(self, text: str) -> list[int]:
        return self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._llm.detokenize(list(ids), special=True).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes(self._llm.detokenize([token_id], special=True))  # llama.cpp's piece is bytes

    # ---- kv_stats ----

    def kv_stats(self) -> KVStats:
        bpt = self._kv_bytes_per_token
        if (batcher := self._batcher) is not None:
            # the cells the sequences hold (running, and the kept prefixes), each sequence's
            # counted in full: a prefix two share counts twice
            capacity, used = self._n_ctx * batcher.parallel, batcher.used_cells
            return KVStats(
                capacity_tokens=capacity,
                used_tokens=used,
                bytes_per_token=bpt,
                capacity_bytes=bpt * capacity if bpt else None,
                used_bytes=bpt * used if bpt else None,
                dtype=self._kv_dtype,
                prefix_cache_queries=batcher.queries,
                prefix_cache_hits=batcher.hits,
                running_sequences=batcher.running,
                sequence_tokens=batcher.sequence_tokens,
            )
        used = self._llm.n_tokens
        return KVStats(
            capacity_tokens=self._n_ctx,
            used_tokens=used,
            bytes_per_token=bpt,
            capacity_bytes=bpt * self._n_ctx if bpt else None,
            used_bytes=bpt * used if bpt else None,
            dtype=self._kv_dtype,
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
        )

    def reset(self) -> None:
        """Empty the KV cache (the next request evaluates its whole prompt)."""
        if self._batcher is not None:
            self._batcher.clear()
            return
        with self._busy():
            self._llm.reset()
            self._llm._ctx.kv_cache_clear()

    # ---- close ----

    def _close(self) -> None:
        if (batcher := self.__dict__.pop("_batcher", None)) is not None:
            batcher.close()
        llm = self.__dict__.pop("_llm", None)
        if (draft := self.__dict__.pop("_draft", None)) is not None:
            draft.close()
        if llm is not None:
            llm.close()
