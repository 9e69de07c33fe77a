"""A lazy GGUF read's search for the tail of the header: general.file_type and the tensor infos
past the vocabulary, found and verified rather than walked to."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unillm._errors import ModelFormatError
from unillm._inspect._files import _unreadable
from unillm._inspect._gguf_reader import (
    _MAX_HEADER,
    _MAX_KEY,
    _MIN_KV_BYTES,
    _MIN_TENSOR_BYTES,
    _U32,
    _U64,
    GGUFHeader,
    _align,
    _alignment,
    _Reader,
    _tensor_infos,
    _TensorInfos,
)

# A lazy read stops at the first array of more than _LAZY_STRINGS strings (_gguf_reader).
# What comes after the arrays is found, not walked to, when it must be: llama-quantize writes
# general.file_type last (it removes the key and appends it), so in most downloaded files the
# quantization and the tensor infos lie past the vocabulary. The key's bytes are searched for in
# blocks and taken only where the keys after them parse and are followed by tensor infos laid out as
# llama.cpp requires (each tensor right after the previous one, padded to the alignment) that end
# with the file: a string that merely holds those bytes does not pass.
_FILE_TYPE_KEY = _U64.pack(17) + b"general.file_type"  # its length, then the key
_SCAN_BLOCK = 1 << 20
_TAIL_WINDOW = 32 << 20  # bytes searched past the arrays: real headers hold ~10 MB in all
_TAIL_KEYS = 64  # keys from general.file_type to the tensor infos (llama-quantize writes ~6)
_TAIL_CANDIDATES = 8  # places the key's bytes are tried at (a real file has one)
_TAIL_SLACK = 4096  # tensor infos parsed at wrong places before the search gives up


def _lazy_rest(
    r: _Reader,
    version: int,
    n_tensors: int,
    rest: int,
    metadata: dict[str, Any],
    lengths: dict[str, int],
    start: int,
    n: int,
) -> GGUFHeader:
    """A lazy read stopped at ``start``, the first of ``n`` strings, ``rest`` keys before the tensor
    infos."""
    if "general.alignment" in metadata:
        _alignment(r, metadata)  # checked as the full read checks it
    after = start + 8 * n  # each string has at least its length
    if "general.file_type" not in metadata and rest:
        tail = _find_tail(r, after, rest, n_tensors, metadata)
        if tail is not None:
            infos = tail.infos
            return GGUFHeader(
                version,
                metadata | tail.metadata,
                n_tensors,
                tail.data_offset,
                None if infos.end is None else tail.data_offset + infos.end,
                r.size,
                lengths | tail.lengths,
                infos.parameters,
                infos.nbytes,
                infos.expert_parameters,
                infos.type_elements,
                unread=(start, tail.at),
                unread_keys=rest - len(tail.metadata),
            )
    lowest = after + rest * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_BYTES
    if lowest > r.size:
        raise r.truncated()
    if lowest > _MAX_HEADER:
        raise r.corrupt(f"the GGUF header runs past {_MAX_HEADER >> 20} MiB")
    return GGUFHeader(
        version,
        metadata,
        n_tensors,
        lowest,
        None,
        r.size,
        lengths,
        tensor_bytes=None,
        unread=(start, None),
        unread_keys=rest,
    )


@dataclass
class _Tail:
    """The keys from general.file_type on and the tensor infos, as a lazy read found them."""

    at: int
    metadata: dict[str, Any]
    lengths: dict[str, int]
    infos: _TensorInfos
    data_offset: int


def _find_tail(r: _Reader, after: int, rest: int, n_tensors: int, head: dict[str, Any]) -> _Tail | None:
    """The tail of the header past the arrays, found from general.file_type's bytes; None if they
    are not found, or nowhere verified, within the bounds (the file is then read whole)."""
    end = min(r.size, _MAX_HEADER, after + _TAIL_WINDOW)
    limit = n_tensors + _TAIL_SLACK
    for tries, at in enumerate(_positions(r, _FILE_TYPE_KEY, after, end)):
        if tries == _TAIL_CANDIDATES or r.records > limit:
            return None
        try:
            return _tail_at(r, at, min(rest, _TAIL_KEYS), n_tensors, head, limit)
        except ModelFormatError:
            continue  # the key's bytes inside a string, or a tail the full read will report
    return None


def _tail_at(r: _Reader, at: int, keys: int, n_tensors: int, head: dict[str, Any], limit: int) -> _Tail:
    """The keys from ``at`` on, then the tensor infos, which must follow one of the first ``keys``
    keys laid out as llama.cpp requires and end with the file; ModelFormatError where they do not."""
    r.seek(at)
    metadata: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for _ in range(keys):
        key = r.string(_MAX_KEY, "key")
        if key in head or key in metadata:
            raise r.corrupt(f"the GGUF key {key[:200]!r} appears twice")
        value, n = r.value(r.scalar(_U32), False)
        if n is not None:
            lengths[key] = n
        metadata[key] = value
        mark = r.tell()
        alignment = _alignment(r, head | metadata)
        try:
            infos = _tensor_infos(r, n_tensors, alignment, limit)
        except ModelFormatError:
            if r.records > limit:
                raise
            r.seek(mark)
            continue
        data_offset = _align(r.tell(), alignment)
        lowest = data_offset + infos.end if n_tensors and infos.end is not None else r.tell()
        if lowest <= r.size <= data_offset + infos.padded:
            return _Tail(at, metadata, lengths, infos, data_offset)
        r.seek(mark)
    raise r.corrupt("no tensor infos follow the keys")


def _positions(r: _Reader, needle: bytes, begin: int, end: int) -> Iterator[int]:
    """Where ``needle`` starts between ``begin`` and ``end``. One buffer is read into again and
    again (a fresh one per block costs its page faults); blocks overlap by the needle's length less
    one, so that no occurrence is missed or found twice."""
    buf = bytearray(min(_SCAN_BLOCK, max(0, end - begin)))
    pos = begin
    while end - pos >= len(needle):
        want = min(len(buf), end - pos)
        r.f.seek(pos)  # the caller reads elsewhere between the occurrences
        try:
            got = r.f.readinto(memoryview(buf)[:want]) or 0
        except OSError as exc:
            raise _unreadable(Path(r.path), exc) from exc
        i = buf.find(needle, 0, got)
        while i >= 0:
            yield pos + i
            i = buf.find(needle, i + 1, got)
        if got < want:  # the end of the file (a short read otherwise only ends the search early)
            return
        pos += got - len(needle) + 1
