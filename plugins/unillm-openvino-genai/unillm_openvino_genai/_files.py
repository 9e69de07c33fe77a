"""What an OpenVINO IR directory is, read from its small files only (never the weights)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from unillm import ModelFormatError, ModelInfo, inspect_model

__all__ = ["FORMAT", "IR_FILES", "inspect", "is_ir_dir"]

#: The format name this plugin gives an IR directory.
FORMAT = "openvino"
#: The files that make a directory an IR model this backend reads.
IR_FILES = ("openvino_model.xml", "openvino_tokenizer.xml", "openvino_detokenizer.xml")
_MAX_CONFIG_BYTES = 1 << 20


def is_ir_dir(path: str | Path) -> bool:
    """``path`` is a directory holding an OpenVINO IR model (``openvino_model.xml``)."""
    try:
        return (Path(path).expanduser() / IR_FILES[0]).is_file()
    except OSError:
        return False


def inspect(path: str | Path) -> ModelInfo | None:
    """``path`` as an IR model (format ``openvino``), or None when it is not one. The shape comes
    from the ``config.json`` beside the IR, read by unillm's own inspection (untrusted input);
    ``weights_bytes`` is the size of ``openvino_model.bin``; ``quantization`` what optimum's
    ``openvino_config.json`` says of the weight compression (int8, int4), else None (the
    parameter count, unknown without reading the IR's graph, is None too)."""
    if not is_ir_dir(path):
        return None
    d = Path(path).expanduser()
    try:
        info = inspect_model(d)
    except ModelFormatError:  # no config.json: an IR written by ovc, say
        info = ModelInfo(str(d), FORMAT)
    weights = d / "openvino_model.bin"
    try:
        nbytes: int | None = weights.stat().st_size
    except OSError:
        nbytes = None
    files = tuple(str(d / f) for f in ("openvino_model.xml", "openvino_model.bin") if (d / f).is_file())
    return dataclasses.replace(
        info,
        path=str(d),
        format=FORMAT,
        quantization=_compression(d),  # config.json's dtype is the HF model's, not the IR's
        weights_bytes=nbytes,
        bits_per_weight=None,
        parameters=None,
        active_parameters=None,
        files=files,
        estimated=(),
    )


def _compression(d: Path) -> str | None:
    """``int8``/``int4`` from optimum-intel's ``openvino_config.json``, when it says so."""
    f = d / "openvino_config.json"
    try:
        if not f.is_file() or f.stat().st_size > _MAX_CONFIG_BYTES:
            return None
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    quant = data.get("quantization_config") if isinstance(data, dict) else None
    bits = quant.get("bits") if isinstance(quant, dict) else None
    return f"int{bits}" if bits in (2, 4, 8) else None
