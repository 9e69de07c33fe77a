"""Safetensors headers (and a sharded model's index) added up into weights, bytes and dtypes."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from unillm._errors import ModelFormatError
from unillm._inspect._files import _kind, _listing, _open, _read
from unillm._inspect._gguf_reader import _MAX_DIMS, _MAX_ELEMENTS
from unillm._inspect._json import _load_json, _parse_json

_MAX_SHARDS = 10_000
_MAX_INDEX_BYTES = 64 * 1024 * 1024
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024
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


def _read_tensors(
    d: Path,
    files: list[Path],
    fmt: str,
    bits: float | None,
    headers: dict[str, list[tuple[str, str, int, int]]] | None = None,
) -> _Tensors:
    out = _Tensors(files)
    for path in files:
        entries = headers[str(path)] if headers is not None else _safetensors_header(path)
        for name, dtype, count, nbytes in entries:
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
        return read_safetensors_stream(f, str(path), os.fstat(f.fileno()).st_size)


def read_safetensors_stream(f: BinaryIO, path: str, size: int) -> list[tuple[str, str, int, int]]:
    """``_safetensors_header`` of an open binary stream of ``size`` bytes (``read``): a file on
    the hub read by range requests, ``path`` what errors call it. The same caps and checks."""
    raw = _read(f, 8, path)  # type: ignore[arg-type]
    if len(raw) != 8:
        raise ModelFormatError(f"{str(path)!r} is truncated: no safetensors header; download it again")
    n = int.from_bytes(raw, "little")
    if n > _MAX_SAFETENSORS_HEADER or n > size - 8:
        raise ModelFormatError(
            f"{str(path)!r}: safetensors header length {n} is implausible for a file of "
            f"{size} bytes (corrupt or hostile file)"
        )
    data = _read(f, n, path)  # type: ignore[arg-type]
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


def _safetensors_entry(path: Path | str, name: str, t: Any, payload: int) -> tuple[str, int, int]:
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
