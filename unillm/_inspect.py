"""What a model is, read from headers only (never the weights).

``detect_format`` routes a path to a backend; ``inspect_model`` reads GGUF metadata and tensor
infos, ``config.json`` and safetensors headers into a ``ModelInfo``. Every path and file is
untrusted: only regular files are opened (a FIFO or device is refused without blocking), each
length, count and shape is checked before it is used, the work is bounded by caps that real models
stay far below, and whatever is corrupt, hostile or unreadable ends in ``ModelFormatError``
(``ModelNotFound`` only when nothing is there). The cost depends on the header, never on the size
of the weights.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from dataclasses import replace as _replace
from io import FileIO
from pathlib import Path
from typing import Any

from unillm._errors import ModelFormatError, ModelNotFound, UnillmError
from unillm._plan import bits_per_weight

__all__ = ["GGUFHeader", "ModelInfo", "detect_format", "inspect_model", "read_gguf_header"]

GGUF_MAGIC = b"GGUF"
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
_MAX_CONFIG_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class ModelInfo:
    """What a model is, read from headers only. None means the files do not say.

    ``quantization`` names the scheme as its engine does ("Q4_K_M", "awq", "gptq", "fp8", "exl2",
    "mlx-4bit", or the dtype "bf16"/"f16"/"f32" for unquantized weights); ``bits_per_weight`` is
    the average over all weights including scales. ``parameters`` counts all weights;
    ``active_parameters`` those used per token (differs for MoE). ``group_size`` is the
    quantization group (weights per scale) where the files say it.

    ``estimated`` names the fields derived rather than read. A GGUF whose general.file_type comes
    before its vocabulary (convert_hf_to_gguf's layout) is inspected without reading the
    vocabulary's strings or the tensor infos after them: ``weights_bytes`` is then an upper bound,
    the file's size less the bytes the header takes at the least (over by at most the header bytes
    not read and the alignment padding: a few MB for a 150k-token vocabulary), and
    ``parameters``, ``active_parameters`` and ``bits_per_weight`` follow from it and the usual bits
    per weight of the file type (``unillm._plan.BITS_PER_WEIGHT``).
    """

    path: str
    format: str
    architecture: str | None = None
    quantization: str | None = None
    bits_per_weight: float | None = None
    parameters: int | None = None
    active_parameters: int | None = None
    weights_bytes: int | None = None
    layers: int | None = None
    hidden_size: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    context_length: int | None = None
    vocab_size: int | None = None
    experts: int | None = None
    experts_per_token: int | None = None
    multimodal: bool = False
    hybrid_attention: bool = False
    files: tuple[str, ...] = ()
    group_size: int | None = None
    estimated: tuple[str, ...] = ()

    @property
    def is_moe(self) -> bool:
        return bool(self.experts and self.experts > 1)

    def kv_bytes_per_token(self, bytes_per_element: float = 2.0) -> int | None:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element; None if unknown."""
        if self.layers is None or self.kv_heads is None or self.head_dim is None:
            return None
        return round(2 * self.layers * self.kv_heads * self.head_dim * bytes_per_element)


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


# ---- paths and files ------------------------------------------------------------------------
# A path is untrusted too: it may name nothing, a FIFO (opening one for reading waits for a writer
# forever), a device, a file this user cannot read, or be too long for the filesystem. Each case
# is its own message; only "nothing is there" is ModelNotFound.

_NOT_REGULAR = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}
_NOTHING_THERE = (FileNotFoundError, NotADirectoryError)


def _expand(path: str | Path) -> Path:
    p = Path(path)
    try:
        return p.expanduser()
    except RuntimeError:  # "~user" naming no user: take the path literally
        return p


def _kind(p: Path) -> str | None:
    """``"file"`` or ``"dir"`` (symlinks followed); None when nothing is there."""
    try:
        mode = p.stat().st_mode
    except _NOTHING_THERE:
        return None
    except OSError as exc:
        raise _unreadable(p, exc) from exc
    except ValueError as exc:  # a NUL byte, or a name the filesystem encoding cannot hold
        raise ModelFormatError(f"{str(p)!r} is not a valid path ({exc}): check the model path") from None
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    raise _not_regular(p, mode)


