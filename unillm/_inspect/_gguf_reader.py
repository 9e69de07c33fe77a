"""The GGUF header's layout: its caps, tables and records (``GGUFHeader``), the block reader
(``_Reader``) and the tensor infos."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from io import FileIO
from typing import Any

from unillm._errors import ModelFormatError
from unillm._inspect._files import _read

# ---- GGUF header ----------------------------------------------------------------------------
# Layout (little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata count, then
# the metadata key/values, the tensor infos, padding to `general.alignment`, and the tensor data.
# The caps are far above what real models need (the largest vocabularies hold ~262k tokens, merge
# lists ~280k, whole headers ~20 MB) and bound the work on a hostile header to about a second.

GGUF_MAGIC = b"GGUF"
_MAX_HEADER = 1 << 28  # bytes of metadata and tensor infos
_MAX_KV = 1 << 13  # real files have tens of keys
_MAX_TENSORS = 1 << 17  # the largest MoE models have a few thousand
_MAX_KEY = 1 << 12  # bytes in a key name
_MAX_NAME = 1 << 10  # bytes in a tensor name (llama.cpp itself refuses more than 63)
_MAX_STRING = 1 << 24  # bytes in one string value: a chat template is far smaller
_MAX_TEXT = 1 << 25  # bytes of all the keys and string values kept
_MAX_ARRAY = 1 << 24  # items in a numeric array (a large one is skipped, not read)
_MAX_STRING_ARRAY = 1 << 20  # strings in one array: 4x the largest vocabulary
_MAX_STRINGS = 1 << 21  # strings in all arrays together (a vocabulary plus its merges)
_SMALL_ARRAY = 4096  # numeric arrays up to this length are kept (per-layer head counts)
_MAX_KEPT = 1 << 16  # numeric items kept over all the small arrays
_MAX_DIMS = 8
_MAX_ELEMENTS = 1 << 50  # per tensor: ~10^15 weights is beyond any model, so the header lies
_MIN_KV_BYTES, _MIN_TENSOR_BYTES = 13, 24  # key length + type + 1-byte value; name length + dims
_FIRST_BLOCK, _MAX_BLOCK = 1 << 16, 1 << 22  # reads start small and double while sequential
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SCALAR_STRUCTS = {t: struct.Struct("<" + code) for t, code in _SCALARS.items()}
_STRING, _ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_DIMS = [struct.Struct(f"<{n}Q") for n in range(_MAX_DIMS + 1)]
_TYPE_OFFSET = struct.Struct("<IQ")
# ggml type id -> (elements per block, bytes per block)
GGML_BLOCKS = {
    0: (1, 4),
    1: (1, 2),
    2: (32, 18),
    3: (32, 20),
    6: (32, 22),
    7: (32, 24),
    8: (32, 34),
    9: (32, 40),
    10: (256, 84),
    11: (256, 110),
    12: (256, 144),
    13: (256, 176),
    14: (256, 210),
    15: (256, 292),
    16: (256, 66),
    17: (256, 74),
    18: (256, 98),
    19: (256, 50),
    20: (32, 18),
    21: (256, 110),
    22: (256, 82),
    23: (256, 136),
    24: (1, 1),
    25: (1, 2),
    26: (1, 4),
    27: (1, 8),
    28: (1, 8),
    29: (256, 56),
    30: (1, 2),
    34: (256, 54),
    35: (256, 66),
    39: (32, 17),
    40: (64, 36),
    41: (128, 18),
}
# ggml type id -> name (what a tensor is stored as)
GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
    24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0",
    35: "TQ2_0", 39: "MXFP4", 40: "NVFP4", 41: "Q1_0",
}  # fmt: skip
# general.file_type (llama.cpp's llama_ftype, gguf-py's LlamaFileType) -> the name users know.
# Hard-coded so that inspection never imports gguf; 1024 is the "guessed" flag, masked off.
GGUF_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M",
    30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4_MOE", 39: "NVFP4",
    40: "Q1_0",
}  # fmt: skip
_FTYPE_GUESSED = 1024

# A lazy read (inspection's) stops at the first array of more than _LAZY_STRINGS strings: its length
# is what selection needs, and walking the length prefixes of a 150k-token vocabulary and its merges
# costs tens of milliseconds of Python, where the rest of a header costs one. What comes after the
# arrays is found, when it must be, by the search in _gguf_lazy.
_LAZY_STRINGS = 4096


@dataclass
class GGUFHeader:
    """What a GGUF file says about itself. Large arrays (the vocabulary) are kept as lengths only
    unless asked for, so reading the header costs the same for a 40 MB and a 40 GB file.

    ``unread`` is None when the whole header was read. A lazy read (``read_gguf_header(...,
    lazy=True)``) sets it to the byte range ``(start, end)`` it stepped over unread, from the first
    string of the large array it stopped at to where it found general.file_type; ``end`` is None when
    it read no further, so the tensor infos were not read either: then ``data_end``,
    ``tensor_bytes`` are None, ``parameters`` 0, and ``data_offset`` is the lowest offset the data
    can start at. ``unread_keys`` counts the key/values in the range (their names unknown)."""

    version: int
    metadata: dict[str, Any]
    tensor_count: int
    data_offset: int
    data_end: int | None  # where the last tensor ends; None when a tensor type is unknown
    file_size: int
    array_lengths: dict[str, int] = field(default_factory=dict)
    parameters: int = 0  # elements over all tensors
    tensor_bytes: int | None = 0  # bytes over all tensors; None when a tensor type is unknown
    expert_parameters: int = 0  # elements of the routed-expert tensors (names with "_exps")
    type_elements: dict[int, int] = field(default_factory=dict)  # ggml type -> elements
    unread: tuple[int, int | None] | None = None
    unread_keys: int = 0

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None

    def arch_value(self, key: str) -> Any:
        """``<architecture>.<key>``, e.g. ``arch_value("block_count")``."""
        return self.metadata.get(f"{self.architecture}.{key}")

    @property
    def tensors_read(self) -> bool:
        """Whether the tensor infos were read (always, but after a lazy read that stopped)."""
        return self.unread is None or self.unread[1] is not None

    @property
    def truncated(self) -> bool:
        return self.data_end is not None and self.data_end > self.file_size


class _Reader:
    """A GGUF header read in large blocks. Values are parsed from memory, and an array of strings
    is skipped by walking its length prefixes inside the block: one read per block, not per string.
    Every length is checked against the caps and the file before it is used."""

    def __init__(self, f: FileIO, path: str, size: int) -> None:
        self.f, self.path, self.size = f, path, size
        self.buf = b""
        self.base = 0  # the file offset of buf[0]
        self.pos = 0  # the next byte as an index into buf; past its end after a skip
        self.block = _FIRST_BLOCK
        self.n_strings = self.text = self.kept = 0  # against _MAX_STRINGS, _MAX_TEXT, _MAX_KEPT
        self.records = 0  # tensor infos parsed, against the lazy search's budget
        self.stopped: int | None = None  # where a lazy read stopped: the first string of an array

    def tell(self) -> int:
        return self.base + self.pos

    def seek(self, offset: int) -> None:
        """Go on reading at ``offset`` (a lazy read's jump past the arrays, and back)."""
        self.f.seek(offset)
        self.buf, self.base, self.pos, self.block = b"", offset, 0, _FIRST_BLOCK

    def corrupt(self, what: str) -> ModelFormatError:
        return ModelFormatError(f"{self.path!r}: {what} (corrupt or hostile file)")

    def truncated(self) -> ModelFormatError:
        return ModelFormatError(
            f"{self.path!r}: the GGUF header ends early (truncated file); download it again"
        )

    def fill(self, n: int) -> None:
        """Make the ``n`` bytes from the current position available in ``buf``."""
        start = self.tell()
        if start + n > self.size:
            raise self.truncated()
        if start + n > _MAX_HEADER:
            raise self.corrupt(f"the GGUF header runs past {_MAX_HEADER >> 20} MiB")
        if self.pos > len(self.buf):  # skipped past the block: read small until reads are sequential
            self.f.seek(start)
            self.block = _FIRST_BLOCK
        rest = self.buf[self.pos :]
        want = max(n - len(rest), min(self.block, self.size - start - len(rest)))
        self.buf, self.base, self.pos = rest + _read(self.f, want, self.path), start, 0
        self.block = min(2 * self.block, _MAX_BLOCK)
        if len(self.buf) < n:  # the file shrank while being read
            raise self.truncated()

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            self.fill(n)
        data = self.buf[self.pos : self.pos + n]
        self.pos += n
        return data

    def skip(self, n: int) -> None:
        if self.tell() + n > self.size:
            raise self.truncated()
        self.pos += n

    def scalar(self, s: struct.Struct) -> Any:
        return self.unpack(s)[0]

    def unpack(self, s: struct.Struct) -> tuple[Any, ...]:
        if self.pos + s.size > len(self.buf):
            self.fill(s.size)
        values = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return values

    def string(self, limit: int, what: str) -> str:
        n = self.scalar(_U64)
        if n > limit:
            raise self.corrupt(f"a GGUF {what} of {n} bytes is implausible")
        self.text += n
        if self.text > _MAX_TEXT:
            raise self.corrupt(f"the GGUF keys and strings add up to more than {_MAX_TEXT >> 20} MiB")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, vtype: int, keep_arrays: bool, lazy: bool = False) -> tuple[Any, int | None]:
        """A metadata value and, for an array, its length (the value is None for a skipped array).
        ``lazy``: stop at a large string array (``stopped`` says where)."""
        s = _SCALAR_STRUCTS.get(vtype)
        if s is not None:
            return self.scalar(s), None
        if vtype == _STRING:
            return self.string(_MAX_STRING, "string"), None
        if vtype != _ARRAY:
            raise self.corrupt(f"unknown GGUF value type {vtype}")
        etype, n = self.scalar(_U32), self.scalar(_U64)
        if etype == _ARRAY:
            raise self.corrupt("nested GGUF arrays are not supported")
        if etype == _STRING:
            return self.string_array(n, keep_arrays, lazy), n
        code = _SCALARS.get(etype)
        if code is None:
            raise self.corrupt(f"unknown GGUF array type {etype}")
        width = _SCALAR_STRUCTS[etype].size
        if n > _MAX_ARRAY or n * width > self.size - self.tell():
            raise self.corrupt(f"a GGUF array of {n} items is implausible")
        if keep_arrays or (n <= _SMALL_ARRAY and self.kept + n <= _MAX_KEPT):
            self.kept += n
            return list(struct.unpack(f"<{n}{code}", self.take(n * width))), n
        self.skip(n * width)
        return None, n

    def string_array(self, n: int, keep: bool, lazy: bool) -> list[str] | None:
        if n > _MAX_STRING_ARRAY or n * 8 > self.size - self.tell():
            raise self.corrupt(f"a GGUF array of {n} strings is implausible")
        self.n_strings += n
        if self.n_strings > _MAX_STRINGS:
            raise self.corrupt(f"the GGUF arrays hold more than {_MAX_STRINGS} strings")
        if keep:
            return [self.string(_MAX_STRING, "string") for _ in range(n)]
        if lazy and n > _LAZY_STRINGS:
            self.stopped = self.tell()
            return None
        self.skip_strings(n)
        return None

    def skip_strings(self, n: int) -> None:
        unpack = _U64.unpack_from
        while n:
            if self.pos + 8 > len(self.buf):
                self.fill(8)
            buf, pos, walked = self.buf, self.pos, 0
            try:
                for walked in range(n):  # noqa: B007 (walked counts the strings passed)
                    pos += 8 + unpack(buf, pos)[0]
                walked = n
            except (struct.error, OverflowError):
                pass  # the next length prefix is not (wholly) in this block, or lies far past it
            self.pos = pos
            n -= walked
            if self.tell() > self.size:
                raise self.truncated()


