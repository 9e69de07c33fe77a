"""MLX through mlx-lm: HF-format models (plain or MLX-quantized) on Apple Silicon, and on Linux
CPUs through mlx's CPU build.

Generation wraps mlx-lm's ``stream_generate``. The adapter keeps one prompt cache and reuses the
longest prefix it shares with the next prompt (trimming the rest), so a chat that resends its
history pays only for the new turn; the reused count is reported in ``Usage``. mlx-lm has no stop
strings: the base class provides them. With ``batch_size`` > 1 requests join mlx-lm's
``BatchGenerator`` on a worker thread (``_batch``); with 1 they run one at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from unillm import BackendUnavailable, ConfigError, ModelFormatError, ModelLoadError, OutOfMemory
from unillm.backend import (
    STANDARD_SAMPLING,
    Availability,
    Capabilities,
    Cost,
    Engine,
    EngineConfig,
    EngineMemory,
    Facts,
    Fallback,
    KVStats,
    Pooling,
    RawPiece,
    RequestState,
    SamplingParams,
    check_chat_template,
    check_prompt,
    context_for,
    eos_from_hf_dir,
    hf_chat_template,
    hf_token_bytes,
    installed,
    kv_bytes_per_token,
    pooling_for,
    shared_prefix,
    task_for,
    warn,
)
from unillm.engines.mlx import _draft as spec  # speculative decoding (draft_model)
from unillm.engines.mlx._batch import Batcher, KeptCache, finished
from unillm.engines.mlx._embed import embed_batch, transformer
from unillm.engines.mlx._format import FormatGuide
from unillm.engines.mlx._lora import apply_peft_mlx, mlx_lora
from unillm.engines.mlx._model import (
    activation_dtype,
    bits_dtype,
    cache_offset,
    check_tokenizer,
    has_batch_generator,
    import_mlx_lm,
    model_dir,
)
from unillm.engines.mlx._sampling import MLXLogprobs, processors, sampler

if TYPE_CHECKING:
    import mlx.nn

__all__ = ["MLXEngine", "MLXOptions"]

INSTALL_HINT = "pip install 'unillm[mlx]'  (on Linux also: pip install 'mlx[cpu]')"


# ---- options ----

_MiB = 1 << 20

# mlx 0.32.4 / mlx-lm 0.32.2 on the CPU: the cache takes the weights' dtype (f32 for the f32
# tiny models: twice the f16 the generic plan assumes) and grows in steps of 256 tokens, so a
# loaded model holds only its weights; a prefill step of 2048 tokens (prefill_step_size)
# materializes f32 scores and a f32 mask (the CPU has no fused attention) and the MLP's rows
# (gate, up and their product: ~9 x hidden floats per token), which MLX's buffer cache keeps
# until it is cleared: the peak of a filled context is several times the weights.
MLX_MEMORY = EngineMemory(
    runtime_bytes=18 * _MiB,
    prefill_chunk=2048,
    score_bytes=4.0,
    kv_in_weights_dtype=True,
    kv_step=256,
    kv_upfront=False,
    row_floats_per_hidden=9.0,
)


class MLXOptions(BaseModel):
    """Load options of the MLX backend."""

    model_config = ConfigDict(extra="forbid")

    max_kv_size: int | None = Field(
        default=None,
        ge=16,
        description="Bound the KV cache to this many tokens (a rotating cache keeping the first 4); "
        "disables prefix reuse, since a rotated cache cannot be trimmed.",
    )
    kv_bits: Literal[2, 3, 4, 6, 8] | None = Field(
        default=None, description="Quantize the KV cache to these bits."
    )
    kv_group_size: int = Field(default=64, ge=1, description="Group size of the KV cache quantization.")
    quantized_kv_start: int = Field(
        default=0, ge=0, description="Quantize the KV cache once it holds this many tokens."
    )
    prompt_cache: bool = Field(default=True, description="Reuse the KV cache of a shared prompt prefix.")
    prefill_step_size: int = Field(default=2048, ge=1, description="Prompt tokens evaluated per step.")
    adapter_path: str | None = Field(default=None, description="A LoRA adapter directory to apply.")
    trust_remote_code: bool = Field(
        default=False, description="Allow a model's own Python code (off: unsafe)."
    )
    seed: int | None = Field(default=None, description="Default sampling seed for requests that set none.")
    batch_size: int = Field(
        default=8,
        ge=1,
        description="Sequences decoded together by mlx-lm's BatchGenerator (continuous batching); "
        "1 runs one request at a time.",
    )
    prefill_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="Batched mode: prompts prefilled together. Default: 1 on the CPU (a batch of "
        "prompts prefills no faster there than one after another, and the first wait less), "
        "min(batch_size, 8) on a GPU (mlx-lm's).",
    )
    draft_model: str | None = Field(default=None, description="Speculative: a draft model directory.")
    num_draft_tokens: int | None = Field(default=None, ge=1, description="Tokens drafted per step.")

    @model_validator(mode="after")
    def _check(self) -> MLXOptions:
        if (self.prefill_batch_size or 0) > self.batch_size:
            raise ValueError(
                f"prefill_batch_size={self.prefill_batch_size} exceeds batch_size={self.batch_size}: "
                "lower it or raise batch_size"
            )
        return spec.check_options(self)  # type: ignore[no-any-return]


class MLXEngine(Engine[MLXOptions]):
    """HF-format and MLX-quantized models through mlx-lm."""

    name: ClassVar[str] = "mlx"
    #: its memory as measured for the planner (measured: the comment above)
    memory = MLX_MEMORY
    formats: ClassVar[frozenset[str]] = frozenset({"mlx", "safetensors"})
    capabilities: ClassVar[Capabilities] = Capabilities(
        sampling=STANDARD_SAMPLING | {"response_format"},  # through llguidance (engines/mlx/_format.py)
        batching=False,  # True on an engine whose batch_size > 1 (mlx-lm's BatchGenerator)
        lora=True,
        embeddings=True,  # loaded with task="embed": the final hidden states pooled (engines/mlx/_embed.py)
        devices=frozenset({"cpu", "metal"}),
        speculative=True,
    )
    #: it pools the final hidden states itself: any pooling, per call
    pools_per_call: ClassVar[bool] = True
    Options: ClassVar[type[BaseModel]] = MLXOptions
    install_hint: ClassVar[str | None] = INSTALL_HINT

    # ---- availability ----

    @classmethod
    def available(cls) -> Availability:
        return installed(("mlx", "mlx"), ("mlx_lm", "mlx-lm"), hint=INSTALL_HINT)

    @classmethod
    def capabilities_for(cls, options: Any) -> Capabilities:
        """With ``batch_size`` > 1 the engine batches (mlx-lm's ``BatchGenerator``)."""
        if getattr(options, "batch_size", 1) > 1:
            return replace(cls.capabilities, batching=True)
        return cls.capabilities

    @classmethod
    def fallbacks(cls, config: EngineConfig, facts: Facts) -> Sequence[Fallback]:
        """The base steps (a shorter context), then an 8-bit KV cache when ``kv_bits`` is unset and
        the engine would run one request at a time (``BatchGenerator`` does not quantize its cache,
        so the step would change nothing for a batching engine)."""
        steps = [*super().fallbacks(config, facts)]
        try:
            opts = MLXOptions(**config.options_for(cls.name))
        except ValueError:  # options the load refused: no steps of its own
            return steps
        if opts.kv_bits is None and not cls.capabilities_for(opts).batching:
            steps.append(Fallback("kv_bits=8", Cost.QUALITY, options={"kv_bits": 8}, kv_cache_dtype="q8"))
        return steps

    @classmethod
    def probe_build(cls, hardware: Any, findings: list[str]) -> Any:
        from unillm.engines.mlx._build import build  # Metal, CUDA or the CPU, from the installed wheels

        return build(hardware, findings)

    # ---- load ----

    def _load(self) -> None:
        opts = self.options
        # what auto_engine read while choosing (or, built directly, read now): never re-read here
        path, info = model_dir(self.config.model, self.facts)  # ModelNotFound / ModelFormatError
        check_tokenizer(path)
        avail = self.available()
        if not avail.available:
            raise BackendUnavailable(self.name, avail.reason, INSTALL_HINT)
        try:
            import mlx.core as mx

            mlx_lm = import_mlx_lm()  # before any other import of it: see there
            from mlx_lm.models import cache as mlx_cache
        except (ImportError, OSError) as exc:
            raise BackendUnavailable(self.name, f"mlx failed to import: {exc}", INSTALL_HINT) from exc
        adapter, peft = mlx_lora(self.config, opts.adapter_path, self.name)  # ConfigError
        try:
            loaded = mlx_lm.load(
                str(path),
                adapter_path=adapter,
                tokenizer_config={"trust_remote_code": opts.trust_remote_code},
                trust_remote_code=opts.trust_remote_code,
            )
            model, tokenizer = loaded[0], loaded[1]
        except ValueError as exc:
            if "not supported" in str(exc):
                raise ModelFormatError(
                    f"mlx-lm does not support the model_type {info.architecture!r} of "
                    f"{self.config.model!r}; upgrade mlx-lm or use another backend"
                ) from exc
            raise ModelLoadError(f"mlx-lm failed to load {self.config.model!r}: {exc}") from exc
        except KeyError as exc:  # a config.json without a key mlx-lm needs (model_type)
            raise ModelFormatError(
                f"mlx-lm cannot read the config.json of {self.config.model!r}: no {exc}"
            ) from exc
        except (FileNotFoundError, OSError) as exc:
            raise ModelFormatError(f"{self.config.model!r} is incomplete: {exc}") from exc
        except MemoryError as exc:
            raise OutOfMemory(f"the weights of {self.config.model!r} do not fit in memory") from exc
        if peft is not None or adapter is not None:
            apply_peft_mlx(model, peft)  # evaluated here: batched mode decodes on another thread
        self._mx = mx
        self._mlx_lm = mlx_lm
        self._cache_mod = mlx_cache
        self._model: mlx.nn.Module = model
        self._tokenizer = tokenizer
        self._info = info
        self._draft = spec.load_draft(mlx_lm, opts.draft_model, opts.num_draft_tokens, tokenizer)
        # mlx-lm's positions end at the trained context: a longer one is reduced to it (said)
        self._n_ctx = context_for(
            self.name, self.config.model, self.config.context_length, info.context_length
        )
        # a rotating cache (max_kv_size) has no window a prompt plus completion must fit
        self.context_length = self._n_ctx if self.options.max_kv_size is None else None
        self._template = template = hf_chat_template(path)
        if self.config.chat_template is None and template is not None:
            check_chat_template(template, source=str(path))  # a broken one fails at load
        self.vocab_size = info.vocab_size or len(tokenizer)
        # the model's declared end-of-sequence set (unillm._inspect._eos), the same on every backend
        self.eos_token_ids = eos_from_hf_dir(path, to_id=self._one_token, vocab_size=self.vocab_size)
        self._eos = self.eos_token_ids
        self._guide = FormatGuide(path, self.vocab_size, sorted(self._eos))  # llguidance, on first use
        tokenizer.eos_token_ids = set(self._eos)
        self._cache: list[Any] | None = None
        self._cache_tokens: list[int] = []
        self._queries = 0
        self._hits = 0
        budget = opts.max_kv_size or self._n_ctx  # batched mode's prefix reuse: one context's worth
        self._kept = KeptCache(mlx_cache, enabled=opts.prompt_cache, budget_tokens=budget)
        self._inflight: dict[int, int] = {}  # batched mode: request -> tokens it holds
        self._batcher: Batcher | None = None
        batched = self.capabilities.batching  # what capabilities_for declared for these options
        self.task = task_for(self.config, info)
        if self.task == "rerank":
            raise ConfigError(
                f"{self.name} runs no rerankers (cross-encoders) yet: load {self.config.model!r} with "
                "task='rerank' on vLLM (docs/embeddings.md#rerank)"
            )
        if self.task == "embed":  # one request at a time through the model's transformer, no batcher
            self.pooling = pooling_for(self.config, info)
            self._transformer = transformer(model)
            if self._transformer is None:
                raise ModelLoadError(
                    f"mlx-lm's model for {info.architecture!r} keeps no transformer (model.model) "
                    "whose hidden states unillm could pool; embed it on llama.cpp or vLLM"
                )
            self.capabilities = replace(self.capabilities, batching=False)  # type: ignore[misc]
            batched = False
        if batched and not has_batch_generator():
            warn(
                f"this mlx-lm has no BatchGenerator: batch_size={opts.batch_size} runs one request at a "
                "time; upgrade mlx-lm (>= 0.32) or load with batch_size=1"
            )
            one = opts.model_copy(update={"batch_size": 1})
            self.capabilities = type(self).capabilities_for(one)  # type: ignore[misc]
            batched = False
        if batched:
            if opts.kv_bits is not None:
                warn(
                    f"mlx-lm's BatchGenerator does not quantize the KV cache: kv_bits={opts.kv_bits} "
                    "applies with batch_size=1 only"
                )
            self._batcher = Batcher(
                model,
                sorted(self._eos),
                batch_size=opts.batch_size,
                prefill_batch_size=opts.prefill_batch_size,
                prefill_step_size=opts.prefill_step_size,
                max_kv_size=opts.max_kv_size,
            )
        # the KV cache's element type: the model's activations', or kv_bits' when mlx-lm quantizes
        bits = opts.kv_bits if not batched else None
        self._kv_dtype = activation_dtype(model, info) if bits is None else bits_dtype(bits)

    # ---- embed ----

    def _embed(self, batch: list[list[int]], pooling: Pooling) -> Any:
        return embed_batch(self._mx, self._transformer, batch, pooling)

    # ---- stream ----

    def _encode(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        tok = self._tokenizer
        if isinstance(prompt, str):
            bos = tok.bos_token
            ids = list(tok.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos)))
        else:
            ids = list(prompt)  # the base class checked the ids against the vocabulary
        # a rotating cache (max_kv_size) takes any prompt length
        check_prompt(ids, self._n_ctx if self.options.max_kv_size is None else None, params.max_tokens)
        if (fmt := params.output_format) is not None:
            self._guide.check(fmt)  # refused at the call, not at the first token
        spec.check_request(self._draft, params)
        return ids

    def _draw(self, params: SamplingParams) -> Any:
        """mlx-lm's sampler for ``params``, limited to what its response format allows."""
        draw = sampler(self._mx, params, self.options.seed)
        fmt = params.output_format
        return draw if fmt is None else self._guide.constrain(self._mx, draw, fmt)

    def _stream(self, ids: list[int], params: SamplingParams, req: RequestState) -> Iterator[RawPiece]:
        if self._batcher is not None:
            return self._stream_batched(ids, params, req)
        return self._stream_single(ids, params, req)

    def _stream_single(self, ids: list[int], params: SamplingParams, req: RequestState) -> Iterator[RawPiece]:
        mx, opts, tokenizer = self._mx, self.options, self._tokenizer
        req.prompt_tokens = len(ids)
        cached = self._reuse_prefix(ids)
        req.cached_tokens = cached
        self._queries += len(ids)
        self._hits += cached
        seen = self._cache_tokens = list(ids[:cached])

        max_tokens = params.max_tokens
        if opts.max_kv_size is None:
            max_tokens = min(max_tokens, self._n_ctx - len(ids))
        want_lp = params.logprobs is not None
        lps = MLXLogprobs(params, processors(params), draft=self._draft is not None)
        stop_ids = frozenset(params.stop_token_ids)
        if params.ignore_eos:
            tokenizer.eos_token_ids = set()
        gen = self._mlx_lm.stream_generate(
            self._model,
            tokenizer,
            mx.array(ids[cached:]),
            max_tokens=max_tokens,
            sampler=self._draw(params),
            logits_processors=lps.processors,
            prompt_cache=self._cache,
            prefill_step_size=opts.prefill_step_size,
            kv_bits=opts.kv_bits,
            kv_group_size=opts.kv_group_size,
            quantized_kv_start=opts.quantized_kv_start,
            **spec.draft_kwargs(self._draft),
        )
        tally = spec.Tally(self._draft, max_tokens, req)
        seen.extend(ids[cached:])
        last = None
        n = 0
        try:
            for last in gen:
                tok = last.token
                tally.see(last.from_draft)
                seen.append(tok)
                if last.finish_reason == "stop" and tok in tokenizer.eos_token_ids:
                    req.finish_reason = "stop"
                    if last.text:  # text the detokenizer held back for earlier tokens
                        yield last.text, (), None
                    return
                if tok in stop_ids:
                    req.finish_reason = "stop"
                    return
                n += 1
                lp = lps(last.logprobs, tok) if want_lp else None
                yield last.text, (tok,), lp
                if last.finish_reason == "length" or n >= max_tokens:
                    req.finish_reason = "length"
                    return
        finally:
            gen.close()
            tokenizer.eos_token_ids = self._eos
            # What the cache holds now: everything fed to the model, which is what we saw.
            offset = spec.settle(self._draft, self._cache, self._model, self._cache_mod)
            self._cache_tokens = seen[:offset] if offset is not None else []
            if last is not None:
                evaluated = len(ids) - cached
                req.prefill_s = evaluated / last.prompt_tps if last.prompt_tps else None
                req.decode_s = last.generation_tokens / last.generation_tps if last.generation_tps else 0.0
                req.peak_memory_bytes = int(last.peak_memory * 1e9)

    def _stream_batched(
        self, ids: list[int], params: SamplingParams, req: RequestState
    ) -> Iterator[RawPiece]:
        batcher = self._batcher  # close() drops the attribute while this stream may still run
        assert batcher is not None
        req.prompt_tokens = len(ids)
        cache, cached = self._kept.take(ids)
        req.cached_tokens = cached
        self._queries += len(ids)
        self._hits += cached
        max_tokens = params.max_tokens
        if self.options.max_kv_size is None:
            max_tokens = min(max_tokens, self._n_ctx - len(ids))
        lps = MLXLogprobs(params, processors(params))
        live = batcher.submit_prompt(
            ids[cached:],
            max_tokens=max_tokens,
            sampler=self._draw(params),
            processors=lps.processors,
            ignore_eos=params.ignore_eos,
            cache=cache,
            history=ids[:cached] if cached else None,
        )
        detok = self._tokenizer.detokenizer  # a fresh one per request
        stop_ids = frozenset(params.stop_token_ids)
        want_lp = params.logprobs is not None
        key = id(req)
        self._inflight[key] = len(ids)
        try:
            # the worker's events up to the last one; leaving early cancels the sequence
            with closing(batcher.events(live, last=finished)) as events:  # type: ignore[type-var]
                for r in events:
                    tok = r.token
                    if r.finish_reason == "stop":  # the end-of-sequence token (never with ignore_eos)
                        req.finish_reason = "stop"
                        self._kept.keep(r)
                        detok.finalize()
                        if detok.last_segment:
                            yield detok.last_segment, (), None
                        return
                    if tok in stop_ids:
                        req.finish_reason = "stop"
                        return
                    detok.add_token(tok)
                    self._inflight[key] += 1
                    lp = lps(r.logprobs, tok) if want_lp else None
                    if r.finish_reason == "length":
                        req.finish_reason = "length"
                        self._kept.keep(r)
                        detok.finalize()
                        yield detok.last_segment, (tok,), lp
                        return
                    yield detok.last_segment, (tok,), lp
        finally:
            self._inflight.pop(key, None)
            req.peak_memory_bytes = int(self._mx.get_peak_memory())

    def _reuse_prefix(self, ids: list[int]) -> int:
        """Trim the prompt cache to the longest prefix it shares with ``ids`` (keeping at least
        one token to evaluate); make a fresh cache where reuse is off or impossible."""
        cache_mod = self._cache_mod
        if (
            self.options.prompt_cache
            and self._cache is not None
            and cache_mod.can_trim_prompt_cache(self._cache)
        ):
            keep = shared_prefix(self._cache_tokens, ids)
            offset = cache_offset(self._cache) or 0
            if offset - keep > 0:
                cache_mod.trim_prompt_cache(self._cache, offset - keep)
            if keep:
                return keep
        self._cache = spec.make_cache(self._draft, cache_mod, self._model, self.options.max_kv_size)
        return 0

    # ---- chat and tokenizer ----

    def _chat_template(self) -> str | None:
        return self._template

    def _special_tokens(self) -> dict[str, str]:
        tok = self._tokenizer
        return {"bos_token": tok.bos_token or "", "eos_token": tok.eos_token or ""}

    def tokenize(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def _one_token(self, text: str) -> int | None:
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        return int(ids[0]) if len(ids) == 1 else None

    def detokenize(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids)))

    def token_bytes(self, token_id: int) -> bytes:
        return hf_token_bytes(self._tokenizer, token_id)

    # ---- kv_stats ----

    def kv_stats(self) -> KVStats:
        info, dtype = self._info, self._kv_dtype
        bpt = None
        if info.layers and info.kv_heads and info.head_dim and dtype:
            bpt = kv_bytes_per_token(info.layers, info.kv_heads, info.head_dim, dtype)
        capacity = self.options.max_kv_size or self._n_ctx
        if self._batcher is not None:
            # batched: each of batch_size sequences may hold a whole context; sizes are estimates
            used = sum(self._inflight.values()) + self._kept.tokens
            used_bytes = bpt * used if bpt else None
            capacity *= self.options.batch_size
            bits = None  # BatchGenerator keeps its cache unquantized
        else:
            used = cache_offset(self._cache) or 0
            used_bytes = sum(int(c.nbytes) for c in self._cache) if self._cache else 0
            bits = self.options.kv_bits
        return KVStats(
            capacity_tokens=capacity,
            used_tokens=used,
            bytes_per_token=bpt,
            capacity_bytes=bpt * capacity if bpt else None,
            used_bytes=used_bytes,
            dtype=f"{bits}-bit" if bits else None,
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
        )

    def reset(self) -> None:
        """Drop the prompt cache (the next request evaluates its whole prompt)."""
        with self._busy():
            self._cache = None
            self._cache_tokens = []
            self._kept.clear()

    # ---- close ----

    def _close(self) -> None:
        if self._batcher is not None:
            self._batcher.close()
            self._batcher = None
        for attr in ("_model", "_tokenizer", "_cache", "_kept", "_draft"):
            self.__dict__.pop(attr, None)
        mx = self.__dict__.get("_mx")
        if mx is not None:
            mx.clear_cache()
