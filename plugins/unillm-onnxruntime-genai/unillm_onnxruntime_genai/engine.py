"""ONNX Runtime GenAI through its Python package: the model directories its builder writes
(``genai_config.json`` + ONNX graph + tokenizer), on CPU, DirectML, CUDA or any provider the
installed wheel has.

One ``og.Generator`` per request: prompt appended in one call (the prefill), then one
``generate_next_token`` per token. Sampling is ORT GenAI's own (greedy, top-k, top-p, temperature,
repetition penalty, seed); ``logit_bias`` and ``logprobs`` go through the generator's logits
(``get_logits``/``set_logits``), only for the requests that ask. No prefix cache: each request
evaluates its whole prompt (``Usage.cached_prompt_tokens`` is 0). Text comes from the tokens'
bytes where the tokenizer is byte-level BPE (ORT GenAI's own stream and ``decode`` drop or cut
text at an invalid UTF-8 byte, which a sampled model emits); other tokenizers use its stream.
"""

from __future__ import annotations

import codecs
import importlib.metadata
import importlib.util
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from unillm import BackendUnavailable, ConfigError, ModelLoadError
from unillm.backend import (
    Availability,
    Capabilities,
    Engine,
    EngineBuild,
    KVStats,
    RawPiece,
    Request,
    SamplingParams,
    Suitability,
    check_prompt,
    installed,
    kv_bytes_per_token,
    logprobs_from_logits,
)
from unillm_onnxruntime_genai import NAME
from unillm_onnxruntime_genai._files import (
    FORMAT,
    GENAI_CONFIG,
    ModelDir,
    byte_level_table,
    is_genai_dir,
    model_dir,
)

if TYPE_CHECKING:
    import numpy as np

__all__ = ["OnnxGenAIEngine", "OnnxGenAIOptions"]

INSTALL_HINT = (
    "pip install unillm-onnxruntime-genai  (the CPU runtime; for GPUs install "
    "onnxruntime-genai-cuda or, on Windows, onnxruntime-genai-directml instead of onnxruntime-genai)"
)
# the wheels of ONNX Runtime GenAI, each a build for other devices
_DISTS = {
    "onnxruntime-genai": "cpu",
    "onnxruntime-genai-cuda": "cuda",
    "onnxruntime-genai-directml": "directml",
    "onnxruntime-genai-winml": "directml",
}
# provider libraries an onnxruntime wheel ships beside itself, and the device each one drives
_PROVIDER_LIBS = {
    "cuda": "cuda", "tensorrt": "cuda", "rocm": "rocm", "migraphx": "rocm", "openvino": "openvino",
}  # fmt: skip
_KV_DTYPES = {4: "f32", 2: "f16"}  # the cache's element size -> its name
SAMPLING = frozenset(
    {
        "max_tokens", "stop", "temperature", "top_p", "top_k", "repetition_penalty", "seed",
        "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "logit_bias",
    }
)  # fmt: skip


# ---- options ----


class OnnxGenAIOptions(BaseModel):
    """Load options of the ONNX Runtime GenAI backend."""

    model_config = ConfigDict(extra="forbid")

    provider: str | None = Field(
        default=None,
        description="Execution provider ('cpu', 'cuda', 'dml', 'webgpu', 'openvino', ...); "
        "default: what genai_config.json names (the builder's -e).",
    )
    provider_options: dict[str, str] = Field(
        default_factory=dict, description="Options of that provider (ORT's names, e.g. device_id)."
    )


