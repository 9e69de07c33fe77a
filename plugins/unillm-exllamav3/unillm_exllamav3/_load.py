"""What the ExLlamaV3 plugin does around exllamav3's loaders: the model directory, exllamav3's
config, model, cache and tokenizer, the chat template, the end-of-sequence ids, and the error map.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from unillm import (
    GenerationError,
    ModelFormatError,
    ModelLoadError,
    ModelNotFound,
    OutOfMemory,
    UnillmError,
)

__all__ = [
    "CACHE_BITS",
    "READS",
    "checked_dir",
    "eos_ids",
    "generation_error",
    "is_oom",
    "load_error",
    "load_tokenizer",
    "load_weights",
    "model_config",
    "template",
]

READS = ("exl3", "safetensors")  # EXL3, and unquantized FP16/BF16 HF directories
CACHE_BITS = {"q8": 8, "q6": 6, "q4": 4}  # cache_type -> CacheLayer_quant's k_bits and v_bits


def checked_dir(model: str, facts: Any, what: str) -> Path:
    """The EXL3 (or FP16/BF16 HF) directory of ``model``, checked from ``facts`` (what
    ``auto_engine`` read; inspected now when built directly) before any heavy work.

    :raises ModelNotFound: for a path that does not exist.
    :raises ModelFormatError: for a file, a format exllamav3 does not read, or a directory without
        config.json, safetensors weights or tokenizer.json.
    """
    given = Path(model).expanduser()
    if not given.exists():
        raise ModelNotFound(model)
    if given.is_file():
        raise ModelFormatError(
            f"{model!r} is a file; ExLlamaV3 reads model directories (EXL3 or FP16/BF16 safetensors "
            "with config.json and tokenizer.json). For a .gguf file use backend='llama.cpp'."
        )
    if not (given / "config.json").is_file():
        raise ModelFormatError(f"the {what} {model!r} is a directory without config.json")
    info = facts.model
    if info is None:
        raise ModelFormatError(
            f"the {what} {model!r} is not a model unillm can read (unillm.inspect_model says why)"
        )
    if info.format not in READS:
        raise ModelFormatError(f"the {what} {model!r} is {info.format}; ExLlamaV3 reads EXL3 and FP16/BF16")
    if not any(given.glob("*.safetensors")):
        raise ModelFormatError(f"the {what} {model!r} has no .safetensors weights")
    if not (given / "tokenizer.json").is_file():
        raise ModelFormatError(f"the {what} {model!r} has no tokenizer.json, which exllamav3 needs")
    return given


def model_config(exl: Any, path: Path, what: str) -> Any:
    try:
        return exl.Config.from_directory(str(path))  # reads config.json and indexes the weights
    except (AssertionError, ValueError, KeyError, TypeError, OSError) as exc:
        raise ModelFormatError(f"exllamav3 cannot read the {what} {str(path)!r}: {exc!r}") from exc


def eos_ids(config: Any, tokenizer: Any, vocab_size: int) -> frozenset[int]:
    """The model's end-of-sequence ids as exllamav3 gathers them: config.json's, then
    tokenizer_config.json's and generation_config.json's (the Tokenizer adds those to the
    config's list), plus the tokenizer's EOS token."""
    ids = [*getattr(config, "eos_token_id_list", ()), getattr(tokenizer, "eos_token_id", None)]
    return frozenset(int(i) for i in ids if isinstance(i, int) and 0 <= i < vocab_size)


def template(tokenizer: Any, path: Path) -> str | None:
    """The HF chat template: tokenizer_config.json's (a string, or named templates), else
    chat_template.jinja beside it."""
    tok_cfg = getattr(tokenizer, "tokenizer_config_dict", None) or {}
    found = tok_cfg.get("chat_template")
    if isinstance(found, list):
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        found = named.get("default")
    if isinstance(found, str) and found:
        return found
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    chat_json = path / "chat_template.json"  # newer HF repos
    if chat_json.is_file():
        value = json.loads(chat_json.read_text(encoding="utf-8")).get("chat_template")
        return value if isinstance(value, str) else None
    return None


# ---- exllamav3's loaders ----


def load_weights(
    exl: Any, config: Any, opts: Any, cache_size: int, what: str, *, main: bool
) -> tuple[Any, Any]:
    """The model and its cache (created first: exllamav3 allocates attached caches at load)."""
    model = exl.Model.from_config(config)
    kwargs: dict[str, Any] = {"max_chunk_size": opts.max_chunk_size, "progressbar": False}
    if main and opts.tensor_parallel:
        kwargs.update(tensor_p=True, tp_backend=opts.tp_backend)
        if opts.moe_tensor_split:
            kwargs["tp_options"] = {"moe_tensor_split": True}
    if main:
        kwargs["max_batch_size"] = opts.max_batch_size
        if opts.use_per_device:
            kwargs["use_per_device"] = list(opts.use_per_device)
        if opts.reserve_per_device:
            kwargs["reserve_per_device"] = list(opts.reserve_per_device)
    stage = "cache"
    try:
        if opts.cache_type == "fp16":
            cache = exl.Cache(model, max_num_tokens=cache_size, layer_type=exl.CacheLayer_fp16)
        else:
            bits = CACHE_BITS[opts.cache_type]
            cache = exl.Cache(
                model,
                max_num_tokens=cache_size,
                layer_type=exl.CacheLayer_quant,
                k_bits=bits,
                v_bits=bits,
            )
        stage = "weights and cache"
        model.load(**kwargs)
    except Exception as exc:
        model.unload()
        raise load_error(exc, what, stage, str(config.directory)) from exc
    return model, cache


def load_tokenizer(exl: Any, config: Any, path: Path) -> Any:
    try:
        return exl.Tokenizer.from_config(config)
    except (FileNotFoundError, ValueError, OSError, KeyError) as exc:
        raise ModelFormatError(f"exllamav3 cannot read the tokenizer of {str(path)!r}: {exc}") from exc


# ---- error map ----


def is_oom(exc: BaseException) -> bool:
    text = str(exc).lower()
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in text or "insufficient vram" in text


def load_error(exc: BaseException, what: str, stage: str, model: str) -> BaseException:
    if isinstance(exc, UnillmError):
        return exc
    if is_oom(exc):
        fix = {
            "cache": "lower max_seq_len or cache_size, or use cache_type='q8' or 'q4'",
            "weights": "use a smaller quantization, or more GPUs (use_per_device, tensor_parallel)",
        }.get(stage, "lower cache_size or max_seq_len, use cache_type='q4', or a smaller quantization")
        return OutOfMemory(f"the {what} of {model!r} does not fit in GPU memory ({stage}: {exc}); {fix}")
    return ModelLoadError(f"exllamav3 failed to load the {what} of {model!r}: {exc!r}")


def generation_error(exc: BaseException) -> BaseException:
    if isinstance(exc, UnillmError):
        return exc
    if is_oom(exc):
        return OutOfMemory(f"exllamav3 ran out of GPU memory while generating: {exc}")
    return GenerationError(f"exllamav3 failed while generating: {exc!r}")