def _not_regular(p: Path, mode: int) -> ModelFormatError:
    what = _NOT_REGULAR.get(stat.S_IFMT(mode), "not a regular file")
    return ModelFormatError(
        f"{str(p)!r} is {what}, not a model file: pass a .gguf file, a .safetensors file or a model directory"
    )


def _unreadable(p: Path, exc: OSError) -> ModelFormatError:
    if exc.errno == errno.ENAMETOOLONG:
        why = "the path is too long for the filesystem (names have at most 255 bytes): check it"
    elif isinstance(exc, PermissionError):
        why = "permission denied: make it readable for this user (chmod, chown) or run as one who can"
    elif exc.errno == errno.ELOOP:
        why = "it is a loop of symbolic links: fix the link"
    elif exc.errno == errno.EISDIR:
        why = "it is a directory where a file was expected"
    else:
        why = f"{exc.strerror or exc}: check the file and the disk it is on"
    return ModelFormatError(f"{str(p)!r} cannot be read: {why}")


def _open(p: Path) -> FileIO:
    """``p`` opened for reading, unbuffered, if it is a regular file; never blocks on a FIFO."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(p, flags)
    except _NOTHING_THERE:
        raise ModelNotFound(str(p)) from None
    except OSError as exc:
        raise _unreadable(p, exc) from exc
    except ValueError as exc:
        raise ModelFormatError(f"{str(p)!r} is not a valid path ({exc}): check the model path") from None
    try:
        # checked on the open file: the path may have been replaced since it was looked at
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ModelFormatError(f"{str(p)!r} is a directory where a model file was expected")
        if not stat.S_ISREG(mode):
            raise _not_regular(p, mode)
        return FileIO(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise


def _read(f: FileIO, n: int, p: Path | str) -> bytes:
    """``n`` bytes, fewer only at the end of the file. Callers bound ``n`` by the file's size: a
    read allocates what it asks for up front, so a lying length must never reach here."""
    try:
        data = f.read(n) or b""
        while 0 < len(data) < n:  # a short read before the end (a signal, a read over 2 GiB)
            more = f.read(n - len(data))
            if not more:
                break
            data += more
    except OSError as exc:
        raise _unreadable(Path(p), exc) from exc
    return data


def _listing(d: Path, suffix: str) -> list[Path]:
    """The entries of ``d`` whose names end with ``suffix``, sorted (what ``glob("*" + suffix)`` finds,
    with an unreadable directory reported instead of looking empty)."""
    try:
        with os.scandir(d) as entries:
            names = [e.name for e in entries if e.name.endswith(suffix)]
    except OSError as exc:
        raise _unreadable(d, exc) from exc
    return sorted(d / name for name in names)


# ---- JSON -----------------------------------------------------------------------------------
# Parsed with hooks that refuse what json.loads would otherwise accept from a hostile file: a
# number of a million digits (quadratic to convert when sys.set_int_max_str_digits(0) lifts the
# default guard) and nesting deep enough to exhaust the recursion limit. NaN and Infinity are not
# JSON, but real config.json files hold them (Mamba2 and Nemotron-H write "time_step_limit":
# [0.0, Infinity], as transformers serializes it): accepted there, harmless to what is read (every
# number used is range-checked), and refused in safetensors headers, as safetensors itself does.

_MAX_NUMBER_CHARS = 1000  # real files hold ints like 10**30 and floats like 1e-05; the longest
# exact decimal expansion of a double has ~770 digits


def _config_format(config: Path) -> str:
    return _format_of_config(_load_json(config, _MAX_CONFIG_BYTES))


def _load_json(path: Path, limit: int) -> dict[str, Any]:
    """A JSON object from an untrusted file: at most ``limit`` bytes, strict UTF-8."""
    with _open(path) as f:
        size = os.fstat(f.fileno()).st_size
        data = b"" if size > limit else _read(f, size + 1, path)  # one more: a file that grew
    if size > limit or len(data) > limit:
        raise ModelFormatError(
            f"{str(path)!r} is larger than {limit >> 20} MiB, implausible for a {path.name}: the file "
            "is corrupt or not what its name says"
        )
    value = _parse_json(data, repr(str(path)))
    if not isinstance(value, dict):
        raise ModelFormatError(f"{str(path)!r} is not a JSON object (corrupt file)")
    return value


def _parse_json(data: bytes, what: str, *, strict: bool = False) -> Any:
    """JSON from untrusted bytes; ``strict`` also refuses NaN and infinities."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ModelFormatError(
            f"{what} is not UTF-8 text (byte {exc.start}: {exc.reason}): the file is corrupt or not JSON"
        ) from None
    try:
        return json.loads(
            text,
            parse_int=_json_int,
            parse_float=_json_finite_float if strict else _json_float,
            parse_constant=_json_constant if strict else None,
        )
    except RecursionError:  # json's C scanner recurses once per nesting level
        raise ModelFormatError(f"{what} is nested too deeply (corrupt or hostile file)") from None
    except ValueError as exc:
        raise ModelFormatError(f"{what} is not valid JSON: {exc} (corrupt or hostile file)") from None


