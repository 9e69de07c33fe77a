"""What a model is, read from headers only (never the weights).

``detect_format`` routes a path to a backend; ``inspect_model`` reads GGUF metadata and tensor
infos, ``config.json`` and safetensors headers into a ``ModelInfo``. Every path and file is
untrusted: only regular files are opened (a FIFO or device is refused without blocking), each
length, count and shape is checked before it is used, the work is bounded by caps that real models
stay far below, and whatever is corrupt, hostile or unreadable ends in ``ModelFormatError``
(``ModelNotFound`` only when nothing is there). The cost depends on the header, never on the size
of the weights.

One layer a module, each importing only those below it (never this package): ``_files`` (paths
and bounded reads), ``_json`` (bounded JSON), ``_gguf_reader`` (the GGUF layout, its caps and the
block reader), ``_gguf_lazy`` (a lazy read's search for the header's tail past the vocabulary),
``_gguf`` (``read_gguf_header``), ``_format`` (``detect_format``), ``_model`` (``ModelInfo``),
``_gguf_info``, ``_safetensors`` and ``_hf`` (a GGUF model or a Hugging Face directory into a
``ModelInfo``) and ``_cache`` (a path or cached repo id to a local model: ``resolve_model_dir``,
``read_model_config``). A cap is patched in the module that defines it
(``unillm._inspect._gguf_reader._LAZY_STRINGS``), not here.
"""

from __future__ import annotations

from dataclasses import replace as _replace
from pathlib import Path
from typing import Any

from unillm._inspect._cache import _resolve, read_model_config, resolve_model_dir
from unillm._inspect._files import _kind, _listing
from unillm._inspect._files import _open as _open
from unillm._inspect._format import _file_format, detect_format
from unillm._inspect._gguf import read_gguf_header, read_gguf_stream
from unillm._inspect._gguf_info import _inspect_gguf, _split_stem, gguf_info, lazy_enough
from unillm._inspect._gguf_info import _lazy_enough as _lazy_enough
from unillm._inspect._gguf_lazy import _positions as _positions
from unillm._inspect._gguf_reader import GGML_BLOCKS as GGML_BLOCKS
from unillm._inspect._gguf_reader import GGML_TYPE_NAMES as GGML_TYPE_NAMES
from unillm._inspect._gguf_reader import GGUF_FILE_TYPES as GGUF_FILE_TYPES
from unillm._inspect._gguf_reader import GGUF_MAGIC as GGUF_MAGIC
from unillm._inspect._gguf_reader import GGUFHeader
from unillm._inspect._gguf_reader import _Reader as _Reader
from unillm._inspect._hf import _inspect_hf
from unillm._inspect._model import ModelInfo, bits_per_weight
from unillm._inspect._safetensors import read_safetensors_stream

__all__ = [
    "GGUFHeader",
    "ModelInfo",
    "bits_per_weight",
    "detect_format",
    "gguf_info",
    "hf_info",
    "inspect_model",
    "lazy_enough",
    "read_gguf_header",
    "read_gguf_stream",
    "read_safetensors_stream",
    "read_model_config",
    "resolve_model_dir",
]

# ---- inspect_model ---------------------------------------------------------------------------


def inspect_model(path_or_id: str | Path) -> ModelInfo:
    """Inspect a model from its headers (GGUF metadata, config.json, safetensors headers).

    ``path_or_id`` is a ``.gguf`` file (any part of a split ``-0000N-of-0000M.gguf`` set), a
    ``.safetensors`` file, a model directory, or a Hugging Face repo id already in the local cache
    (never downloaded). Reads headers only: the cost does not grow with the size of the weights.
    Raises ``ModelNotFound`` for a missing path or uncached id and ``ModelFormatError`` for
    anything corrupt, hostile, unreadable or not a model.
    """
    p = _resolve(path_or_id)
    if _kind(p) == "file":
        if p.suffix == ".safetensors":
            if _kind(p.parent / "config.json") == "file":
                return _inspect_hf(p.parent)
            return _inspect_hf(p.parent, files=[p], config={})
        _file_format(p)  # the magic check and its message
        return _inspect_gguf(p)
    if _kind(p / "config.json") == "file":
        return _inspect_hf(p)
    ggufs = _listing(p, ".gguf")
    models = [g for g in ggufs if not g.name.lower().startswith("mmproj")]
    if models and len({_split_stem(g) for g in models}) == 1:
        info = _inspect_gguf(models[0])
        if len(models) < len(ggufs):  # a vision projector next to the language model
            return _replace(info, multimodal=True)
        return info
    if not ggufs and _listing(p, ".safetensors"):
        return _inspect_hf(p, config={})
    return ModelInfo(str(p), detect_format(p))  # raises the directory's ModelFormatError


def hf_info(
    name: str,
    config: dict[str, Any],
    weights_bytes: int | None,
    headers: dict[str, list[tuple[str, str, int, int]]] | None = None,
) -> ModelInfo:
    """The ``ModelInfo`` of an HF-format model known by its ``config.json``, its safetensors
    ``headers`` (file name -> ``read_safetensors_stream``'s entries) when they were read, else the
    size of its weights alone (a repo on the hub before a download)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        files = [Path(d) / f for f in headers] if headers else []
        by_path = {str(Path(d) / f): e for f, e in headers.items()} if headers else None
        info = _inspect_hf(Path(d), files=files, config=config, headers=by_path)
    weights = info.weights_bytes or weights_bytes
    bits = info.bits_per_weight or bits_per_weight(info.quantization)
    params = info.parameters or (round(weights * 8 / bits) if weights and bits else None)
    return _replace(
        info, path=name, weights_bytes=weights, parameters=params, bits_per_weight=bits,
        files=tuple(f"{name}/{f}" for f in headers or ()),
        estimated=("parameters",) if params and not info.parameters else info.estimated,
    )  # fmt: skip
