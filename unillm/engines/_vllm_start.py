"""Starting vLLM's engine for the backend: the import (on a thread of its own), the engine
arguments checked against this vLLM, the ``AsyncLLM`` created on the engine loop with the engine
processes' output captured, and start-up failures mapped to unillm's errors."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from unillm._errors import (
    BackendUnavailable,
    ConfigError,
    ModelFormatError,
    ModelLoadError,
    OutOfMemory,
    UnillmError,
)
from unillm.engines._vllm_runtime import EngineLoop, KVNumbers, OutputCapture, stat_logger_factory

__all__ = ["VLLMModules", "import_vllm", "load_error", "quiet_vllm_logger", "start"]


class VLLMModules:
    """The parts of vLLM the backend uses, imported once at load."""

    def __init__(self) -> None:
        from vllm import SamplingParams as VSamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
        from vllm.v1.engine.async_llm import AsyncLLM

        self.SamplingParams = VSamplingParams
        self.AsyncEngineArgs = AsyncEngineArgs
        self.AsyncLLM = AsyncLLM
        self.RequestOutputKind = RequestOutputKind
        self.StructuredOutputsParams = StructuredOutputsParams
        self.tokens_input = tokens_input


def import_vllm(hint: str) -> VLLMModules:
    """Import vLLM on a thread of its own: a module that keeps the frame it was imported from then
    keeps that thread's finished frames, not the caller's (with the engine in their locals)."""
    result: list[VLLMModules | BaseException] = []

    def run() -> None:
        try:
            result.append(VLLMModules())
        except BaseException as exc:
            result.append(exc)

    worker = threading.Thread(target=run, name="unillm-vllm-import")
    worker.start()
    worker.join()
    got = result[0]
    if isinstance(got, VLLMModules):
        return got
    if not isinstance(got, ImportError | OSError | RuntimeError):
        raise got
    text = str(got)
    fix = ""
    if "torchvision" in text or "torchaudio" in text:
        fix = (
            ". The torchvision/torchaudio/torchcodec that pip took from PyPI do not match vLLM's torch "
            "build; remove them: pip uninstall -y torchvision torchaudio torchcodec"
        )
    raise BackendUnavailable("vllm", f"vllm failed to import: {text}{fix}", hint) from got


def start(
    vllm: VLLMModules,
    args: dict[str, Any],
    loop: EngineLoop,
    capture: OutputCapture,
    numbers: KVNumbers,
    version: str | None,
) -> Any:
    """Create the AsyncLLM on the engine loop, the engine processes writing into ``capture``."""
    fields = {f.name for f in dataclasses.fields(vllm.AsyncEngineArgs)}
    unknown = sorted(set(args) - fields)
    if unknown:
        raise ConfigError(f"vLLM {version} has no engine argument {', '.join(unknown)}")
    try:
        engine_args = vllm.AsyncEngineArgs(**args)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"vLLM refuses the engine arguments: {exc}") from exc
    factory = stat_logger_factory(numbers)

    async def create() -> Any:
        return vllm.AsyncLLM.from_engine_args(engine_args, stat_loggers=[factory])

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        with capture.redirect():
            return loop.call(create())
    except Exception as exc:
        raise load_error(exc, capture, args) from exc


def load_error(exc: Exception, capture: OutputCapture, args: Mapping[str, Any]) -> UnillmError:
    text = f"{type(exc).__name__}: {exc}"
    lines = capture.tail(6, matching=r"error|exception|memory|not supported|raise")
    quoted = "".join(f"\n  {ln}" for ln in lines)
    joined = f"{text}\n{quoted}".lower()
    model = args.get("model")
    if "architecture" in joined and ("not supported" in joined or "are not supported" in joined):
        return ModelFormatError(f"vLLM does not support the architecture of {model!r}: {exc}{quoted}")
    if "quantization" in joined and ("not supported" in joined or "unknown" in joined):
        return ModelFormatError(f"vLLM cannot run the quantization of {model!r} here: {exc}{quoted}")
    if "max_model_len" in joined or "max model len" in joined or "max seq len" in joined:
        if "kv cache" in joined or "memory" in joined:
            return OutOfMemory(
                f"the KV cache cannot hold one sequence of max_model_len={args.get('max_model_len')}: "
                f"lower context_length, or give vLLM more memory (gpu_memory_utilization, "
                f"kv_cache_memory_bytes).{quoted or ' ' + text}"
            )
        return ConfigError(f"vLLM refuses max_model_len={args.get('max_model_len')}: {exc}{quoted}")
    if "out of memory" in joined or "memory" in joined:
        return OutOfMemory(
            f"vLLM ran out of memory starting the engine: lower context_length or max_num_seqs, or "
            f"use a smaller model or a quantized KV cache (kv_cache_dtype='fp8').{quoted or ' ' + text}"
        )
    return ModelLoadError(f"vLLM failed to start the engine for {model!r}: {text}{quoted}")


def quiet_vllm_logger() -> None:
    """After start-up, vLLM's own log records in this process go to logging (the application's
    handlers), not straight to stdout."""
    vlog = logging.getLogger("vllm")
    for handler in list(vlog.handlers):
        vlog.removeHandler(handler)
    vlog.propagate = True
