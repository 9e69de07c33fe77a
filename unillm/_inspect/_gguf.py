"""``read_gguf_header``: a GGUF file's header read whole, or lazily (up to the vocabulary, then the
tail found by ``_gguf_lazy``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO

from unillm._errors import ModelFormatError, ModelNotFound, UnillmError
from unillm._inspect._files import _kind, _listing, _open, _unreadable
from unillm._inspect._gguf_lazy import _lazy_rest
from unillm._inspect._gguf_reader import (
    _MAX_HEADER,
    _MAX_KEY,
    _MAX_KV,
    _MAX_TENSORS,
    _MIN_KV_BYTES,
    _MIN_TENSOR_BYTES,
    _U32,
    _U64,
    GGUF_MAGIC,
    GGUFHeader,
    _align,
    _alignment,
    _Reader,
    _tensor_infos,
)


def read_gguf_header(path: str | Path, *, keep_arrays: bool = False, lazy: bool = False) -> GGUFHeader:
    """Parse a GGUF file's header (metadata and tensor infos), never its tensor data.

    Raises ``ModelNotFound`` when nothing is at ``path`` and ``ModelFormatError`` for a directory,
    a FIFO or device, an unreadable file, a wrong magic, an unsupported version, or any length or
    count that cannot be right; large arrays are skipped (their lengths kept) unless ``keep_arrays``.

    ``lazy`` (inspection's read; ignored with ``keep_arrays``) stops at the first array of more than
    4,096 strings, the vocabulary, and reads on only from general.file_type when that comes after
    it and is found (see ``GGUFHeader.unread``): the keys between are not read, nor checked. A full
    read is the default, for what needs every key (a tokenizer's ids, the chat template).
    """
    p = Path(path)
    kind = _kind(p)
    if kind is None:
        raise ModelNotFound(str(path))
    if kind == "dir":
        raise _gguf_directory(p)
    with _open(p) as f:
        try:
            return _parse_gguf(_Reader(f, str(p), os.fstat(f.fileno()).st_size), keep_arrays, lazy)
        except UnillmError:
            raise
        except OSError as exc:  # a seek or read failing under us (EIO on a failing disk)
            raise _unreadable(p, exc) from exc


def read_gguf_stream(f: BinaryIO, name: str, size: int, *, lazy: bool = False) -> GGUFHeader:
    """A GGUF header read from an open binary stream of ``size`` bytes (``read``, ``seek``): a
    file on the hub read by range requests. ``name`` is what errors call it; ``lazy`` as in
    ``read_gguf_header``. The same caps and checks as a file on disk."""
    return _parse_gguf(_Reader(f, name, size), False, lazy)  # type: ignore[arg-type]


def _gguf_directory(p: Path) -> ModelFormatError:
    if _kind(p / "config.json") == "file":
        return ModelFormatError(
            f"{str(p)!r} is a directory holding a Hugging Face model (config.json and safetensors "
            "weights), not a GGUF file, and llama.cpp reads only .gguf files: pass a .gguf file, "
            "convert this model with llama.cpp's convert_hf_to_gguf.py, or use a backend that "
            "reads this format (`unillm select` lists them)"
        )
    ggufs = _listing(p, ".gguf")
    if ggufs:
        names = ", ".join(g.name for g in ggufs[:3]) + (", ..." if len(ggufs) > 3 else "")
        return ModelFormatError(
            f"{str(p)!r} is a directory, not a GGUF file: pass one of its .gguf files ({names})"
        )
    return ModelFormatError(f"{str(p)!r} is a directory, not a GGUF file: pass the path of a .gguf file")


def _parse_gguf(r: _Reader, keep_arrays: bool, lazy: bool) -> GGUFHeader:
    magic = r.take(4)
    if magic != GGUF_MAGIC:
        raise ModelFormatError(f"{r.path!r} is not a GGUF file (magic {magic!r}, want b'GGUF')")
    version = r.scalar(_U32)
    if version not in (2, 3):
        raise ModelFormatError(f"{r.path!r}: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = r.scalar(_U64), r.scalar(_U64)
    if n_tensors > _MAX_TENSORS or n_kv > _MAX_KV:
        raise r.corrupt(f"GGUF claims {n_tensors} tensors and {n_kv} keys")
    if n_tensors * _MIN_TENSOR_BYTES + n_kv * _MIN_KV_BYTES > r.size - r.tell():
        raise r.corrupt(f"GGUF claims {n_tensors} tensors and {n_kv} keys in {r.size} bytes")
    metadata: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    lazy = lazy and not keep_arrays and n_tensors > 0  # a vocabulary-only file has nothing to skip to
    for i in range(n_kv):
        key = r.string(_MAX_KEY, "key")
        if key in metadata:
            raise r.corrupt(f"the GGUF key {key[:200]!r} appears twice (llama.cpp refuses such files too)")
        value, n = r.value(r.scalar(_U32), keep_arrays, lazy)
        if n is not None:
            lengths[key] = n
        metadata[key] = value
        if r.stopped is not None and n is not None:
            return _lazy_rest(r, version, n_tensors, n_kv - i - 1, metadata, lengths, r.stopped, n)
    alignment = _alignment(r, metadata)
    infos = _tensor_infos(r, n_tensors, alignment)
    header_end = r.tell()
    if header_end > _MAX_HEADER:
        raise r.corrupt(f"the GGUF header runs past {_MAX_HEADER >> 20} MiB")
    data_offset = _align(header_end, alignment)
    return GGUFHeader(
        version,
        metadata,
        n_tensors,
        data_offset,
        None if infos.end is None else data_offset + infos.end,
        r.size,
        lengths,
        infos.parameters,
        infos.nbytes,
        infos.expert_parameters,
        infos.type_elements,
    )
