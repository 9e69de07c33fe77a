"""What the ExLlamaV2 backend does around exllamav2's loaders: the model directory, from the facts
(``engine.facts``: nothing is inspected again here), whether flash-attn's paged attention is there
(told without importing it), exllamav2's config and weights, the chat template, and the error map.

Used by ``unillm.engines.exllamav2`` only; it does not import that module.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unillm import (
    ConfigError,
    GenerationError,
    ModelFormatError,
    ModelLoadError,
    ModelNotFound,
    OutOfMemory,
    UnillmError,
)
from unillm.backend import EngineConfig, exists, hf_dir_in, is_dir, is_file
from unillm.backend.lora import one_adapter, peft_adapter

if TYPE_CHECKING:
    from unillm.backend import Facts

__all__ = [
    "CACHE_CLASSES",
    "READS",
    "checked_dir",
    "generation_error",
    "is_oom",
    "load_error",
    "load_tokenizer",
    "load_weights",
    "model_config",
    "paged_attention_installed",
    "set_lengths",
]

READS = ("exl2", "safetensors", "gptq")  # formats exllamav2 loads (gptq: 4-bit GPTQ checkpoints)
CACHE_CLASSES = {
    "fp16": "ExLlamaV2Cache",
    "q8": "ExLlamaV2Cache_Q8",
    "q6": "ExLlamaV2Cache_Q6",
    "q4": "ExLlamaV2Cache_Q4",
}  # cache_type -> exllamav2's cache class
_PAGED_FLASH_ATTN = (2, 5, 7)  # the first flash-attn exllamav2 pages with


# ---- before the load ----


def paged_attention_installed() -> bool:
    """Whether exllamav2 will find a flash-attn it pages with (>= 2.5.7), told without importing
    either (exllamav2 finds out by importing flash-attn, which needs CUDA). ``EXLLAMA_NO_FLASH_ATTN``
    turns flash-attn off in exllamav2's config, so it does here too. A flash-attn whose version its
    metadata does not say is taken at its word (exllamav2 reads ``__version__`` at import)."""
    if "EXLLAMA_NO_FLASH_ATTN" in os.environ:
        return False
    from importlib.metadata import PackageNotFoundError, version
    from importlib.util import find_spec

    try:
        if find_spec("flash_attn") is None:  # a top-level name: found without running it
            return False
    except (ImportError, ValueError):
        return False
    try:
        found = version("flash_attn")
    except PackageNotFoundError:
        return True
    numbers = tuple(int(t) for t in found.split(".") if t.isdigit())  # as exllamav2 parses it
    return numbers >= _PAGED_FLASH_ATTN


def checked_dir(model: str, facts: Facts, what: str) -> Path:
    """The EXL2 or HF model directory of ``model`` (a directory holding the model's formats side by
    side: its HF one), with what exllamav2 needs, checked from ``facts`` (about ``model``) before
    any heavy work.

    :raises ModelNotFound: for a path that does not exist (or a repo id not in the local HF cache).
    :raises ModelFormatError: for a file, a format exllamav2 does not read, a model unillm cannot
        read, or a directory without safetensors weights or tokenizer.json.
    """
    given = Path(model).expanduser()
    hf = hf_dir_in(given)  # a directory holding the model's formats side by side: its HF one
    if hf is not None:
        if hf != given:
            facts = facts.for_path(str(hf))
        model = str(hf)
    elif is_file(given):
        raise ModelFormatError(
            f"{model!r} is a file; ExLlamaV2 reads model directories (EXL2 or FP16/BF16 safetensors "
            "with config.json and tokenizer.json). For a .gguf file use backend='llama.cpp'."
        )
    elif is_dir(given):
        raise ModelFormatError(
            f"the {what} {model!r} is a directory without config.json; ExLlamaV2 reads model "
            "directories (EXL2 or FP16/BF16 safetensors with config.json and tokenizer.json)"
        )
    info = facts.model  # what auto_engine read while choosing (or, built directly, read now)
    if info is None:
        if hf is None and not exists(given):
            raise ModelNotFound(model)
        raise ModelFormatError(
            f"the {what} {model!r} is not a model unillm can read (unillm.inspect_model says why); "
            "ExLlamaV2 reads EXL2, GPTQ and FP16/BF16 safetensors directories"
        )
    if info.format not in READS:
        raise ModelFormatError(
            f"the {what} {model!r} is {info.format}; ExLlamaV2 reads EXL2, GPTQ and FP16/BF16"
        )
    path = Path(info.path)  # the directory itself, or a cached repo id's snapshot
    if not is_dir(path):
        raise ModelFormatError(f"the {what} {model!r} is not a model directory")
    if not any(path.glob("*.safetensors")):
        raise ModelFormatError(f"the {what} {model!r} has no .safetensors weights")
    if not (path / "tokenizer.json").is_file():
        raise ModelFormatError(f"the {what} {model!r} has no tokenizer.json, which exllamav2 needs")
    return path


# ---- exllamav2's loaders ----


def model_config(exl: Any, path: Path, what: str) -> Any:
    try:
        config = exl.ExLlamaV2Config(str(path))  # reads config.json and indexes the weights
        config.arch_compat_overrides(quiet=True)
    except (AssertionError, ValueError, KeyError, TypeError, OSError) as exc:
        raise ModelFormatError(f"exllamav2 cannot read the {what} {str(path)!r}: {exc!r}") from exc
    return config


def set_lengths(config: Any, max_seq_len: int, chunk: int | None) -> None:
    """The sequence length and prompt chunk exllamav2 sizes its buffers for."""
    config.max_seq_len = max_seq_len
    if chunk:
        config.max_input_len = chunk
        config.max_attention_size = chunk**2


def load_tokenizer(exl: Any, config: Any, path: Path) -> Any:
    try:
        return exl.ExLlamaV2Tokenizer(config)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise ModelFormatError(f"exllamav2 cannot read the tokenizer of {str(path)!r}: {exc}") from exc


def load_weights(
    exl: Any, config: Any, cache_cls: Any, cache_size: int, gpu_split: list[float] | None, what: str
) -> tuple[Any, Any]:
    model = exl.ExLlamaV2(config)
    stage = "weights"
    try:
        if gpu_split is None:  # autosplit: weights and cache fill each GPU in turn
            stage = "weights and cache"
            cache = cache_cls(model, max_seq_len=cache_size, lazy=True)
            model.load_autosplit(cache, progress=False)
        else:
            model.load(gpu_split=list(gpu_split), progress=False)
            stage = "cache"
            cache = cache_cls(model, max_seq_len=cache_size)  # allocated now, beside its layers
    except Exception as exc:
        model.unload()
        raise load_error(exc, what, stage, str(config.model_dir)) from exc
    return model, cache


# ---- error map ----


def is_oom(exc: BaseException) -> bool:
    text = str(exc).lower()
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in text or "insufficient vram" in text


def load_error(exc: Exception, what: str, stage: str, model: str) -> Exception:
    if isinstance(exc, UnillmError):
        return exc
    if is_oom(exc):
        fix = {
            "cache": "lower max_seq_len or cache_size, or use cache_type='q8' or 'q4'",
            "weights": "use a smaller quantization or give more GPUs room in gpu_split",
        }.get(stage, "lower cache_size or max_seq_len, use cache_type='q4', or a smaller quantization")
        return OutOfMemory(f"the {what} of {model!r} does not fit in GPU memory ({stage}: {exc}); {fix}")
    return ModelLoadError(f"exllamav2 failed to load the {what} of {model!r}: {exc!r}")


def generation_error(exc: BaseException) -> BaseException:
    if isinstance(exc, UnillmError):
        return exc
    if is_oom(exc):
        return OutOfMemory(f"exllamav2 ran out of GPU memory while generating: {exc}")
    return GenerationError(f"exllamav2 failed while generating: {exc!r}")


def exllamav2_lora(exl: Any, model: Any, generator: Any, config: EngineConfig, backend: str) -> Any:
    """The config's adapter read by ``ExLlamaV2Lora.from_directory`` and enabled for every job of
    ``generator`` (exllamav2's dynamic generator sets LoRAs for its whole queue), or None."""
    lora = one_adapter(config, backend)
    if lora is None:
        return None
    path = peft_adapter(lora, backend)
    try:
        adapter = exl.ExLlamaV2Lora.from_directory(model, str(path))
    except (ValueError, KeyError, AssertionError) as exc:
        raise ConfigError(f"exllamav2 could not apply the LoRA adapter {str(path)!r}: {exc!r}") from exc
    generator.set_loras([adapter])
    return adapter
