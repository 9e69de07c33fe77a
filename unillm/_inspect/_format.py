"""Format detection: which format a model path holds, from a file's magic or a config.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unillm._errors import ModelFormatError, ModelNotFound
from unillm._inspect._files import _expand, _kind, _listing, _open, _read
from unillm._inspect._gguf_reader import GGUF_MAGIC
from unillm._inspect._json import _MAX_CONFIG_BYTES, _load_json

# quantization_config.quant_method values that name a format of their own
_QUANT_METHODS = {
    "awq": "awq",
    "gptq": "gptq",
    "fp8": "fp8",
    "compressed-tensors": "compressed-tensors",
    "bitsandbytes": "bitsandbytes",
    "mxfp4": "mxfp4",
    "exl2": "exl2",
    "exl3": "exl3",
}


def detect_format(path: str | Path) -> str:
    """The model format at ``path``: ``gguf``, ``safetensors`` (plain HF), ``mlx``, ``awq``, ...

    Raises ``ModelNotFound`` for a missing path and ``ModelFormatError`` for anything unreadable.
    """
    p = _expand(path)
    kind = _kind(p)
    if kind is None:
        raise ModelNotFound(str(path))
    if kind == "file":
        return _file_format(p)
    config = p / "config.json"
    if _kind(config) == "file":
        return _config_format(config)
    ggufs = _listing(p, ".gguf")
    if len(ggufs) == 1:
        return _file_format(ggufs[0])
    raise ModelFormatError(
        f"{str(p)!r} is a directory without config.json"
        + (f" and with {len(ggufs)} .gguf files: pass one of them" if ggufs else "")
        + "; pass a .gguf file or a Hugging Face-style model directory"
    )


def _file_format(p: Path) -> str:
    with _open(p) as f:
        head = _read(f, 8, p)
    if head[:4] == GGUF_MAGIC:
        return "gguf"
    if p.suffix == ".gguf":
        raise ModelFormatError(
            f"{str(p)!r} is named .gguf but does not start with the GGUF magic "
            f"(found {head[:4]!r}): the file is corrupt or not a GGUF model"
        )
    if p.suffix == ".safetensors":
        return "safetensors"
    raise ModelFormatError(
        f"{str(p)!r} is not a model format unillm reads; pass a .gguf file or a model directory"
    )


def _config_format(config: Path) -> str:
    return _format_of_config(_load_json(config, _MAX_CONFIG_BYTES))


def _format_of_config(data: dict[str, Any]) -> str:
    quant = data.get("quantization_config")
    if isinstance(quant, dict):
        method = quant.get("quant_method")
        if isinstance(method, str) and method.lower() in _QUANT_METHODS:
            return _QUANT_METHODS[method.lower()]
    if isinstance(data.get("quantization"), dict):
        return "mlx"
    return "safetensors"