def _json_int(text: str) -> int:
    if len(text) > _MAX_NUMBER_CHARS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _json_float(text: str) -> float:
    if len(text) > _MAX_NUMBER_CHARS:
        raise ValueError(f"a number of {len(text)} characters")
    return float(text)


def _json_finite_float(text: str) -> float:
    value = _json_float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} overflows a double")
    return value


def _json_constant(text: str) -> float:
    raise ValueError(f"{text} is not a JSON value")


def _format_of_config(data: dict[str, Any]) -> str:
    quant = data.get("quantization_config")
    if isinstance(quant, dict):
        method = quant.get("quant_method")
        if isinstance(method, str) and method.lower() in _QUANT_METHODS:
            return _QUANT_METHODS[method.lower()]
    if isinstance(data.get("quantization"), dict):
        return "mlx"
    return "safetensors"


# ---- GGUF header ----------------------------------------------------------------------------
# Layout (little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata count, then
# the metadata key/values, the tensor infos, padding to `general.alignment`, and the tensor data.
# The caps are far above what real models need (the largest vocabularies hold ~262k tokens, merge
# lists ~280k, whole headers ~20 MB) and bound the work on a hostile header to about a second.

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

# A lazy read (inspection's) stops at the first array of more than _LAZY_STRINGS strings: its
# length is what selection needs, and walking the length prefixes of a 150k-token vocabulary and
# its merges costs tens of milliseconds of Python, where the rest of a header costs one. What comes
# after the arrays is found, not walked to, when it must be: llama-quantize writes
# general.file_type last (it removes the key and appends it), so in most downloaded files the
# quantization and the tensor infos lie past the vocabulary. The key's bytes are searched for in
# blocks and taken only where the keys after them parse and are followed by tensor infos laid out
# as llama.cpp requires (each tensor right after the previous one, padded to the alignment) that
# end with the file: a string that merely holds those bytes does not pass.
_LAZY_STRINGS = 4096
_FILE_TYPE_KEY = _U64.pack(17) + b"general.file_type"  # its length, then the key
_SCAN_BLOCK = 1 << 20
_TAIL_WINDOW = 32 << 20  # bytes searched past the arrays: real headers hold ~10 MB in all
_TAIL_KEYS = 64  # keys from general.file_type to the tensor infos (llama-quantize writes ~6)
_TAIL_CANDIDATES = 8  # places the key's bytes are tried at (a real file has one)
_TAIL_SLACK = 4096  # tensor infos parsed at wrong places before the search gives up


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


