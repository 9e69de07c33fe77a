"""MLX through mlx-lm: HF-format models (plain or MLX-quantized) on Apple Silicon, and on Linux
CPUs through mlx's CPU build.

Generation wraps mlx-lm's ``stream_generate``. The adapter keeps one prompt cache and reuses the
longest prefix it shares with the next prompt (trimming the rest), so a chat that resends its
history pays only for the new turn; the reused count is reported in ``Usage``. mlx-lm has no stop
strings: the base class provides them. Requests are serialized (one prompt cache, one sequence).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from unillm._chat import check_chat_template
from unillm._engine import Engine, Request
from unillm._eos import eos_from_hf_dir
from unillm._errors import (
    BackendUnavailable,
    ModelFormatError,
    ModelLoadError,
    ModelNotFound,
    OutOfMemory,
)
from unillm._model_path import hf_dir_in
from unillm._types import STANDARD_SAMPLING, Availability, Capabilities, KVStats, SamplingParams
from unillm._common import check_prompt, installed, shared_prefix
from unillm.engines._mlx_batch import Batcher

if TYPE_CHECKING:
    import mlx.nn

__all__ = ["MLXEngine", "MLXOptions"]

INSTALL_HINT = "pip install 'unillm[mlx]'  (on Linux also: pip install 'mlx[cpu]')"
_DEFAULT_CONTEXT = 4096


# ---- options ----


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


class MLXEngine(Engine[MLXOptions]):
    """HF-format and MLX-quantized models through mlx-lm."""

    name: ClassVar[str] = "mlx"
    formats: ClassVar[frozenset[str]] = frozenset({"mlx", "safetensors"})
    capabilities: ClassVar[Capabilities] = Capabilities(
        sampling=STANDARD_SAMPLING,
        batching=False,  # True on an engine whose batch_size > 1 (mlx-lm's BatchGenerator)
        lora=True,
        devices=frozenset({"cpu", "metal"}),
    )
    Options: ClassVar[type[BaseModel]] = MLXOptions
    install_hint: ClassVar[str | None] = INSTALL_HINT

    # ---- availability ----

    @classmethod
    def available(cls) -> Availability:
        return installed(("mlx", "mlx"), ("mlx_lm", "mlx-lm"), hint=INSTALL_HINT)

    # ---- load ----

    def _load(self) -> None:
        opts = self.options
        path = _resolve(self.config.model)
        config = _read_config(path)
        avail = self.available()
        if not avail.available:
            raise BackendUnavailable(self.name, avail.reason, INSTALL_HINT)
        try:
            import mlx.core as mx
            import mlx_lm
            from mlx_lm.models import cache as mlx_cache
        except (ImportError, OSError) as exc:
            raise BackendUnavailable(self.name, f"mlx failed to import: {exc}", INSTALL_HINT) from exc
        try:
            loaded = mlx_lm.load(
                str(path),
                adapter_path=opts.adapter_path,
                tokenizer_config={"trust_remote_code": opts.trust_remote_code},
                trust_remote_code=opts.trust_remote_code,
            )
            model, tokenizer = loaded[0], loaded[1]
        except ValueError as exc:
            if "not supported" in str(exc):
                raise ModelFormatError(
                    f"mlx-lm does not support the model_type {config.get('model_type')!r} of "
                    f"{self.config.model!r}; upgrade mlx-lm or use another backend"
                ) from exc
            raise ModelLoadError(f"mlx-lm failed to load {self.config.model!r}: {exc}") from exc
        except (FileNotFoundError, OSError) as exc:
            raise ModelFormatError(f"{self.config.model!r} is incomplete: {exc}") from exc
        except MemoryError as exc:
            raise OutOfMemory(f"the weights of {self.config.model!r} do not fit in memory") from exc
        self._mx = mx
        self._mlx_lm = mlx_lm
        self._cache_mod = mlx_cache
        self._model: mlx.nn.Module = model
        self._tokenizer = tokenizer
        self._config = config
        trained = config.get("max_position_embeddings") or config.get("max_seq_len")
        limit = trained if isinstance(trained, int) and trained > 0 else _DEFAULT_CONTEXT
        self._n_ctx = min(self.config.context_length or limit, limit)
        template = self._chat_template()
        if self.config.chat_template is None and template is not None:
            check_chat_template(template, source=str(path))  # a broken one fails at load
        self.vocab_size = config.get("vocab_size") or len(tokenizer)
        # the model's declared end-of-sequence set (unillm._eos), the same on every backend
        self.eos_token_ids = eos_from_hf_dir(path, to_id=self._one_token, vocab_size=self.vocab_size)
        self._eos = self.eos_token_ids
        tokenizer.eos_token_ids = set(self._eos)
        self._cache: list[Any] | None = None
        self._cache_tokens: list[int] = []
        self._queries = 0
        self._hits = 0
        self._saved: tuple[list[Any], list[int]] | None = None  # batched mode's reusable cache
        self._saved_lock = threading.Lock()
        self._inflight: dict[int, int] = {}  # batched mode: request -> tokens it holds
        self._batcher: Batcher | None = None
        if opts.batch_size > 1 and _has_batch_generator():
            self._batcher = Batcher(
                model,
                sorted(self._eos),
                batch_size=opts.batch_size,
                prefill_step_size=opts.prefill_step_size,
                max_kv_size=opts.max_kv_size,
            )
            self.capabilities = replace(type(self).capabilities, batching=True)  # type: ignore[misc]

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
        return ids

    def _stream(
        self, ids: list[int], params: SamplingParams, req: Request
    ) -> Iterator[tuple[str, tuple[int, ...], tuple[float, ...] | None]]:
        if self._batcher is not None:
            return self._stream_batched(ids, params, req)
        return self._stream_single(ids, params, req)

    def _stream_single(
        self, ids: list[int], params: SamplingParams, req: Request
    ) -> Iterator[tuple[str, tuple[int, ...], tuple[float, ...] | None]]:
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
        stop_ids = frozenset(params.stop_token_ids)
        if params.ignore_eos:
            tokenizer.eos_token_ids = set()
        gen = self._mlx_lm.stream_generate(
            self._model,
            tokenizer,
            mx.array(ids[cached:]),
            max_tokens=max_tokens,
            sampler=self._sampler(params),
            logits_processors=self._processors(params),
            prompt_cache=self._cache,
            prefill_step_size=opts.prefill_step_size,
            kv_bits=opts.kv_bits,
            kv_group_size=opts.kv_group_size,
            quantized_kv_start=opts.quantized_kv_start,
        )
        seen.extend(ids[cached:])
        last = None
        n = 0
        try:
            for last in gen:
                tok = last.token
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
                lp = (float(last.logprobs[tok].item()),) if want_lp else None  # type: ignore[arg-type]
                yield last.text, (tok,), lp
                if last.finish_reason == "length" or n >= max_tokens:
                    req.finish_reason = "length"
                    return
        finally:
            gen.close()
            tokenizer.eos_token_ids = self._eos
            # What the cache holds now: everything fed to the model, which is what we saw.
            offset = _cache_offset(self._cache)
            self._cache_tokens = seen[:offset] if offset is not None else []
            if last is not None:
                evaluated = len(ids) - cached
                req.prefill_s = evaluated / last.prompt_tps if last.prompt_tps else None
                req.decode_s = last.generation_tokens / last.generation_tps if last.generation_tps else 0.0
                req.peak_memory_bytes = int(last.peak_memory * 1e9)

    def _stream_batched(
        self, ids: list[int], params: SamplingParams, req: Request
    ) -> Iterator[tuple[str, tuple[int, ...], tuple[float, ...] | None]]:
        batcher = self._batcher  # close() drops the attribute while this stream may still run
        assert batcher is not None
        req.prompt_tokens = len(ids)
        cache, cached = self._take_saved(ids)
        req.cached_tokens = cached
        self._queries += len(ids)
        self._hits += cached
        max_tokens = params.max_tokens
        if self.options.max_kv_size is None:
            max_tokens = min(max_tokens, self._n_ctx - len(ids))
        live = batcher.submit_prompt(
            ids[cached:],
            max_tokens=max_tokens,
            sampler=self._sampler(params),
            processors=self._processors(params),
            ignore_eos=params.ignore_eos,
            cache=cache,
            history=ids[:cached] if cached else None,
        )
        detok = self._tokenizer.detokenizer  # a fresh one per request
        stop_ids = frozenset(params.stop_token_ids)
        want_lp = params.logprobs is not None
        key = id(req)
        self._inflight[key] = len(ids)
        finished = False
        try:
            while True:
                r = live.events.get()
                if isinstance(r, BaseException):
                    finished = True
                    raise r
                tok = r.token
                if r.finish_reason == "stop":  # the end-of-sequence token (never with ignore_eos)
                    finished = True
                    req.finish_reason = "stop"
                    self._save(r)
                    detok.finalize()
                    if detok.last_segment:
                        yield detok.last_segment, (), None
                    return
                if tok in stop_ids:
                    req.finish_reason = "stop"
                    return
                detok.add_token(tok)
                self._inflight[key] += 1
                lp = (float(r.logprobs[tok].item()),) if want_lp else None  # type: ignore[arg-type]
                if r.finish_reason == "length":
                    finished = True
                    req.finish_reason = "length"
                    self._save(r)
                    detok.finalize()
                    yield detok.last_segment, (tok,), lp
                    return
                yield detok.last_segment, (tok,), lp
        finally:
            self._inflight.pop(key, None)
            if not finished:
                batcher.cancel(live)
            req.peak_memory_bytes = int(self._mx.get_peak_memory())

    def _save(self, r: Any) -> None:
        """Keep a finished sequence's cache for the next request to reuse its prefix."""
        cache = r.prompt_cache
        if self.options.prompt_cache and cache and self._cache_mod.can_trim_prompt_cache(cache):
            with self._saved_lock:
                self._saved = (cache, list(r.all_tokens or []))

    def _take_saved(self, ids: list[int]) -> tuple[list[Any] | None, int]:
        with self._saved_lock:
            saved, self._saved = self._saved, None
        if saved is None:
            return None, 0
        cache, tokens = saved
        offset = _cache_offset(cache) or 0
        keep = shared_prefix(tokens[:offset], ids)
        if keep == 0:
            return None, 0
        if offset - keep > 0:
            self._cache_mod.trim_prompt_cache(cache, offset - keep)
        return cache, keep

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
            offset = _cache_offset(self._cache) or 0
            if offset - keep > 0:
                cache_mod.trim_prompt_cache(self._cache, offset - keep)
            if keep:
                return keep
        self._cache = cache_mod.make_prompt_cache(self._model, max_kv_size=self.options.max_kv_size)
        return 0

    def _sampler(self, params: SamplingParams) -> Any:
        """mlx-lm's sampling chain; a seeded request draws from its own key, so its tokens do not
        depend on what else runs in the batch."""
        sampler = self._chain(params)
        if not params.logit_bias:
            return sampler
        # The bias applies where tokens are drawn, not as a logits processor: mlx-lm reports the
        # logprobs its processors return, and a logprob means the model's own distribution on
        # every backend (llama.cpp's and vLLM's are taken before the bias too).
        mx = self._mx
        idx = mx.array([int(k) for k in params.logit_bias])
        val = mx.array([float(v) for v in params.logit_bias.values()])

        def biased(logprobs: Any) -> Any:
            return sampler(logprobs.at[..., idx].add(val))

        return biased

    def _chain(self, params: SamplingParams) -> Any:
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

        temp = params.temperature
        seed = params.seed if params.seed is not None else self.options.seed
        if temp == 0.0 or seed is None:
            return make_sampler(
                temp=temp,
                top_p=params.top_p if params.top_p < 1.0 else 0.0,
                min_p=params.min_p,
                top_k=params.top_k or 0,
            )
        mx = self._mx
        filters: list[Any] = []
        if params.top_p < 1.0:
            filters.append(lambda x: apply_top_p(x, params.top_p))
        if params.min_p > 0.0:
            filters.append(lambda x: apply_min_p(x, params.min_p, 1))
        if params.top_k:
            filters.append(lambda x: apply_top_k(x, params.top_k))
        key = [mx.random.key(seed)]

        def sample(logprobs: Any) -> Any:
            for f in filters:
                logprobs = f(logprobs)
            key[0], sub = mx.random.split(key[0])
            return mx.random.categorical(logprobs * (1.0 / temp), key=sub)

        return sample

    def _processors(self, params: SamplingParams) -> list[Any] | None:
        from mlx_lm.sample_utils import make_logits_processors

        penalties = params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
        if not penalties:
            return None
        return make_logits_processors(
            repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
            repetition_context_size=64,
            presence_penalty=params.presence_penalty or None,
            presence_context_size=64,
            frequency_penalty=params.frequency_penalty or None,
            frequency_context_size=64,
        )

    # ---- chat and tokenizer ----

    def _chat_template(self) -> str | None:
        template = getattr(self._tokenizer, "chat_template", None)
        return template if isinstance(template, str) and template else None

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

    # ---- kv_stats ----

    def kv_stats(self) -> KVStats:
        cfg = self._config
        layers = cfg.get("num_hidden_layers")
        heads = cfg.get("num_attention_heads")
        kv_heads = cfg.get("num_key_value_heads") or heads
        hidden = cfg.get("hidden_size")
        head_dim = cfg.get("head_dim") or (hidden // heads if hidden and heads else None)
        itemsize = _embedding_itemsize(self._model)
        bpt = None
        if isinstance(layers, int) and isinstance(kv_heads, int) and isinstance(head_dim, int) and itemsize:
            bpt = 2 * layers * kv_heads * head_dim * itemsize
        capacity = self.options.max_kv_size or self._n_ctx
        if self._batcher is not None:
            # batched: each of batch_size sequences may hold a whole context; sizes are estimates
            saved = self._saved
            used = sum(self._inflight.values()) + ((_cache_offset(saved[0]) or 0) if saved else 0)
            used_bytes = bpt * used if bpt else None
            capacity *= self.options.batch_size
        else:
            used = _cache_offset(self._cache) or 0
            used_bytes = sum(int(c.nbytes) for c in self._cache) if self._cache else 0
        return KVStats(
            capacity_tokens=capacity,
            used_tokens=used,
            bytes_per_token=bpt,
            capacity_bytes=bpt * capacity if bpt else None,
            used_bytes=used_bytes,
            dtype=f"{self.options.kv_bits}-bit" if self.options.kv_bits else None,
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
        )

    def reset(self) -> None:
        """Drop the prompt cache (the next request evaluates its whole prompt)."""
        with self._busy():
            self._cache = None
            self._cache_tokens = []
            with self._saved_lock:
                self._saved = None

    # ---- close ----

    def _close(self) -> None:
        if self._batcher is not None:
            self._batcher.close()
            self._batcher = None
        for attr in ("_model", "_tokenizer", "_cache", "_saved"):
            self.__dict__.pop(attr, None)
        mx = self.__dict__.get("_mx")
        if mx is not None:
            mx.clear_cache()


# ---- error map ----


def _resolve(model: str) -> Path:
    """A local directory, or an HF repo id found in the local HF cache (never downloaded)."""
    path = Path(model).expanduser()
    if path.exists():
        hf = hf_dir_in(path)  # a directory holding the model's formats side by side: its HF one
        if hf is not None:
            return hf
        if path.is_file():
            raise ModelFormatError(
                f"{model!r} is a file; MLX reads Hugging Face-style model directories "
                "(config.json, *.safetensors, tokenizer). For a .gguf file use backend='llama.cpp'."
            )
        return path
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(model, local_files_only=True))
        except Exception as exc:
            raise ModelNotFound(model) from exc
    raise ModelNotFound(model)


def _read_config(path: Path) -> dict[str, Any]:
    config = path / "config.json"
    if not config.is_file():
        raise ModelFormatError(f"{str(path)!r} has no config.json: not a Hugging Face-style model directory")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelFormatError(f"{str(config)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or "model_type" not in data:
        raise ModelFormatError(f"{str(config)!r} names no model_type")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelFormatError(
            f"{str(path)!r} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)"
        )
    return data


def _has_batch_generator() -> bool:
    try:
        from mlx_lm.generate import BatchGenerator  # noqa: F401
    except ImportError:
        return False
    return True


def _cache_offset(cache: list[Any] | None) -> int | None:
    if not cache:
        return None
    offset = getattr(cache[0], "offset", None)
    return int(offset) if offset is not None else None


def _embedding_itemsize(model: Any) -> int | None:
    """Bytes per element of the model's activations (its embedding dtype), for KV sizing."""
    try:
        return int(model.parameters()["model"]["embed_tokens"]["weight"].dtype.size)
    except (KeyError, TypeError, AttributeError):
        return None