def _alignment(r: _Reader, metadata: dict[str, Any]) -> int:
    alignment = metadata.get("general.alignment", 32)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise r.corrupt(f"general.alignment {repr(alignment)[:40]} is not a power of two")
    return alignment


def _align(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


@dataclass
class _TensorInfos:
    """What the tensor infos of one GGUF add up to."""

    parameters: int = 0
    expert_parameters: int = 0
    nbytes: int | None = 0  # None when a tensor type is unknown
    end: int | None = 0  # where the last tensor ends, from the data's start
    padded: int = 0  # the data as llama.cpp lays it out: every tensor padded to the alignment
    type_elements: dict[int, int] = field(default_factory=dict)


def _tensor_infos(r: _Reader, n_tensors: int, alignment: int, limit: int | None = None) -> _TensorInfos:
    """The ``n_tensors`` tensor infos from the current position. ``limit`` (the lazy search's
    check): every type must be known and every tensor start where llama.cpp expects it, and the
    reader's count of infos parsed stay within ``limit``."""
    out = _TensorInfos()
    for _ in range(n_tensors):
        r.records += 1
        if limit is not None and r.records > limit:
            raise r.corrupt("too many tensor infos tried")
        n = r.scalar(_U64)
        if n > _MAX_NAME:
            raise r.corrupt(f"a GGUF tensor name of {n} bytes is implausible")
        name = r.take(n)
        n_dims = r.scalar(_U32)
        if n_dims > _MAX_DIMS:
            raise r.corrupt(f"a tensor with {n_dims} dimensions")
        elements = 1
        for dim in r.unpack(_DIMS[n_dims]):
            elements *= dim
            if elements > _MAX_ELEMENTS:
                shown = name[:200].decode("utf-8", errors="replace")
                raise r.corrupt(f"tensor {shown!r} claims more than 2^50 elements")
        ttype, offset = r.unpack(_TYPE_OFFSET)
        out.parameters += elements
        if b"_exps" in name:
            out.expert_parameters += elements
        out.type_elements[ttype] = out.type_elements.get(ttype, 0) + elements
        block = GGML_BLOCKS.get(ttype)
        if limit is not None and (block is None or offset != out.padded):
            raise r.corrupt("a tensor info unlike llama.cpp's layout")
        if block is None or out.end is None or out.nbytes is None:
            out.end = out.nbytes = None
        else:
            tensor_bytes = elements // block[0] * block[1]
            out.nbytes += tensor_bytes
            out.end = max(out.end, offset + tensor_bytes)
            out.padded += _align(tensor_bytes, alignment)
    return out
