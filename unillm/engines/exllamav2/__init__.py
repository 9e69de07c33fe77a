"""ExLlamaV2: EXL2-quantized and unquantized FP16/BF16 Hugging Face models on NVIDIA (CUDA) and AMD
(ROCm) GPUs, one model split across several GPUs if need be.

Every request becomes a job of exllamav2's dynamic generator; a worker thread iterates it, so
concurrent callers' jobs share forward passes (continuous batching, in paged mode). Stop strings and
stop token ids go into each job's stop conditions, so generation ends inside exllamav2 at once; the
base class's stop matching stays as an identical second check. The KV cache is one pool shared by
all jobs, in 256-token pages; full pages of finished prompts stay for prefix reuse, reported as
cached tokens. exllamav2 has no chat templates: the model's HF template renders in unillm's sandbox.
A response format becomes a sampling filter of the job, backed by llguidance (_format.py).
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import replace
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from unillm import BackendUnavailable, ConfigError, ContextLengthExceeded, GenerationError
from unillm.backend import (
    DEFAULT_CONTEXT,
    STANDARD_SAMPLING,
    Availability,
    Capabilities,
    Cost,
    Engine,
    EngineConfig,
    Facts,
    Fallback,
    KVStats,
    RawPiece,
    RequestState,
    SamplingParams,
    Suitability,
    check_prompt,
    context_for,
    eos_from_hf_dir,
    gpu_present,
    hf_chat_template,
    installed,
    kv_bytes_per_token,
    kv_dtype,
    warn,
)
from unillm.engines.exllamav2._jobs import JobRunner, job_done
from unillm.engines.exllamav2._load import (
    CACHE_CLASSES,
    checked_dir,
    exllamav2_lora,
    generation_error,
    load_error,
    load_tokenizer,
    load_weights,
    model_config,
    paged_attention_installed,
    set_lengths,
)

__all__ = ["ASSUME_GPU_ENV", "ExLlamaV2Engine", "ExLlamaV2Options"]

INSTALL_HINT = "pip install 'unillm[exllamav2]'"
NO_GPU = (
    "needs an NVIDIA (CUDA) or AMD (ROCm) GPU and found none; use llama.cpp for GGUF models, or MLX on a Mac"
)
#: "1" skips the GPU probe and assumes a GPU, "0" assumes none: for tests (against a fake exllamav2)
#: and for machines whose GPU the probe cannot see.
ASSUME_GPU_ENV = "UNILLM_EXLLAMAV2_ASSUME_GPU"
_PAGE = 256  # exllamav2's cache page; the cache holds whole pages
_DRAFT_TOKENS = 4  # tokens a draft model proposes per step: exllamav2's default
_Prepared = tuple[list[int], Any, list[Any]]  # a request's prompt ids, its tensor, its job's filters


# ---- options ----


class ExLlamaV2Options(BaseModel):
    """Load options of the ExLlamaV2 backend."""

    model_config = ConfigDict(extra="forbid")

    max_seq_len: int | None = Field(
        default=None,
        ge=16,
        description="Longest sequence (prompt + completion); default: the config's context_length, "
        f"else min(the model's trained context, {DEFAULT_CONTEXT}).",
    )
    cache_size: int | None = Field(
        default=None,
        ge=_PAGE,
        description="Tokens the KV cache holds, shared by all running requests (rounded up to a "
        "multiple of 256, at least max_seq_len); default: max_seq_len x max_batch_size.",
    )
    cache_type: Literal["fp16", "q8", "q6", "q4"] = Field(
        default="fp16", description="KV cache precision: FP16, or quantized to 8, 6 or 4 bits."
    )
    gpu_split: list[float] | None = Field(
        default=None,
        description="GB of weights to put on each GPU, in order (e.g. [20, 24]); None splits "
        "automatically, filling each GPU in turn with weights and cache.",
    )
    max_batch_size: int = Field(
        default=8, ge=1, description="Requests decoded together (paged mode; unpaged runs one at a time)."
    )
    max_chunk_size: int | None = Field(
        default=None,
        ge=_PAGE,
        description="Prompt tokens evaluated per step, a multiple of 256; default 2048. Smaller "
        "chunks pause running requests for less time when a long prompt arrives.",
    )
    paged: bool | None = Field(
        default=None,
        description="Paged attention (needs flash-attn >= 2.5.7), which batching requires; None: "
        "on when such a flash-attn is installed (off, with a warning, if exllamav2 cannot use it).",
    )
    draft_model: str | None = Field(
        default=None,
        description="A small model directory with the same vocabulary, for speculative decoding.",
    )
    num_draft_tokens: int | None = Field(
        default=None, ge=1, le=8, description=f"Tokens drafted per step (at most 8); default {_DRAFT_TOKENS}."
    )
    seed: int | None = Field(default=None, description="Default sampling seed for requests that set none.")

    @field_validator("max_chunk_size")
    @classmethod
    def _whole_pages(cls, value: int | None) -> int | None:
        if value is not None and value % _PAGE:
            raise ValueError(f"must be a multiple of {_PAGE}")
        return value

    @field_validator("gpu_split")
    @classmethod
    def _positive(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and (not value or any(gb <= 0 for gb in value)):
            raise ValueError("give a positive number of GB for each GPU")
        return value


class ExLlamaV2Engine(Engine[ExLlamaV2Options]):
    """EXL2 and FP16/BF16 HF models through exllamav2's dynamic generator."""

    name: ClassVar[str] = "exllamav2"
    formats: ClassVar[frozenset[str]] = frozenset({"exl2", "safetensors"})
    capabilities: ClassVar[Capabilities] = Capabilities(
        # response_format: a job filter over llguidance (engines/exllamav2/_format.py)
        sampling=(STANDARD_SAMPLING | {"response_format"}) - {"logprobs", "top_logprobs", "logit_bias"},
        batching=False,  # True on an engine in paged mode (the dynamic generator batches jobs)
        lora=True,  # one adapter for every job (generator.set_loras)
        devices=frozenset({"cuda", "rocm"}),
        speculative=True,
    )
    Options: ClassVar[type[BaseModel]] = ExLlamaV2Options
    install_hint: ClassVar[str | None] = INSTALL_HINT

    # ---- availability ----

    @classmethod
    def available(cls) -> Availability:
        if not gpu_present(ASSUME_GPU_ENV):
            return Availability(False, NO_GPU, INSTALL_HINT)
        return installed(("exllamav2", "exllamav2"), hint=INSTALL_HINT)

    @classmethod
    def suitability(cls, hardware: Any, model: Any, workload: Any, plan: Any = None) -> Suitability:
        fit = super().suitability(hardware, model, workload)
        if fit.blockers:
            return fit
        why = "needs a CUDA or ROCm GPU; splits one model across several GPUs"
        if getattr(model, "format", None) == "safetensors":
            return Suitability(0.8, (*fit.reasons, "loads unquantized FP16/BF16 weights", why))
        return Suitability(fit.score, (*fit.reasons, why))

    @classmethod
    def capabilities_for(cls, options: Any) -> Capabilities:
        """Paged mode batches: ``paged=True``, or, left unset, when a flash-attn exllamav2 pages
        with is installed (found without importing it)."""
        paged = getattr(options, "paged", None)
        if paged is None:
            paged = paged_attention_installed()
        return replace(cls.capabilities, batching=True) if paged else cls.capabilities

    @classmethod
    def fallbacks(cls, config: EngineConfig, facts: Facts) -> Sequence[Fallback]:
        """The base steps (a shorter context), then a quantized KV cache, which exllamav2
        allocates whole at load: Q8 when the cache is FP16, then Q4 (exllamav2's Q4 cache keeps
        close to FP16's quality, and costs less than a shorter context)."""
        steps = [*super().fallbacks(config, facts)]
        cache_type = config.options_for(cls.name).get("cache_type", "fp16")
        if cache_type == "fp16":
            steps.append(_cache_step("q8"))
        if cache_type in ("fp16", "q8", "q6"):
            steps.append(_cache_step("q4"))
        return steps

    @classmethod
    def probe_build(cls, hardware: Any, findings: list[str]) -> Any:
        from unillm.engines.exllamav2._build import build  # CUDA or ROCm, from the installed wheel

        return build(hardware, findings)

    # ---- load ----

    def _load(self) -> None:
        opts = self.options
        path = checked_dir(self.config.model, self.facts, "model")  # ModelNotFound / ModelFormatError
        avail = self.available()
        if not avail.available:
            raise BackendUnavailable(self.name, avail.reason, INSTALL_HINT)
        if opts.max_seq_len and self.config.context_length and opts.max_seq_len != self.config.context_length:
            raise ConfigError(
                f"context_length={self.config.context_length} and options max_seq_len={opts.max_seq_len} "
                "disagree; set only one"
            )
        try:
            import exllamav2 as exl
            from exllamav2 import attn
            from exllamav2.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler

            from unillm.engines.exllamav2._format import Formats  # it subclasses exllamav2's filter
        except (ImportError, OSError, RuntimeError) as exc:  # its import builds a CUDA extension
            raise BackendUnavailable(self.name, f"exllamav2 failed to import: {exc}", INSTALL_HINT) from exc

        config = model_config(exl, path, "model")
        n_ctx = context_for(
            self.name, self.config.model, opts.max_seq_len or self.config.context_length, config.max_seq_len
        )
        if opts.num_draft_tokens and not opts.draft_model:
            raise ConfigError("num_draft_tokens is set without draft_model; set both or neither")
        draft_tokens = (opts.num_draft_tokens or _DRAFT_TOKENS) if opts.draft_model else 0
        have_paged = bool(getattr(attn, "has_flash_attn_with_paged", False)) and not config.no_flash_attn
        paged = self.capabilities.batching  # what capabilities_for declared for these options
        if paged and not have_paged:
            if opts.paged:
                raise ConfigError(
                    "paged=True needs flash-attn >= 2.5.7 on a GPU that supports it; leave it unset"
                )
            why = "the model's config turns flash-attn off" if config.no_flash_attn else "it found none"
            warn(
                "flash-attn is installed, but exllamav2 cannot use its paged attention here "
                f"({why}): running unpaged, one request at a time; load with paged=False to say so"
            )
            paged = False
            unpaged = opts.model_copy(update={"paged": False})
            self.capabilities = type(self).capabilities_for(unpaged)  # type: ignore[misc]
        batch = opts.max_batch_size if paged else 1
        set_lengths(config, n_ctx + draft_tokens, opts.max_chunk_size)
        if batch * 8 > config.max_batch_size * config.max_input_len:  # 8: exllamav2's max_q_size
            raise ConfigError(f"max_batch_size={batch} needs max_chunk_size >= {batch * 8}")
        want = opts.cache_size or n_ctx * batch
        cache_size = -(-max(want, n_ctx + draft_tokens) // _PAGE) * _PAGE
        cache_cls = getattr(exl, CACHE_CLASSES[opts.cache_type])

        model, cache = load_weights(exl, config, cache_cls, cache_size, opts.gpu_split, "model")
        loaded = [model]
        try:
            draft = draft_cache = None
            if opts.draft_model:
                dpath = checked_dir(opts.draft_model, self.facts.for_path(opts.draft_model), "draft model")
                dconfig = model_config(exl, dpath, "draft model")
                if dconfig.vocab_size != config.vocab_size:
                    raise ConfigError(
                        f"the draft model's vocabulary ({dconfig.vocab_size}) differs from the model's "
                        f"({config.vocab_size}); speculative decoding needs the same tokenizer"
                    )
                set_lengths(dconfig, n_ctx + draft_tokens, opts.max_chunk_size)
                draft, draft_cache = load_weights(exl, dconfig, cache_cls, cache_size, None, "draft model")
                loaded.append(draft)
            tokenizer = load_tokenizer(exl, config, path)
            try:
                generator = ExLlamaV2DynamicGenerator(
                    model=model,
                    cache=cache,
                    tokenizer=tokenizer,
                    max_batch_size=batch,
                    max_chunk_size=opts.max_chunk_size,
                    paged=paged,
                    draft_model=draft,
                    draft_cache=draft_cache,
                    num_draft_tokens=draft_tokens or _DRAFT_TOKENS,
                )
            except Exception as exc:
                raise load_error(exc, "generator", "cache", str(path)) from exc
            self._lora = exllamav2_lora(exl, model, generator, self.config, self.name)  # or None
        except BaseException:
            for m in loaded:
                m.unload()
            raise
        self._models = loaded
        self._config = config
        self._cache = cache
        self._tokenizer = tokenizer
        self._generator = generator
        self._Job = ExLlamaV2DynamicJob
        self._Settings = ExLlamaV2Sampler.Settings
        # Tensors come from a tensor exllamav2 made (Tensor.new_tensor): no torch import here.
        self._proto = tokenizer.single_token(0)
        self._n_ctx = self.context_length = n_ctx
        self._draft_tokens = draft_tokens
        self.vocab_size = tokenizer.get_vocab_size()
        # the model's declared end-of-sequence set (unillm._inspect._eos), the same on every backend
        self.eos_token_ids = eos_from_hf_dir(path, to_id=tokenizer.single_id, vocab_size=self.vocab_size)
        self._eos = tuple(sorted(self.eos_token_ids))
        self._formats = Formats(path, self.vocab_size, self._eos, model, tokenizer)  # llguidance, on use
        tok_cfg = tokenizer.tokenizer_config_dict or {}
        self._add_bos = bool(tok_cfg.get("add_bos_token", False))
        self._template = hf_chat_template(path, tok_cfg)
        # the one KV formula, for the cache exllamav2 allocated (its Q8/Q6/Q4 scales included)
        self._bpt = kv_bytes_per_token(
            config.num_hidden_layers, config.num_key_value_heads, config.head_dim, kv_dtype(opts.cache_type)
        )
        self._stats_lock = threading.Lock()
        self._queries = 0
        self._hits = 0
        self._runner = JobRunner(generator)

    # ---- stream ----

    def _encode(self, prompt: str | Sequence[int], params: SamplingParams) -> _Prepared:
        tok = self._tokenizer
        if isinstance(prompt, str):
            add_bos = self._add_bos and not (tok.bos_token and prompt.startswith(tok.bos_token))
            tensor = tok.encode(prompt, add_bos=add_bos, encode_special_tokens=True)
            ids = [int(t) for t in tensor[0].tolist()]
        else:
            ids = list(prompt)  # the base class checked the ids against the vocabulary
            tensor = self._proto.new_tensor([ids])
        check_prompt(ids, self._n_ctx, params.max_tokens)
        if len(ids) + params.max_tokens > self._n_ctx:
            exc = ContextLengthExceeded(len(ids), self._n_ctx, params.max_tokens)
            exc.args = (
                f"a prompt of {len(ids)} tokens plus max_tokens={params.max_tokens} does not fit the "
                f"context window of {self._n_ctx} tokens (ExLlamaV2 reserves the whole completion's "
                "cache up front). Lower max_tokens, shorten the prompt or load with a larger max_seq_len.",
            )
            raise exc
        return ids, tensor, self._formats.filters(params.output_format)  # compiled, or refused, now

    def _stream(self, prepared: _Prepared, params: SamplingParams, req: RequestState) -> Iterator[RawPiece]:
        ids, tensor, filters = prepared
        req.prompt_tokens = len(ids)
        stops: list[int | str] = [*params.stop_token_ids, *(() if params.ignore_eos else self._eos)]
        seed = params.seed if params.seed is not None else self.options.seed
        job = self._Job(
            input_ids=tensor,
            # exllamav2 ends a job num_draft_tokens early when it drafts: ask for that many more
            max_new_tokens=params.max_tokens + self._draft_tokens,
            gen_settings=self._settings(params),
            seed=seed,
            stop_conditions=list(dict.fromkeys([*stops, *params.stop])),
            filters=filters,  # the response format; its end tokens are the stop tokens above
        )
        runner = self._runner  # close() drops the attribute while this stream may still run
        live = runner.submit(job)
        try:
            # the job's results up to the last one; leaving early cancels the job (frees its pages)
            with closing(runner.events(live, last=job_done)) as events:  # type: ignore[type-var]
                for r in events:
                    text: str = r.get("text", "")
                    out = tuple(r["token_ids"][0].tolist()) if "token_ids" in r else ()
                    if r["eos"]:
                        reason = r.get("eos_reason")
                        if reason == "stop_token":
                            text, out = self._held_before_stop(r)
                        req.finish_reason = "length" if reason == "max_new_tokens" else "stop"
                        if reason == "stop_string":
                            req.stop_sequence = r.get("eos_triggering_string")
                        req.prompt_tokens = r.get("prompt_tokens", len(ids))
                        req.cached_tokens = r.get("cached_tokens")
                        req.prefill_s = r.get("time_prefill")
                        req.decode_s = r.get("time_generate")
                        if "accepted_draft_tokens" in r:  # the drafts it verified, and kept
                            req.accepted_draft_tokens = a = r["accepted_draft_tokens"]
                            req.draft_tokens = a + r.get("rejected_draft_tokens", 0)
                        with self._stats_lock:  # prompt tokens looked up, and those the cache held
                            self._queries += req.prompt_tokens
                            self._hits += req.cached_tokens or 0
                    if text or out:
                        yield text, out, None
        except Exception as exc:  # a failed step (the worker's), or a closed engine
            err = generation_error(exc)
            if err is exc:
                raise
            raise err from exc

    def _held_before_stop(self, r: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
        """Text exllamav2 still held (a partial stop string, an unfinished character) when a stop
        token ended the job: it reports it under ``held``, with the stop token last."""
        held = r.get("held") or {}
        ids = held["token_ids"][0].tolist()[:-1] if "token_ids" in held else []
        if not ids:
            return "", ()
        return str(self._tokenizer.decode(self._proto.new_tensor(ids))), tuple(int(t) for t in ids)

    def _settings(self, params: SamplingParams) -> Any:
        penalties = {
            "token_repetition_penalty": params.repetition_penalty,
            "token_presence_penalty": params.presence_penalty,
            "token_frequency_penalty": params.frequency_penalty,
        }
        if params.temperature == 0.0:
            return self._Settings.greedy(**penalties)
        return self._Settings(
            temperature=params.temperature,
            top_k=params.top_k or 0,
            top_p=params.top_p if params.top_p < 1.0 else 0.0,
            min_p=params.min_p,
            **penalties,
        )

    # ---- chat and tokenizer ----

    def _chat_template(self) -> str | None:
        return self._template

    def _special_tokens(self) -> dict[str, str]:
        tok = self._tokenizer
        return {"bos_token": tok.bos_token or "", "eos_token": tok.eos_token or ""}

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in self._tokenizer.encode(text, encode_special_tokens=True)[0].tolist()]

    def detokenize(self, ids: Sequence[int]) -> str:
        tensor = self._proto.new_tensor([int(t) for t in ids])
        return str(self._tokenizer.decode(tensor, decode_special_tokens=True))

    # ---- kv_stats ----

    def kv_stats(self) -> KVStats:
        gen, bpt = self._generator, self._bpt
        capacity = int(self._cache.max_seq_len)
        # the page table belongs to the worker thread: read it there, between two steps
        in_use = self._runner.call(lambda: [int(page.kv_position) for page in gen.referenced_pages.values()])
        used = sum(in_use)
        paged = bool(gen.paged)
        return KVStats(
            capacity_tokens=capacity,
            used_tokens=used,
            bytes_per_token=bpt,
            capacity_bytes=bpt * capacity,
            used_bytes=bpt * used,
            block_size=int(gen.page_size) if paged else None,
            total_blocks=int(gen.max_pages) if paged else None,
            used_blocks=len(in_use) if paged else None,
            dtype=self.options.cache_type,
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
        )

    def reset(self) -> None:
        """Forget the cached prefix pages (the next request evaluates its whole prompt)."""
        gen = self._generator

        def reset_pages() -> None:
            if gen.num_remaining_jobs():
                raise GenerationError("cannot reset the KV cache while requests are running")
            gen.reset_page_table()

        self._runner.call(reset_pages)

    # ---- close ----

    def _close(self) -> None:
        runner = self.__dict__.pop("_runner", None)
        if runner is not None:
            runner.close()
        for model in self.__dict__.pop("_models", ()):
            model.unload()
        for attr in ("_generator", "_cache", "_tokenizer", "_proto"):
            self.__dict__.pop(attr, None)
        gc.collect()  # the generator's page table refers back to it: the cache goes at a collection
        torch = sys.modules.get("torch")  # exllamav2 imported it; unillm never does
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()


# ---- helpers ----


def _cache_step(cache_type: str) -> Fallback:
    return Fallback(
        f"cache_type={cache_type}",
        Cost.QUALITY,
        options={"cache_type": cache_type},
        kv_cache_dtype=cache_type,
    )