class OnnxGenAIEngine(Engine[OnnxGenAIOptions]):
    """ONNX Runtime GenAI model directories through onnxruntime-genai."""

    name: ClassVar[str] = NAME
    formats: ClassVar[frozenset[str]] = frozenset({FORMAT})
    capabilities: ClassVar[Capabilities] = Capabilities(
        sampling=SAMPLING, devices=frozenset({"cpu", "cuda", "directml", "webgpu"})
    )
    Options: ClassVar[type[BaseModel]] = OnnxGenAIOptions
    install_hint: ClassVar[str | None] = INSTALL_HINT

    # ---- availability ----

    @classmethod
    def available(cls) -> Availability:
        avail = installed(("onnxruntime_genai", "onnxruntime-genai"), hint=INSTALL_HINT)
        if avail.available and avail.version is None:  # a GPU wheel: another distribution name
            return Availability(True, version=_version())
        return avail

    @classmethod
    def suitability(cls, hardware: Any, model: Any, workload: Any, plan: Any = None) -> Suitability:
        # the plugin's inspection (unillm_inspect_model) names the format; a unillm without that
        # hook reports "unknown" or "safetensors" for it: genai_config.json says what it is
        path, fmt = getattr(model, "path", None), getattr(model, "format", None)
        if fmt == FORMAT or (path is not None and is_genai_dir(str(path))):
            reasons = [f"reads ONNX Runtime GenAI model directories ({GENAI_CONFIG})"]
            # above the 1.0 a built-in scores for a format it reads, as the hook's docs say to outrank
            score = 1.5
            if fmt != FORMAT:
                # not named by the plugin's inspection (a unillm without the hook, where a
                # directory that also holds config.json is "safetensors"): the guide's entries
                # for this format cannot apply while those for HF weights do (up to +2.0 to
                # engines that find no weights here), so this stands in for the rank-0 bonus
                score += 2.0
                reasons.append("a genai_config.json directory is read by ONNX Runtime GenAI only")
            return Suitability(score, tuple(reasons))
        return Suitability(
            0.0,
            blockers=(
                f"does not read {fmt}: it reads ONNX Runtime GenAI model directories "
                f"({GENAI_CONFIG} + ONNX); convert with python -m onnxruntime_genai.models.builder",
            ),
        )

    @classmethod
    def probe_build(cls, hardware: Any, findings: list[str]) -> Any:
        """The installed wheel and the devices its providers drive, from the distributions and
        the provider libraries on disk (nothing imported)."""
        dists = [d for d in _DISTS if _dist_version(d)]
        if not dists:
            return None
        devices = {_DISTS[d] for d in dists}
        spec = importlib.util.find_spec("onnxruntime")
        if spec is not None and spec.submodule_search_locations:
            for root in spec.submodule_search_locations:
                for lib in Path(root).glob("capi/*onnxruntime_providers_*"):
                    kind = lib.name.split("onnxruntime_providers_", 1)[1].split(".")[0]
                    if kind in _PROVIDER_LIBS:
                        devices.add(_PROVIDER_LIBS[kind])
        if len(dists) > 1:
            findings.append(f"{NAME}: several builds installed ({', '.join(dists)}); one shadows the others")
        gpus = getattr(hardware, "gpus", ()) or ()
        if gpus and devices == {"cpu"}:
            findings.append(
                f"{NAME}: the CPU wheel is installed; this machine's GPU needs onnxruntime-genai-cuda"
            )
        return EngineBuild(NAME, _version(), tuple(sorted(devices, key=lambda d: d != "cpu")))

    # ---- load ----

    def _load(self) -> None:
        root = model_dir(self.config.model)  # ModelNotFound / ModelFormatError
        info = ModelDir(root)
        avail = self.available()
        if not avail.available:
            raise BackendUnavailable(self.name, avail.reason, INSTALL_HINT)
        try:
            import numpy as np
            import onnxruntime_genai as og
        except (ImportError, OSError) as exc:
            why = f"onnxruntime_genai failed to import: {exc}"
            raise BackendUnavailable(self.name, why, INSTALL_HINT) from exc
        trained = info.context_length
        ctx = self.config.context_length or trained
        if ctx is None:
            where = str(root / GENAI_CONFIG)
            raise ModelLoadError(f"{where!r} gives no model.context_length; set context_length")
        if trained is not None and ctx > trained:
            raise ConfigError(
                f"context_length={ctx} is longer than the {trained} tokens {self.config.model!r} "
                f"holds (model.context_length in {GENAI_CONFIG}); use at most {trained}"
            )
        opts: OnnxGenAIOptions = self.options
        try:
            config = og.Config(str(root))
            if opts.provider is not None:
                config.clear_providers()
                if opts.provider != "cpu":
                    config.append_provider(opts.provider)
            for key, value in opts.provider_options.items():
                if opts.provider is None:
                    raise ConfigError("provider_options need a provider (options: provider='cuda')")
                config.set_provider_option(opts.provider, key, value)
            model = og.Model(config)
            tokenizer = og.Tokenizer(model)
        except ConfigError:
            raise
        except Exception as exc:  # ORT GenAI raises RuntimeError for everything
            raise ModelLoadError(f"{self.name} could not load {str(root)!r}: {exc}") from exc
        self._np = np
        self._og = og
        self._model = model
        self._tokenizer = tokenizer
        self._info = info
        self._template = info.chat_template()  # read once; a broken one fails here, at load
        self.context_length = ctx
        vocab = info.vocab_size
        self.vocab_size = vocab
        self.eos_token_ids = frozenset(info.eos_ids | {int(t) for t in tokenizer.eos_token_ids})
        self._bytes = byte_level_table(info.tokenizer_json, vocab) if vocab else None
        self._kv_itemsize: int | None = None  # the KV cache's element size, once a request shows it
        self._live: Any = None  # the request's generator while one runs

    # ---- stream ----

    def _encode(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        if isinstance(prompt, str):
            ids = [int(t) for t in self._tokenizer.encode(prompt)]
        else:
            ids = list(prompt)  # the base class checked them against the vocabulary
        check_prompt(ids, self.context_length, params.max_tokens)
        return ids

    def _stream(self, ids: list[int], params: SamplingParams, req: Request) -> Iterator[RawPiece]:
        np, og = self._np, self._og
        n_prompt = len(ids)
        req.prompt_tokens = n_prompt
        req.cached_tokens = 0  # no prefix cache: every prompt token is evaluated
        ctx = self.context_length or n_prompt + params.max_tokens
        max_tokens = min(params.max_tokens, ctx - n_prompt)
        gp = og.GeneratorParams(self._model)
        gp.set_search_options(**_search(params, n_prompt + max_tokens))
        gen = og.Generator(self._model, gp)
        self._live = gen
        bias: Any = None  # logit_bias as a row of the logits' width, made at the first step
        want_lp = params.logprobs is not None
        table = self._bytes
        if table is not None:
            decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        else:
            stream = self._tokenizer.create_stream()
        stop_ids = frozenset(params.stop_token_ids)
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        n = 0
        try:
            gen.append_tokens(np.asarray(ids, dtype=np.int32))
            while True:
                lp = None
                if params.logit_bias or want_lp:
                    logits = gen.get_logits()
                    if want_lp:
                        row = logits.reshape(-1).astype(np.float64)
                    if params.logit_bias:
                        if bias is None:
                            bias = _bias(params.logit_bias, logits.size)
                        gen.set_logits((logits.reshape(-1) + bias).astype(np.float32).reshape(logits.shape))
                gen.generate_next_token()
                tok = int(gen.get_next_tokens()[0])
                if self._kv_itemsize is None:
                    self._kv_itemsize = _kv_itemsize(gen, self._info.present_key)
                if tok in eos:
                    req.finish_reason = "stop"
                    return
                if tok in stop_ids:
                    req.finish_reason = "stop"
                    return
                if want_lp:  # the model's own: the logits before the bias
                    lp = logprobs_from_logits(row, tok, params.logprobs or 0)
                n += 1
                text = decode(table[tok]) if table is not None else stream.decode(tok)
                yield text, (tok,), lp
                if n >= max_tokens:
                    req.finish_reason = "length"
                    return
                if gen.is_done():  # ORT GenAI ended it: an end token of its own configuration
                    req.finish_reason = "stop"
                    return
        finally:
            self._live = None
            del gen

    # ---- chat and tokenizer ----

    def _chat_template(self) -> str | None:
        return self._template

    def _special_tokens(self) -> dict[str, str]:
        return self._info.special_tokens()

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in self._tokenizer.encode(text)]

    def detokenize(self, ids: Sequence[int]) -> str:
        if self._bytes is not None:
            table = self._bytes
            return b"".join(table[i] for i in ids).decode("utf-8", "replace")
        stream = self._tokenizer.create_stream()  # its decode() stops at an invalid byte
        return "".join(stream.decode(int(i)) for i in ids)

    # ---- kv_stats ----

    def kv_stats(self) -> KVStats:
        info = self._info
        bpt = None
        dtype = _KV_DTYPES.get(self._kv_itemsize or 0)
        if dtype and info.layers and info.kv_heads and info.head_size:
            bpt = kv_bytes_per_token(info.layers, info.kv_heads, info.head_size, dtype)
        live = self._live
        used = int(live.token_count()) if live is not None else 0  # a finished request frees its cache
        cap = self.context_length
        return KVStats(
            capacity_tokens=cap,
            used_tokens=used,
            bytes_per_token=bpt,
            capacity_bytes=bpt * cap if bpt and cap else None,
            used_bytes=bpt * used if bpt else None,
            dtype=dtype,
        )

    # ---- close ----

    def _close(self) -> None:
        self._live = None
        for attr in ("_tokenizer", "_model"):
            self.__dict__.pop(attr, None)


