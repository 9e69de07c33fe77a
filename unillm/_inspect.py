"""What format a model path holds, read from headers only (never the weights).

This is the small first step: enough to route a path to a backend. Full inspection (parameters,
layers, KV heads, quantization details) grows here.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from unillm._errors import ModelFormatError, ModelNotFound

__all__ = ["GGUFHeader", "detect_format", "read_gguf_header"]

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


def detect_format(path: str | Path) -> str:
    """The model format at ``path``: ``gguf``, ``safetensors`` (plain HF), ``mlx``, ``awq``, ...

    Raises ``ModelNotFound`` for a missing path and ``ModelFormatError`` for anything unreadable.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelNotFound(str(path))
    if p.is_file():
        return _file_format(p)
    config = p / "config.json"
    if config.is_file():
        return _config_format(config)
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return _file_format(ggufs[0])
    raise ModelFormatError(
        f"{str(p)!r} is a directory without config.json"
        + (f" and with {len(ggufs)} .gguf files: pass one of them" if ggufs else "")
        + "; pass a .gguf file or a Hugging Face-style model directory"
    )


def _file_format(p: Path) -> str:
    with p.open("rb") as f:
        head = f.read(8)
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
    if config.stat().st_size > _MAX_CONFIG_BYTES:
        raise ModelFormatError(f"{str(config)!r} is implausibly large for a config.json")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelFormatError(f"{str(config)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelFormatError(f"{str(config)!r} is not a JSON object")
    quant = data.get("quantization_config")
    if isinstance(quant, dict):
        method = str(quant.get("quant_method", "")).lower()
        if method in _QUANT_METHODS:
            return _QUANT_METHODS[method]
    if isinstance(data.get("quantization"), dict):
        return "mlx"
    return "safetensors"


# ---- GGUF header ----------------------------------------------------------------------------
# Layout (little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata count, then
# the metadata key/values, the tensor infos, padding to `general.alignment`, and the tensor data.
# Every length and count read here is bounded before anything is allocated: the file is untrusted.


_MAX_STRING = 1 << 24  # a chat template or a merge list entry is far smaller
_MAX_ARRAY = 1 << 24  # vocabularies are ~256k entries
_MAX_KV = 1 << 16
_MAX_TENSORS = 1 << 20
_MAX_DIMS = 8
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
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
}


@dataclass
class GGUFHeader:
    """What a GGUF file says about itself. Large arrays (the vocabulary) are kept as lengths only
    unless asked for, so reading the header costs the same for a 40 MB and a 40 GB file."""

    version: int
    metadata: dict[str, Any]
    tensor_count: int
    data_offset: int
    data_end: int | None  # where the last tensor ends; None when a tensor type is unknown
    file_size: int
    array_lengths: dict[str, int] = field(default_factory=dict)

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None

    def arch_value(self, key: str) -> Any:
        """``<architecture>.<key>``, e.g. ``arch_value("block_count")``."""
        return self.metadata.get(f"{self.architecture}.{key}")

    @property
    def truncated(self) -> bool:
        return self.data_end is not None and self.data_end > self.file_size


class _Reader:
    def __init__(self, f: BinaryIO, path: str, size: int) -> None:
        self.f, self.path, self.size = f, path, size

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise ModelFormatError(f"{self.path!r}: GGUF header ends early (truncated file)")
        return data

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > _MAX_STRING or n > self.size:
            raise ModelFormatError(f"{self.path!r}: GGUF string length {n} is implausible (corrupt file)")
        return self.read(n).decode("utf-8", errors="replace")

    def value(self, vtype: int, keep_arrays: bool) -> tuple[Any, int | None]:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype]), None
        if vtype == _STRING:
            return self.string(), None
        if vtype == _ARRAY:
            etype, n = self.unpack("<I"), self.unpack("<Q")
            if n > _MAX_ARRAY or n > self.size:
                raise ModelFormatError(
                    f"{self.path!r}: GGUF array of {n} items is implausible (corrupt file)"
                )
            if etype == _ARRAY:
                raise ModelFormatError(f"{self.path!r}: nested GGUF arrays are not supported")
            if etype in _SCALARS and not keep_arrays:
                self.f.seek(n * struct.calcsize(_SCALARS[etype]), 1)
                return None, n
            items = [self.value(etype, keep_arrays)[0] for _ in range(n)]
            return (items if keep_arrays else None), n
        raise ModelFormatError(f"{self.path!r}: unknown GGUF value type {vtype} (corrupt file)")


def read_gguf_header(path: str | Path, *, keep_arrays: bool = False) -> GGUFHeader:
    """Parse a GGUF file's header (metadata and tensor infos), never its tensor data.

    Raises ``ModelFormatError`` for a wrong magic, an unsupported version, or any length or count
    that cannot be right; large arrays are skipped (their lengths kept) unless ``keep_arrays``.
    """
    p = Path(path)
    if not p.is_file():
        raise ModelNotFound(str(path))
    size = p.stat().st_size
    with p.open("rb") as f:
        r = _Reader(f, str(p), size)
        magic = r.read(4)
        if magic != GGUF_MAGIC:
            raise ModelFormatError(f"{str(p)!r} is not a GGUF file (magic {magic!r}, want b'GGUF')")
        version = r.unpack("<I")
        if version not in (2, 3):
            raise ModelFormatError(f"{str(p)!r}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
        if n_tensors > _MAX_TENSORS or n_kv > _MAX_KV:
            raise ModelFormatError(
                f"{str(p)!r}: GGUF claims {n_tensors} tensors and {n_kv} keys (corrupt file)"
            )
        metadata: dict[str, Any] = {}
        lengths: dict[str, int] = {}
        for _ in range(n_kv):
            key = r.string()
            value, n = r.value(r.unpack("<I"), keep_arrays)
            if n is not None:
                lengths[key] = n
            metadata[key] = value
        end: int | None = 0
        for _ in range(n_tensors):
            r.string()
            n_dims = r.unpack("<I")
            if n_dims > _MAX_DIMS:
                raise ModelFormatError(f"{str(p)!r}: a tensor with {n_dims} dimensions (corrupt file)")
            elements = 1
            for _ in range(n_dims):
                elements *= r.unpack("<Q")
            ttype, offset = r.unpack("<I"), r.unpack("<Q")
            block = GGML_BLOCKS.get(ttype)
            if block is None or end is None:
                end = None
            else:
                end = max(end, offset + elements // block[0] * block[1])
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0:
            alignment = 32
        pos = f.tell()
        data_offset = (pos + alignment - 1) // alignment * alignment
    return GGUFHeader(
        version,
        metadata,
        n_tensors,
        data_offset,
        None if end is None else data_offset + end,
        size,
        lengths,
    )
