"""Starting vLLM's engine for the backend: the import (on a thread of its own), the engine
arguments checked against this vLLM, the ``AsyncLLM`` created on the engine loop with the engine
processes' output captured, start-up failures mapped to unillm's errors with the engine's cause
lines, and what the engine arguments read from the model (its dtype) and the machine (NUMA nodes)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from unillm import BackendUnavailable, ConfigError, ModelFormatError, ModelLoadError, OutOfMemory, UnillmError
from unillm.engines.vllm._runtime import EngineLoop, KVNumbers, OutputCapture, stat_logger_factory

__all__ = [
    "VLLMModules",
    "cause_lines",
    "import_vllm",
    "load_error",
    "numa_nodes",
    "quiet_vllm_logger",
    "start",
    "weights_dtype",
]


class VLLMModules:
    """The parts of vLLM the backend uses, imported once at load."""

    def __init__(self) -> None:
        from vllm import PoolingParams
        from vllm import SamplingParams as VSamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
        from vllm.v1.engine.async_llm import AsyncLLM

        self.SamplingParams = VSamplingParams
        self.PoolingParams = PoolingParams
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
    env: Mapping[str, str] | None = None,
) -> Any:
    """Create the AsyncLLM on the engine loop, the engine processes writing into ``capture`` and
    started with ``env`` added to their environment.

    On a hosted loop (the application's, running elsewhere) it is created here, on this thread,
    with no loop running: vLLM then binds its output tasks to the loop of its first async call,
    which is made on the host's loop (the start takes seconds to minutes: never on that loop)."""
    fields = {f.name for f in dataclasses.fields(vllm.AsyncEngineArgs)}
    unknown = sorted(set(args) - fields)
    if unknown:
        raise ConfigError(f"vLLM {version} has no engine argument {', '.join(unknown)}")
    try:
        engine_args = vllm.AsyncEngineArgs(**args)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"vLLM refuses the engine arguments: {exc}") from exc
    factory = stat_logger_factory(numbers)

    def make() -> Any:
        return vllm.AsyncLLM.from_engine_args(engine_args, stat_loggers=[factory])

    async def create() -> Any:
        return make()

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        with capture.redirect(), _environment(env or {}):
            if not loop.hosted:
                return loop.call(create())
            if loop.on_loop():  # loaded on the host's loop itself: vLLM binds to it at once
                return make()
            engine = make()
    except Exception as exc:
        raise load_error(exc, capture, args) from exc
    try:
        # The first call on the host's loop starts the task that reads the engine core's outputs
        # (vLLM starts it at once only when created on a running loop), so that an engine core
        # failing before any request is seen.
        loop.call(engine.get_supported_tasks(), timeout=60)
    except Exception as exc:
        engine.shutdown()
        raise load_error(exc, capture, args) from exc
    return engine


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` in ``os.environ`` while the engine processes start (they copy it when spawned), the
    caller's environment as it was afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# The prefixes vLLM puts before each line: the process ("(EngineCore_DP0 pid=123) ") and the log
# record's head ("ERROR 11-30 10:00:00 [core.py:700] ").
_PREFIX = re.compile(
    r"^(?:\([\w.-]+(?: [\w.-]+=[\w.-]+)*\)\s+)?"
    r"(?:(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\d\d-\d\d\s+[\d:.]+\s+\[[^\]]*\]\s?)?"
)
# Not causes: Python traceback text (the header, the chaining sentences, caret lines; the
# ``File ...`` and code lines are indented), torch's C++ warnings ("[W1201 08:01:44.44 utils.cpp:68]
# Warning: ...") and Python warnings ("path.py:138: FutureWarning: ...").
_NOT_CAUSE = re.compile(
    r"^(?:Traceback \(most recent call last\)|The above exception was the direct cause|"
    r"During handling of the above exception|[\^~\s]*$|\[W\d{4} |\S+:\d+: \w*Warning: )"
)
_CAUSE = re.compile(r"error|exception|memory|not supported|failed|killed", re.IGNORECASE)
# What an engine says when memory ran out; nothing else makes a start failure OutOfMemory.
_OOM = re.compile(
    r"out of memory|OutOfMemoryError|MemoryError|cannot allocate memory|not enough memory|"
    r"insufficient memory|larger than the available KV cache memory|no available memory for the cache|"
    r"std::bad_alloc",
    re.IGNORECASE,
)
# vLLM lists every architecture it knows after the one it refuses: hundreds of names.
_ARCH_LIST = re.compile(r"\s*Supported architectures: dict_keys\(\[.*?\]\)", re.DOTALL)


def cause_lines(lines: Iterable[str], n: int = 6) -> list[str]:
    """The last ``n`` distinct lines of ``lines`` that state a cause, prefixes stripped: the
    engine's error records and the exception lines it printed, without Python traceback text or
    warnings (vLLM logs each traceback line as a record of its own, so lines are judged one by
    one)."""
    out: list[str] = []
    for raw in lines:
        m = _PREFIX.match(raw)
        if m is not None and m.group("level") in ("DEBUG", "INFO", "WARNING"):
            continue
        line = raw[m.end() if m else 0 :].rstrip()
        if not line or line[0].isspace() or _NOT_CAUSE.match(line) or not _CAUSE.search(line):
            continue
        if line in out:
            out.remove(line)
        out.append(line)
    return out[-n:]


# What multiprocessing says when a spawned process re-imports a main module that starts processes.
_SPAWN_REIMPORT = "finished its bootstrapping phase"


def load_error(exc: Exception, capture: OutputCapture, args: Mapping[str, Any]) -> UnillmError:
    """The unillm error for a failed start: its type from what the engine said (its exception and
    the cause lines its processes printed), its message quoting those lines."""
    if any(_SPAWN_REIMPORT in line for line in capture.tail(200)):
        # The engine core's spawned process imported the caller's script, which loaded vLLM again:
        # the cause lines are multiprocessing's indented explanation, which cause_lines() skips.
        return ModelLoadError(
            "vLLM starts its engine in a new process, which imports your main script again, and that "
            "import tried to start another engine. Put the code that loads the engine under "
            '`if __name__ == "__main__":` (as multiprocessing\'s spawn start method requires).'
        )
    text = _ARCH_LIST.sub("", f"{type(exc).__name__}: {exc}")
    lines = [ln for ln in cause_lines(capture.tail(200)) if ln not in text]
    quoted = "".join(f"\n  {ln}" for ln in lines)
    joined = f"{text}\n{quoted}"
    low = joined.lower()
    model = args.get("model")
    if "architecture" in low and "not supported" in low:
        return ModelFormatError(f"vLLM does not support the architecture of {model!r}: {text}{quoted}")
    if "quantization" in low and ("not supported" in low or "unknown" in low):
        return ModelFormatError(f"vLLM cannot run the quantization of {model!r} here: {exc}{quoted}")
    oom = _OOM.search(joined) is not None
    if "max_model_len" in low or "max model len" in low or "max seq len" in low:
        if oom:
            return OutOfMemory(
                f"the KV cache cannot hold one sequence of max_model_len={args.get('max_model_len')}: "
                f"lower context_length, or give vLLM more memory (gpu_memory_utilization, "
                f"kv_cache_memory_bytes).{quoted or ' ' + text}"
            )
        return ConfigError(f"vLLM refuses max_model_len={args.get('max_model_len')}: {exc}{quoted}")
    if oom:
        return OutOfMemory(
            f"vLLM ran out of memory starting the engine: lower context_length or max_num_seqs, or "
            f"use a smaller model or a quantized KV cache (kv_cache_dtype='fp8').{quoted or ' ' + text}"
        )
    return ModelLoadError(
        f"vLLM failed to start the engine for {model!r}: {text}{quoted}\n"
        "The engine's full output is on the 'unillm.vllm.engine' logger (level DEBUG)."
    )


# ---- engine arguments read from the model and the machine ----

# A checkpoint's dtype names (config.json, safetensors headers) -> vLLM's dtype names.
_VLLM_DTYPES = {
    "float32": "float32", "float": "float32", "fp32": "float32", "f32": "float32",
    "float16": "float16", "half": "float16", "fp16": "float16", "f16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}  # fmt: skip
_MAX_CONFIG = 16 << 20


def weights_dtype(path: Path, info: Any) -> tuple[str, str]:
    """The dtype vLLM should run the weights in, and why: the checkpoint's own (config.json's
    ``torch_dtype``/``dtype``, else the safetensors headers'), or "auto" (vLLM's choice) where
    the weights are quantized or their dtype is not one vLLM runs."""
    fmt = getattr(info, "format", "safetensors")
    if fmt != "safetensors":
        return "auto", f"{fmt} weights: vLLM picks the activation dtype its {fmt} kernels take"
    config = _read_json(path / "config.json")
    inner = config.get("text_config")
    text: dict[str, Any] = inner if isinstance(inner, dict) else {}
    for src, key in ((config, "torch_dtype"), (config, "dtype"), (text, "torch_dtype"), (text, "dtype")):
        name = src.get(key)
        if isinstance(name, str):
            if name.lower() in _VLLM_DTYPES:
                return _VLLM_DTYPES[name.lower()], f"the weights' own (config.json {key}={name!r})"
            return "auto", f"config.json {key}={name!r} is not a dtype vLLM runs: vLLM chooses (auto)"
    stored = getattr(info, "quantization", None)
    if isinstance(stored, str) and stored in _VLLM_DTYPES:
        return _VLLM_DTYPES[stored], f"the weights' own ({stored} in the safetensors files)"
    return "auto", "neither config.json nor the weight files name a dtype: vLLM chooses (auto)"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        if path.stat().st_size > _MAX_CONFIG:
            return {}
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def numa_nodes() -> int | None:
    """NUMA nodes with memory on this machine (vLLM's CPU build binds one rank per node)."""
    try:
        return len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or None
    except OSError:
        return None


def quiet_vllm_logger() -> None:
    """After start-up, vLLM's own log records in this process go to logging (the application's
    handlers), not straight to stdout; a NullHandler keeps logging's last-resort handler from
    printing its warnings to stderr when the application configured none."""
    vlog = logging.getLogger("vllm")
    for handler in list(vlog.handlers):
        vlog.removeHandler(handler)
    vlog.addHandler(logging.NullHandler())
    vlog.propagate = True