def _search(params: SamplingParams, max_length: int) -> dict[str, Any]:
    """ORT GenAI's search options for ``params``: every one set, so genai_config.json's defaults
    (the builder writes top_k=50) never leak into a request."""
    greedy = params.temperature == 0.0
    return {
        "do_sample": not greedy,
        "temperature": params.temperature if not greedy else 1.0,
        "top_k": params.top_k or 0,  # 0: no top-k cut
        "top_p": params.top_p,
        "repetition_penalty": params.repetition_penalty,
        "random_seed": params.seed if params.seed is not None else -1,
        "max_length": max_length,
        # ORT GenAI ends a sequence at its EOS and cannot go on past it: ignore_eos keeps the end
        # tokens from being sampled at all, by its min_length, until max_length
        "min_length": max_length if params.ignore_eos else 0,
        "num_beams": 1,
    }


def _bias(logit_bias: dict[int, float], width: int) -> np.ndarray:
    import numpy as np

    out = np.zeros(width, dtype=np.float32)
    for tok, value in logit_bias.items():
        if tok < width:  # the base class checked the ids against genai_config's vocab_size
            out[tok] += value
    return out


def _kv_itemsize(gen: Any, present_key: str) -> int:
    """The element size of the first layer's key cache (one copy of it, once per engine); 0 when
    the model's outputs say otherwise than genai_config.json names them: unknown, never guessed."""
    try:
        return int(gen.get_output(present_key % 0).dtype.itemsize)
    except Exception:
        return 0


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _version() -> str | None:
    return next((v for d in _DISTS if (v := _dist_version(d))), None)