# ---- inspect_model ---------------------------------------------------------------------------

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_SPLIT = re.compile(r"(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
_MAX_SPLITS = 1024
_MAX_SHARDS = 10_000
_MAX_INDEX_BYTES = 64 * 1024 * 1024
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024
_MAX_INT = 1 << 48  # a config integer beyond this is junk, not a model dimension


def _resolve(path_or_id: str | Path) -> Path:
    """A local path, or a repo id resolved through the local Hugging Face cache only."""
    p = _expand(path_or_id)
    if _kind(p) is not None:
        return p
    name = str(path_or_id)
    if isinstance(path_or_id, str) and _REPO_ID.fullmatch(name):
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            raise ModelNotFound(name) from None
        try:
            return Path(snapshot_download(name, local_files_only=True))
        except Exception as exc:  # the hub's not-cached / invalid-id errors vary between versions
            raise ModelNotFound(name) from exc
    raise ModelNotFound(name)


def _int(value: Any) -> int | None:
    """A count from untrusted metadata: a sane non-negative int (the max of a per-layer list)."""
    if isinstance(value, list):
        ints = [x for x in value[:_SMALL_ARRAY] if not isinstance(x, (list, dict)) and _int(x) is not None]
        return max(ints) if ints else None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_INT:
        return value
    return None


def _num(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 64:
        return float(value)
    return None


def _bpw(nbytes: int | None, params: int | None) -> float | None:
    return round(nbytes * 8 / params, 4) if nbytes is not None and params else None


def _active(params: int | None, expert_params: int, experts: int | None, used: int | None) -> int | None:
    if params is None or not expert_params or not experts or experts <= 1 or not used:
        return params
    return params - expert_params + expert_params * min(used, experts) // experts


# ---- GGUF ------------------------------------------------------------------------------------

_HYBRID_ARCHS = {
    "gemma2", "gemma3", "gemma3n", "cohere2", "jamba", "falcon-h1", "nemotron_h", "granitehybrid",
    "qwen3next", "lfm2", "plamo2", "mamba", "mamba2", "rwkv6", "rwkv7", "gpt-oss", "llama4",
}  # fmt: skip
_MULTIMODAL_ARCHS = {"clip", "mllama", "qwen2vl", "qwen25vl", "qwen3vl", "qwen3vlmoe"}


def _split_stem(p: Path) -> str:
    m = _SPLIT.fullmatch(p.name)
    return m["stem"] if m else p.name


def _gguf_parts(p: Path) -> list[Path]:
    m = _SPLIT.fullmatch(p.name)
    if not m:
        return [p]
    no, count = int(m["no"]), int(m["count"])
    if not 1 <= no <= count or count > _MAX_SPLITS:
        raise ModelFormatError(f"{str(p)!r}: split part {no} of {count} cannot be right")
    parts = [p.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [q.name for q in parts if _kind(q) != "file"]
    if missing:
        raise ModelFormatError(
            f"{str(p)!r} is part of a {count}-part split GGUF but {', '.join(missing[:5])} "
            f"{'is' if len(missing) == 1 else 'are'} missing: download every part into one directory"
        )
    return parts


# What a lazy read must have seen for its answer to be the full read's: the shape selection and the
# planner use. Whatever else inspection reads is taken as absent when it is not there: writers put
# the <arch>.* keys together, before the tokenizer (convert_hf_to_gguf), and llama-quantize and
# gguf-split keep them in place and append what they add after general.file_type, in the tail a
# lazy read finds in their layout.
_LAZY_NEEDS = ("block_count", "embedding_length", "attention.head_count", "context_length")
_ESTIMATED = ("weights_bytes", "parameters", "active_parameters", "bits_per_weight")


def _inspect_gguf(p: Path, *, lazy: bool = True) -> ModelInfo:
    parts = _gguf_parts(p)
    headers = []
    for q in parts:
        h = read_gguf_header(q, lazy=lazy)
        headers.append(h if _lazy_enough(h) else read_gguf_header(q))
    for q, h in zip(parts, headers, strict=True):
        if h.truncated:
            raise ModelFormatError(
                f"{str(q)!r} is truncated: its tensors end at byte {h.data_end} but the file has "
                f"{h.file_size}; download it again"
            )
    first = headers[0]
    md = first.metadata
    if len(parts) > 1:
        count = _int(md.get("split.count"))
        if count is not None and count != len(parts):
            raise ModelFormatError(f"{str(p)!r}: split.count says {count} parts, the name {len(parts)}")
        want = _int(md.get("split.tensors.count"))
        have = sum(h.tensor_count for h in headers)
        if want is not None and want != have:
            raise ModelFormatError(f"{str(p)!r}: the parts hold {have} tensors, split.tensors.count {want}")
    arch = first.architecture

    def av(key: str) -> int | None:
        return _int(md.get(f"{arch}.{key}"))

    params = sum(h.parameters for h in headers)
    sizes = [h.tensor_bytes for h in headers]
    estimated: tuple[str, ...] = ()
    for i, h in enumerate(headers):
        bpw = _file_type_bits(h.metadata)
        if not h.tensors_read and bpw is not None:  # _lazy_enough saw to bpw
            # the data runs from where it can start at the earliest to the end of the file
            sizes[i] = upper = h.file_size - h.data_offset
            params += round(upper * 8 / bpw)
            estimated = _ESTIMATED
    nbytes = None if any(b is None for b in sizes) else sum(b for b in sizes if b is not None)
    type_elements: dict[int, int] = {}
    for h in headers:
        for t, n in h.type_elements.items():
            type_elements[t] = type_elements.get(t, 0) + n
    quant = _file_type_name(md)
    if quant is None and type_elements:  # no (or an unknown) file type: the dominant tensor type
        quant = GGML_TYPE_NAMES.get(max(type_elements, key=lambda t: type_elements[t]))
    heads, hidden = av("attention.head_count"), av("embedding_length")
    kv_heads = av("attention.head_count_kv") or heads
    head_dim = av("attention.key_length") or (hidden // heads if hidden and heads else None)
    experts, used = av("expert_count"), av("expert_used_count")
    vocab = first.array_lengths.get("tokenizer.ggml.tokens") or av("vocab_size")
    keys = list(md)
    multimodal = arch in _MULTIMODAL_ARCHS or any(
        k.startswith(("clip.", "mmproj.")) or k.startswith(f"{arch}.vision") for k in keys
    )
    kv_list = md.get(f"{arch}.attention.head_count_kv")
    hybrid = (
        arch in _HYBRID_ARCHS
        or any(k.startswith(f"{arch}.ssm.") or k.startswith(f"{arch}.attention.sliding_window") for k in keys)
        or (isinstance(kv_list, list) and len(set(kv_list)) > 1)  # attention-free layers (SSM)
    ) and arch != "phi3"  # phi3's window covers every layer: uniform, not hybrid
    return ModelInfo(
        path=str(p),
        format="gguf",
        architecture=arch,
        quantization=quant,
        bits_per_weight=_bpw(nbytes, params),
        parameters=params,
        active_parameters=_active(params, sum(h.expert_parameters for h in headers), experts, used),
        weights_bytes=nbytes,
        layers=av("block_count"),
        hidden_size=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        context_length=av("context_length"),
        vocab_size=vocab,
        experts=experts,
        experts_per_token=used,
        multimodal=multimodal,
        hybrid_attention=hybrid,
        files=tuple(str(q) for q in parts),
        estimated=estimated,
    )


def _lazy_enough(h: GGUFHeader) -> bool:
    """Whether a lazy read holds what inspection takes from the file; if not, it is read whole."""
    if h.unread is None:
        return True
    if h.architecture is None or "tokenizer.ggml.tokens" not in h.array_lengths:
        return False
    if any(_int(h.arch_value(key)) is None for key in _LAZY_NEEDS):
        return False  # the <arch>.* keys come after the vocabulary: nothing can be taken as absent
    if h.tensors_read:
        return True
    # no tensor infos: the size of the weights is bounded by the file's, the parameters follow from
    # the file type's bits per weight, and a MoE's active parameters need the tensor names
    return _file_type_bits(h.metadata) is not None and f"{h.architecture}.expert_count" not in h.metadata


def _file_type_name(md: dict[str, Any]) -> str | None:
    ftype = _int(md.get("general.file_type"))
    return None if ftype is None else GGUF_FILE_TYPES.get(ftype & ~_FTYPE_GUESSED)


def _file_type_bits(md: dict[str, Any]) -> float | None:
    """The usual bits per weight of the file type, scales included (the planner's table)."""
    return bits_per_weight(_file_type_name(md))


# ---- Hugging Face directories -----------------------------------------------------------------

# safetensors dtype -> the name unquantized weights go by
_DTYPE_NAMES = {
    "BF16": "bf16", "F16": "f16", "F32": "f32", "F64": "f64", "F8_E4M3": "fp8", "F8_E5M2": "fp8",
    "bfloat16": "bf16", "float16": "f16", "half": "f16", "float32": "f32", "float": "f32",
    "float64": "f64",
}  # fmt: skip
# bytes per element of the safetensors dtypes whose size is fixed (safetensors itself checks each
# tensor's byte span against its shape; sub-byte and newer dtypes are not checked here)
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
    "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip
# tensors that hold quantization scales, zeros or permutations rather than weights
_AUX_SUFFIXES = (
    ".scales", ".qzeros", ".g_idx", ".biases", ".q_scale", ".q_scale_max", ".q_groups",
    ".q_invperm", ".q_perm", ".weight_scale", ".weight_scale_inv", ".input_scale",
    ".weight_zero_point", ".weight_global_scale", ".input_global_scale", ".weight_shape",
    ".SCB", ".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", "_scales",
    ".quant_state.bitsandbytes__nf4", ".quant_state.bitsandbytes__fp4", ".k_scale", ".v_scale",
    ".suh", ".svh", ".su", ".sv",
)  # fmt: skip
_EXL2_MARKERS = (".q_weight", ".q_scale", ".q_groups", ".q_invperm")
_EXL3_MARKERS = (".trellis", ".suh", ".svh")
_HYBRID_KEYS = (
    "attn_layer_period", "attn_layer_indices", "hybrid_override_pattern", "layers_block_type",
    "full_attn_idxs", "sliding_window_pattern", "hybrid_layer_ids", "full_attention_interval",
    "linear_attn_config",
)  # fmt: skip
_HYBRID_MODEL_TYPES = {
    "gemma2", "gemma3", "gemma3_text", "gemma3n", "cohere2", "jamba", "zamba", "zamba2", "bamba",
    "falcon_h1", "nemotron_h", "granitemoehybrid", "qwen3_next", "lfm2", "gpt_oss", "llama4",
}  # fmt: skip
_MULTIMODAL_KEYS = (
    "vision_config", "audio_config", "vision_tower", "mm_vision_tower", "vision_encoder",
    "image_token_index", "image_token_id", "mm_projector_type", "visual",
)  # fmt: skip


@dataclass
class _Tensors:
    """What the safetensors headers of a model add up to."""

    files: list[Path]
    parameters: int = 0
    unknown_packing: bool = False  # a packed tensor whose bits the config does not give
    nbytes: int = 0
    expert_parameters: int = 0
    dtype_elements: dict[str, int] = field(default_factory=dict)
    names_exl2: bool = False
    names_exl3: bool = False


def _inspect_hf(
    d: Path, *, files: list[Path] | None = None, config: dict[str, Any] | None = None
) -> ModelInfo:
    if config is None:
        config = _load_json(d / "config.json", _MAX_CONFIG_BYTES)
    text = next(
        (
            v
            for v in (config.get(k) for k in ("text_config", "llm_config", "language_config"))
            if isinstance(v, dict)
        ),
        {},
    )

    def get(*keys: str) -> int | None:
        for src in (config, text):
            for k in keys:
                v = _int(src.get(k))
                if v is not None:
                    return v
        return None

    fmt = _format_of_config(config)
    quant, bits, group = _quantization(config, fmt)
    weights = _read_tensors(d, files if files is not None else _safetensors_files(d), fmt, bits)
    if fmt == "safetensors" and (weights.names_exl2 or weights.names_exl3):
        fmt = "exl2" if weights.names_exl2 else "exl3"
        q = config.get("quantization_config")
        bits = _num(q.get("bits")) if isinstance(q, dict) else None
        extra = config.get(fmt)
        if bits is None and isinstance(extra, dict):
            bits = _num(extra.get("bits"))
        quant = f"{fmt}-{bits:g}bit" if bits else fmt
        weights = _read_tensors(d, weights.files, fmt, bits)
    if quant is None and weights.dtype_elements:
        dominant = max(weights.dtype_elements, key=lambda t: weights.dtype_elements[t])
        quant = _DTYPE_NAMES.get(dominant, dominant.lower())
    if quant is None:
        dtype = config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype")
        quant = _DTYPE_NAMES.get(dtype) if isinstance(dtype, str) else None
    params = weights.parameters if weights.files and not weights.unknown_packing else None
    nbytes = weights.nbytes if weights.files else None

    heads, hidden = get("num_attention_heads", "n_head", "num_heads"), get("hidden_size", "n_embd", "d_model")
    kv_heads = get("num_key_value_heads", "num_kv_heads", "n_head_kv")
    if kv_heads is None and config.get("multi_query") is True:
        kv_heads = 1
    kv_heads = kv_heads or heads
    experts = get("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    used = get("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k_experts")
    model_type, text_type = (
        v if isinstance(v, str) else None for v in (config.get("model_type"), text.get("model_type"))
    )
    listed = config.get("architectures")
    archs = [a for a in listed[:16] if isinstance(a, str)] if isinstance(listed, list) else []
    layer_types = config.get("layer_types") or text.get("layer_types")
    multimodal = any(k in config for k in _MULTIMODAL_KEYS) or any(
        ("ForConditionalGeneration" in a and text) or "Vision" in a or "VL" in a or "Llava" in a
        for a in archs
    )
    hybrid = (
        (
            isinstance(layer_types, list)
            and len({t for t in layer_types[:_SMALL_ARRAY] if isinstance(t, str)}) > 1
        )
        or any(k in config or k in text for k in _HYBRID_KEYS)
        or model_type in _HYBRID_MODEL_TYPES
        or text_type in _HYBRID_MODEL_TYPES
    )
    return ModelInfo(
        path=str(d),
        format=fmt,
        architecture=model_type or (archs[0] if archs else None),
        quantization=quant,
        bits_per_weight=_bpw(nbytes, params),
        parameters=params,
        active_parameters=_active(params, weights.expert_parameters, experts, used),
        weights_bytes=nbytes,
        layers=get("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
        hidden_size=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=get("head_dim") or (hidden // heads if hidden and heads else None),
        context_length=get("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"),
        vocab_size=get("vocab_size", "padded_vocab_size"),
        experts=experts,
        experts_per_token=used,
        multimodal=multimodal,
        hybrid_attention=hybrid,
        files=tuple(str(f) for f in weights.files),
        group_size=group,
    )


def _quantization(config: dict[str, Any], fmt: str) -> tuple[str | None, float | None, int | None]:
    """(name, bits, group size) from quantization_config or MLX's quantization; Nones if plain."""
    if fmt == "mlx":
        q = config["quantization"]
        bits, group = _num(q.get("bits")), _int(q.get("group_size"))
        return (f"mlx-{bits:g}bit" if bits else "mlx"), bits, group
    q = config.get("quantization_config")
    if fmt == "safetensors" or not isinstance(q, dict):
        return None, None, None
    bits = _num(q.get("bits") if "bits" in q else q.get("w_bit"))
    group = _int(q.get("group_size") if "group_size" in q else q.get("q_group_size"))
    if fmt == "fp8":
        return "fp8", 8.0, None
    if fmt == "mxfp4":
        return "mxfp4", 4.0, 32
    if fmt == "bitsandbytes":
        bits = 4.0 if q.get("load_in_4bit") else 8.0 if q.get("load_in_8bit") else bits
    if fmt == "compressed-tensors":
        groups = q.get("config_groups")
        for g in groups.values() if isinstance(groups, dict) else ():
            w = g.get("weights") if isinstance(g, dict) else None
            if isinstance(w, dict):
                bits = _num(w.get("num_bits")) or bits
                group = _int(w.get("group_size")) or group
                break
    return (f"{fmt}-{bits:g}bit" if bits else fmt), bits, group


def _safetensors_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if _kind(index) == "file":
        weight_map = _load_json(index, _MAX_INDEX_BYTES).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelFormatError(f"{str(index)!r} has no weight_map object")
        names = sorted({v for v in weight_map.values() if isinstance(v, str)})
        if len(names) > _MAX_SHARDS:
            raise ModelFormatError(f"{str(index)!r} names {len(names)} shards (corrupt file)")
        files = []
        for name in names:
            if Path(name).name != name or name in ("", ".", ".."):
                raise ModelFormatError(f"{str(index)!r} names a shard outside its directory: {name!r}")
            if _kind(d / name) != "file":
                raise ModelFormatError(
                    f"{str(index)!r} names the shard {name!r}, which is missing: download it again"
                )
            files.append(d / name)
        return files
    files = _listing(d, ".safetensors")
    if len(files) > 1:  # Mistral repos ship the same weights twice
        files = [f for f in files if not f.name.startswith("consolidated")] or files
    if len(files) > _MAX_SHARDS:
        raise ModelFormatError(f"{str(d)!r} holds {len(files)} safetensors files")
    return files


def _read_tensors(d: Path, files: list[Path], fmt: str, bits: float | None) -> _Tensors:
    out = _Tensors(files)
    for path in files:
        for name, dtype, count, nbytes in _safetensors_header(path):
            out.nbytes += nbytes
            if name.endswith(_EXL2_MARKERS):
                out.names_exl2 = True
            elif name.endswith(_EXL3_MARKERS):
                out.names_exl3 = True
            if name.endswith(_AUX_SUFFIXES):
                continue
            elements = _weights_in(name, dtype, count, fmt, bits)
            if elements is None:
                out.unknown_packing = True
                continue
            if elements == count:
                out.dtype_elements[dtype] = out.dtype_elements.get(dtype, 0) + elements
            out.parameters += elements
            if ".experts." in name:
                out.expert_parameters += elements
    return out


def _weights_in(name: str, dtype: str, count: int, fmt: str, bits: float | None) -> int | None:
    """How many weights a tensor of ``count`` stored elements holds; None if its packing is unknown."""
    if name.endswith((".qweight", ".weight_packed", ".q_weight", ".trellis")) or (
        fmt == "mlx" and dtype == "U32"
    ):  # int32 words holding 32/bits weights each
        return int(count * 32 / bits) if bits else None
    if dtype == "U8" and (name.endswith("_blocks") or (fmt == "bitsandbytes" and bits == 4)):
        return count * 2  # mxfp4 and bitsandbytes 4-bit: two weights a byte
    return count


def _safetensors_header(path: Path) -> list[tuple[str, str, int, int]]:
    """(name, dtype, elements, bytes) per tensor, from the 8-byte length and the JSON header.

    Every shape element and offset must be a plain non-negative integer (not a bool, a float or a
    list) and every product bounded, checked before it is used: ``[[1], 100000000]`` would
    otherwise build a list of 10^8 items, ``[[1], 2**40]`` exhaust memory."""
    with _open(path) as f:
        size = os.fstat(f.fileno()).st_size
        raw = _read(f, 8, path)
        if len(raw) != 8:
            raise ModelFormatError(f"{str(path)!r} is truncated: no safetensors header; download it again")
        n = int.from_bytes(raw, "little")
        if n > _MAX_SAFETENSORS_HEADER or n > size - 8:
            raise ModelFormatError(
                f"{str(path)!r}: safetensors header length {n} is implausible for a file of "
                f"{size} bytes (corrupt or hostile file)"
            )
        data = _read(f, n, path)
    if len(data) != n:
        raise ModelFormatError(f"{str(path)!r} is truncated inside its safetensors header; download it again")
    header = _parse_json(data, f"{str(path)!r}: the safetensors header", strict=True)
    if not isinstance(header, dict):
        raise ModelFormatError(f"{str(path)!r}: the safetensors header is not a JSON object (corrupt file)")
    payload = size - 8 - n
    out = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        out.append((name, *_safetensors_entry(path, name, t, payload)))
    return out


def _safetensors_entry(path: Path, name: str, t: Any, payload: int) -> tuple[str, int, int]:
    """(dtype, elements, bytes) of one header entry, every field checked."""

    def bad(what: str) -> ModelFormatError:
        return ModelFormatError(
            f"{str(path)!r}: tensor {name[:200]!r} {what} (corrupt or hostile file); download it again"
        )

    if not isinstance(t, dict):
        raise bad(f"is described by a JSON {type(t).__name__}, not an object")
    dtype, shape, offsets = t.get("dtype"), t.get("shape"), t.get("data_offsets")
    if not isinstance(dtype, str) or not 0 < len(dtype) <= 32:
        raise bad("has no dtype name")
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS:
        raise bad(f"has no shape of at most {_MAX_DIMS} dimensions")
    elements = 1
    for i, dim in enumerate(shape):
        if type(dim) is not int or dim < 0:
            raise bad(f"has dimension {i} of type {type(dim).__name__}, not a non-negative integer")
        elements *= dim
        if elements > _MAX_ELEMENTS:
            raise bad("claims more than 2^50 elements")
    if not isinstance(offsets, list) or len(offsets) != 2 or any(type(o) is not int for o in offsets):
        raise bad("has no data_offsets [start, end] of integers")
    start, end = offsets
    if not 0 <= start <= end:
        raise bad(f"has data_offsets [{start}, {end}] that do not make a range")
    if end > payload:
        raise ModelFormatError(
            f"{str(path)!r} is truncated: tensor {name[:200]!r} ends at byte {end} of a "
            f"{payload}-byte payload; download it again"
        )
    width = _DTYPE_BYTES.get(dtype)
    if width is not None and end - start != elements * width:
        raise bad(f"holds {end - start} bytes, but {elements} elements of {dtype} take {elements * width}")
    return dtype, elements, end - start
