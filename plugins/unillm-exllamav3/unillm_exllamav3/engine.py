"""ExLlamaV3: EXL3-quantized (and unquantized FP16/BF16) Hugging Face models on NVIDIA GPUs, one
model split across 2-4 consumer GPUs by layers or by tensor (and expert) parallelism.

Every request becomes a ``Job`` of exllamav3's ``Generator``; a worker thread iterates it, so
concurrent callers' jobs share forward passes (continuous batching). Stop strings and stop token
ids go into each job's stop conditions, so generation ends inside exllamav3 at once; the base
class's stop matching stays as an identical second check. The KV cache is one pool of 256-token
pages shared by all jobs; full pages of finished prompts stay for prefix reuse, reported as cached
tokens. exllamav3 renders no chat template for us: the model's HF template renders in unillm's
sandbox. Written against unillm's public API only (``unillm``, ``unillm.backend``).
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import replace
from importlib.util import find_spec
from typing import Any, ClassVar

from pydantic import BaseModel

from unillm import BackendUnavailable, ConfigError, ContextLengthExceeded, GenerationError
from unillm.backend import (
    STANDARD_SAMPLING,
    Availability,
    Capabilities,
    Cost,
    Engine,
    EngineBuild,
    EngineConfig,
    Facts,
    Fallback,
    KVStats,
    RawPiece,
    Request,
    SamplingParams,
    Suitability,
    TopLogprobs,
    check_prompt,
    installed,
    logprobs_from_logits,
)
from unillm_exllamav3._jobs import JobRunner, job_done
from unillm_exllamav3._load import (
    checked_dir,
    eos_ids,
    generation_error,
    load_error,
    load_tokenizer,
    load_weights,
    model_config,
    template,
)
from unillm_exllamav3._options import (
    ASSUME_GPU_ENV,
    DEFAULT_CONTEXT,
    INSTALL_HINT,
    NO_GPU,
    PAGE,
    ExLlamaV3Options,
    nvidia_present,
)

__all__ = ["ASSUME_GPU_ENV", "INSTALL_HINT", "ExLlamaV3Engine", "ExLlamaV3Options", "nvidia_present"]

_CONSUMER_GPUS = 4  # the guide's case: 2-4 consumer NVIDIA GPUs


class ExLlamaV3Engine(Engine[ExLlamaV3Options]):
    """EXL3 (and FP16/BF16) models through exllamav3's generator."""

    name: ClassVar[str] = "exllamav3"
    formats: ClassVar[frozenset[str]] = frozenset({"exl3", "safetensors"})
    capabilities: ClassVar[Capabilities] = Capabilities(
        sampling=STANDARD_SAMPLING | {"min_tokens", "response_format"},
        batching=True,
        devices=frozenset({"cuda"}),
    )
    Options: ClassVar[type[BaseModel]] = ExLlamaV3Options
    install_hint: ClassVar[str | None] = INSTALL_HINT

    # ---- availability ----

    @classmethod
    def available(cls) -> Availability:
        if not nvidia_present():
            return Availability(False, NO_GPU, INSTALL_HINT)
        return installed(("exllamav3", "exllamav3"), hint=INSTALL_HINT)

    @classmethod
    def suitability(cls, hardware: Any, model: Any, workload: Any, plan: Any = None) -> Suitability:
        fit = super().suitability(hardware, model, workload)
        if fit.blockers:
            return fit
        gpus = getattr(hardware, "gpus", None)
        if hardware is not None and gpus is not None:
            nvidia = sum(1 for g in gpus if g.vendor == "nvidia")
            if not nvidia:
                amd = any(g.vendor == "amd" for g in gpus)
                return Suitability(
                    0.0,
                    fit.reasons,
                    ("exllamav3 runs on NVIDIA (CUDA) GPUs only, and this machine has AMD ones"
                     if amd else NO_GPU,),
                )  # fmt: skip
        else:
            nvidia = 0
        reasons = list(fit.reasons)
        if nvidia > 1:
            many = f"splits the model across {nvidia} NVIDIA GPUs (by layers, or tensor_parallel)"
            reasons.append(many if nvidia <= _CONSUMER_GPUS else f"{many}; built for 2-4 consumer GPUs")
        elif nvidia == 1:
            reasons.append("runs on one NVIDIA GPU")
        if getattr(model, "experts", None):
            reasons.append("MoE: expert parallelism across GPUs under tensor_parallel")
        if getattr(model, "format", None) == "safetensors":  # it reads them; other engines are better
            return Suitability(0.5, (*reasons, "loads unquantized FP16/BF16 weights too"))
        return Suitability(fit.score, tuple(reasons))

    @classmethod
    def capabilities_for(cls, options: Any) -> Capabilities:
        """Batching needs room for more than one request (``max_batch_size`` > 1)."""
        batch = getattr(options, "max_batch_size", 2)
        return cls.capabilities if batch > 1 else replace(cls.capabilities, batching=False)

    @classmethod
    def fallbacks(cls, config: EngineConfig, facts: Facts) -> Sequence[Fallback]:
        """What ``auto_engine`` tries, cheapest cost first: a quantized KV cache (exllamav3
        allocates the whole cache at load), Q8 when it is FP16, then Q4 (quality); half the batch,
        a cache pool for half as many requests at full length (speed: same output, fewer at once);
        then the base steps, a shorter context (capability)."""
        steps = [*super().fallbacks(config, facts)]
        opts = config.options_for(cls.name)
        batch = int(opts.get("max_batch_size", 8))
        if batch > 1 and not opts.get("cache_size"):
            steps.append(
                Fallback(f"max_batch_size={batch // 2}", Cost.SPEED, options={"max_batch_size": batch // 2})
            )
        cache_type = opts.get("cache_type", "fp16")
        if cache_type == "fp16":
            steps.append(_cache_step("q8"))
        if cache_type in ("fp16", "q8", "q6"):
            steps.append(_cache_step("q4"))
        return steps

    @classmethod
    def probe_build(cls, hardware: Any, findings: list[str]) -> Any:
        """The installed exllamav3, found without importing it (its import compiles CUDA code,
        and fails where there is no CUDA)."""
        if find_spec("exllamav3") is None:
            return None
        avail = installed(("exllamav3", "exllamav3"), hint=INSTALL_HINT)
        gpus = getattr(hardware, "gpus", ()) or ()
        if not any(g.vendor == "nvidia" for g in gpus):
            findings.append(
                "exllamav3 is installed but there is no NVIDIA GPU: it cannot run here (its import "
                "compiles CUDA code and fails without CUDA)"
            )
        elif find_spec("exllamav3_ext") is None and not (os.environ.get("CUDA_HOME") or shutil.which("nvcc")):
            findings.append(
                "exllamav3 has no prebuilt extension and there is no CUDA toolkit (nvcc, CUDA_HOME): "
                "its first import, which compiles one, will fail"
            )
        if gpus and any(g.vendor == "nvidia" for g in gpus) and find_spec("triton") is None:
            findings.append(
                "exllamav3 is installed but triton is not: exllamav3 1.6's attention and cache kernels "
                "are Triton's and it does not import without it (CUDA builds of torch bring it)"
            )
        return EngineBuild("exllamav3", avail.version, ("cuda",))

    # ---- load ----

    def _load(self) -> None:
        opts = self.options
        path = checked_dir(self.config.model, self.facts, "model")
        avail = self.available()
        if not avail.available:
            raise BackendUnavailable(self.name, avail.reason, INSTALL_HINT)
        if opts.max_seq_len and self.config.context_length and opts.max_seq_len != self.config.context_length:
            raise ConfigError(
                f"context_length={self.config.context_length} and options max_seq_len={opts.max_seq_len} "
                "disagree; set only one"
            )
        if opts.use_per_device and opts.reserve_per_device:
            raise ConfigError("set use_per_device or reserve_per_device, not both")
        try:
            import exllamav3 as exl
        except (ImportError, OSError, RuntimeError) as exc:  # its import compiles a CUDA extension
            raise BackendUnavailable(
                self.name, f"exllamav3 failed to import (it needs CUDA): {exc}", INSTALL_HINT
            ) from exc

        config = model_config(exl, path, "model")
        trained = int(getattr(config, "max_position_embeddings", 0) or DEFAULT_CONTEXT)
        n_ctx = opts.max_seq_len or self.config.context_length or min(trained, DEFAULT_CONTEXT)
        draft_tokens = opts.num_draft_tokens if opts.draft_model else 0
        batch = opts.max_batch_size
        want = opts.cache_size or n_ctx * batch
        # a job reserves its prompt, max_tokens + 1 and the draft window (and before exllamav3 1.6
        # one more, which its Job counted short)
        cache_size = -(-max(want, n_ctx + draft_tokens + 2) // PAGE) * PAGE
        model, cache = load_weights(exl, config, self.options, cache_size, "model", main=True)
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
                draft, draft_cache = load_weights(
                    exl, dconfig, self.options, cache_size, "draft model", main=False
                )
                loaded.append(draft)
            tokenizer = load_tokenizer(exl, config, path)
            try:
                generator = exl.Generator(
                    model=model,
                    cache=cache,
                    tokenizer=tokenizer,
                    max_batch_size=batch,
                    max_chunk_size=opts.max_chunk_size,
                    draft_model=draft,
                    draft_cache=draft_cache,
                    num_draft_tokens=draft_tokens or None,
                )
            except Exception as exc:
                raise load_error(exc, "generator", "cache", str(path)) from exc
        except BaseException:
            for m in loaded:
                m.unload()
            raise
        self._models, self._cache, self._tokenizer, self._generator = loaded, cache, tokenizer, generator
        self._Job, self._Combo = exl.Job, exl.ComboSampler
        self._Guide = getattr(exl, "LLGuidanceFilter", None)  # exllamav3's llguidance filter
        self._proto = tokenizer.single_token(0)  # makes tensors like exllamav3's: no torch import here
        # exllamav3 1.6 streams exactly max_new_tokens (ending inside a draft window too); before
        # it, the Job kept max_new_tokens - 1 and ended num_draft_tokens early: ask for that many
        # more there. The Job says which on construction (cheap: nothing is allocated)
        counts_short = int(exl.Job(input_ids=self._proto, max_new_tokens=2).max_new_tokens) < 2
        self._extra_tokens = 1 + draft_tokens if counts_short else 0
        self._n_ctx = self.context_length = n_ctx
        self.vocab_size = int(config.vocab_size or tokenizer.actual_vocab_size)
        self.eos_token_ids = eos_ids(config, tokenizer, self.vocab_size)
        self._eos = tuple(sorted(self.eos_token_ids))
        tok_cfg = tokenizer.tokenizer_config_dict or {}
        self._add_bos = bool(tok_cfg.get("add_bos_token", False))
        self._template = template(tokenizer, path)
        # bytes per token from the cache exllamav3 built (its quantized layers' scales included)
        layers = list(cache.layers.values())
        stored = sum(int(layer.storage_size()) for layer in layers)
        self._bpt = stored // cache.max_num_tokens if layers else None
        self._stats_lock = threading.Lock()
        self._queries = self._hits = 0
        self._runner = JobRunner(generator)

    # ---- stream ----

    def _encode(self, prompt: str | Sequence[int], params: SamplingParams) -> tuple[list[int], Any, Any]:
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
                f"context window of {self._n_ctx} tokens (exllamav3 reserves the whole completion's "
                "cache pages up front). Lower max_tokens, shorten the prompt or load with a larger "
                "max_seq_len.",
            )
            raise exc
        return ids, tensor, self._format_filter(params)

    def _format_filter(self, params: SamplingParams) -> Any:
        """The response format as exllamav3's llguidance filter, built at the call (a schema it
        cannot enforce is refused there, never dropped). The job ends when the format is
        complete; compact JSON, no free whitespace (a model can run on whitespace for ever)."""
        fmt = params.output_format
        if fmt is None:
            return None
        if self._Guide is None:
            raise ConfigError(
                "this exllamav3 has no LLGuidanceFilter: response_format needs exllamav3 >= 1.4"
            )
        schema = {**fmt.json_schema, "x-guidance": {"whitespace_flexible": False}}
        try:
            return self._Guide(self._tokenizer, eos_after_completed=True, json_schema=schema)
        except (ValueError, RuntimeError, AssertionError, ImportError) as exc:
            raise ConfigError(
                f"exllamav3's llguidance filter cannot enforce this response_format: {exc}"
            ) from exc

    def _stream(
        self, prepared: tuple[list[int], Any, Any], params: SamplingParams, req: Request
    ) -> Iterator[RawPiece]:
        ids, tensor, guide = prepared
        req.prompt_tokens = len(ids)
        stops: list[int | str] = [*params.stop_token_ids, *(() if params.ignore_eos else self._eos)]
        job = self._Job(
            input_ids=tensor,
            # exact from exllamav3 1.6 (see _load); the base class's max_tokens count is the limit
            max_new_tokens=params.max_tokens + self._extra_tokens,
            min_new_tokens=params.min_tokens,
            sampler=self._sampler(params),
            seed=params.seed if params.seed is not None else self.options.seed,
            stop_conditions=list(dict.fromkeys([*stops, *params.stop])),
            return_logits=params.logprobs is not None,  # the model's own, before the sampler
            filters=[guide] if guide is not None else None,
        )
        want_lp = params.logprobs is not None
        runner = self._runner  # close() drops the attribute while this stream may still run
        live = runner.submit(job)
        try:
            # the job's results up to the last one; leaving early cancels the job (frees its pages)
            with closing(runner.events(live, last=job_done)) as events:  # type: ignore[type-var]
                for r in events:
                    text: str = r.get("text", "")
                    out = tuple(int(t) for t in r["token_ids"][0].tolist()) if "token_ids" in r else ()
                    logits = r.get("logits")
                    if r["eos"]:
                        if r.get("eos_reason") == "stop_token":
                            text, out = self._held_before_stop(r)
                            logits = (r.get("held") or {}).get("logits")
                        self._finish(r, req, len(ids))
                    if text or out:
                        lp = self._logprobs(logits, out, params.logprobs or 0) if want_lp else None
                        yield text, out, lp
        except Exception as exc:  # a failed step (the worker's), or a closed engine
            err = generation_error(exc)
            if err is exc:
                raise
            raise err from exc

    def _finish(self, r: dict[str, Any], req: Request, prompt_tokens: int) -> None:
        reason = r.get("eos_reason")
        req.finish_reason = "length" if reason == "max_new_tokens" else "stop"
        if reason == "stop_string":  # exllamav3 matched it (and never streamed it): say which
            req.stop_sequence = r.get("eos_triggering_string")
        req.prompt_tokens = int(r.get("prompt_tokens", prompt_tokens))
        cached = r.get("cached_tokens")
        req.cached_tokens = int(cached) if cached is not None else None
        req.prefill_s = r.get("time_prefill")
        req.decode_s = r.get("time_generate")
        req.queue_s = r.get("time_enqueued")
        with self._stats_lock:  # prompt tokens looked up, and those the cache held
            self._queries += req.prompt_tokens
            self._hits += req.cached_tokens or 0

    def _held_before_stop(self, r: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
        """Text exllamav3 still held (a partial stop string, an unfinished character) when a stop
        token ended the job: it reports it under ``held``, with the stop token last."""
        held = r.get("held") or {}
        ids = [int(t) for t in held["token_ids"][0].tolist()[:-1]] if "token_ids" in held else []
        if not ids:
            return "", ()
        return str(self._tokenizer.decode(self._proto.new_tensor(ids))), tuple(ids)

    def _logprobs(self, logits: Any, out: tuple[int, ...], k: int) -> tuple[float, ...] | TopLogprobs:
        """Each chosen token's log-probability under the model, and with ``k`` above 0 the k most
        likely tokens': a log-softmax of the logits exllamav3 returned for it (``return_logits``;
        shape (1, n, padded vocabulary))."""
        if logits is None:
            return tuple(0.0 for _ in out)  # not expected: exllamav3 returns a row per token
        rows, vocab = logits[0], self.vocab_size
        if k <= 0:
            return tuple(
                float(rows[i, t].item() - rows[i, :vocab].float().logsumexp(-1).item())
                for i, t in enumerate(out)
            )
        each = [logprobs_from_logits(rows[i, :vocab].float().cpu().numpy(), t, k) for i, t in enumerate(out)]
        return TopLogprobs(tuple(p.chosen[0] for p in each), tuple(p.top[0] for p in each))  # type: ignore[union-attr]

    def _sampler(self, params: SamplingParams) -> Any:
        """exllamav3's ComboSampler: penalties and logit bias, then argmax at temperature 0, else
        temperature, min-p, top-k, top-p and a sample."""
        return self._Combo(
            rep_p=params.repetition_penalty,
            freq_p=params.frequency_penalty,
            pres_p=params.presence_penalty,
            temperature=params.temperature,
            min_p=params.min_p,
            top_k=params.top_k or 0,
            top_p=params.top_p,
            logit_bias=dict(params.logit_bias) if params.logit_bias else None,
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
        pagetable, bpt = self._generator.pagetable, self._bpt
        capacity = int(self._cache.max_num_tokens)
        # the page table belongs to the worker thread: read it there, between two steps
        in_use = self._runner.call(lambda: [int(p.kv_position) for p in pagetable.referenced_pages.values()])
        used = sum(in_use)
        return KVStats(
            capacity_tokens=capacity,
            used_tokens=used,
            bytes_per_token=bpt,
            capacity_bytes=bpt * capacity if bpt is not None else None,
            used_bytes=bpt * used if bpt is not None else None,
            block_size=PAGE,
            total_blocks=int(pagetable.max_pages),
            used_blocks=len(in_use),
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
            gen.pagetable.reset_page_table()

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
        torch = sys.modules.get("torch")  # exllamav3 imported it; this plugin never does
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
