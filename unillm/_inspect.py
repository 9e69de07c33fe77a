"""What a model is, read from headers only (never the weights).

``detect_format`` routes a path to a backend; ``inspect_model`` reads GGUF metadata and tensor
infos, ``config.json`` and safetensors headers into a ``ModelInfo``. Every file is untrusted: each
length and count is bounded before anything is allocated, and whatever is corrupt or hostile ends
in ``ModelFormatError``. The cost depends on the header, never on the size of the weights.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from dataclasses import replace as _replace
from pathlib import Path
from typing import Any, BinaryIO

from unillm._errors import ModelFormatError, ModelNotFound

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
    anything corrupt, hostile or not a model.
    """
    p = _resolve(path_or_id)
    if p.is_file():
        if p.suffix == ".safetensors":
            if (p.parent / "config.json").is_file():
                return _inspect_hf(p.parent)
            return _inspect_hf(p.parent, files=[p], config={})
        _file_format(p)  # the magic check and its message
        return _inspect_gguf(p)
    if (p / "config.json").is_file():
        return _inspect_hf(p)
    ggufs = sorted(p.glob("*.gguf"))
    models = [g for g in ggufs if not g.name.lower().startswith("mmproj")]
    if models and len({_split_stem(g) for g in models}) == 1:
        info = _inspect_gguf(models[0])
        if len(models) < len(ggufs):  # a vision projector next to the language model
            return _replace(info, multimodal=True)
        return info
    if not ggufs and list(p.glob("*.safetensors")):
        return _inspect_hf(p, config={})
    return ModelInfo(str(p), detect_format(p))  # raises the directory's ModelFormatError


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
    return _format_of_config(_load_json(config, _MAX_CONFIG_BYTES))


def _load_json(path: Path, limit: int) -> dict[str, Any]:
    """A JSON object from an untrusted file: its size bounded, deep nesting a format error."""
    if path.stat().st_size > limit:
        raise ModelFormatError(f"{str(path)!r} is implausibly large for a {path.name}")
    try:
        data = _parse_json(path.read_bytes())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ModelFormatError(f"{str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelFormatError(f"{str(path)!r} is not a JSON object")
    return data


def _parse_json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except RecursionError:
        # json's C scanner recurses once per nesting level; a hostile file nests thousands deep
        raise ValueError("nested too deeply (corrupt or hostile file)") from None


def _format_of_config(data: dict[str, Any]) -> str:
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
_SMALL_ARRAY = 4096  # numeric arrays up to this length are kept (per-layer head counts)
_MAX_ELEMENTS = 1 << 50  # per tensor: ~10^15 weights is beyond any model, so the header lies


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
    parameters: int = 0  # elements over all tensors
    tensor_bytes: int | None = 0  # bytes over all tensors; None when a tensor type is unknown
    expert_parameters: int = 0  # elements of the routed-expert tensors (names with "_exps")
    type_elements: dict[int, int] = field(default_factory=dict)  # ggml type -> elements

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
            if etype in _SCALARS and not keep_arrays and n > _SMALL_ARRAY:
                self.f.seek(n * struct.calcsize(_SCALARS[etype]), 1)
                return None, n
            if etype == _STRING and not keep_arrays:
                self.skip_strings(n)
                return None, n
            items = [self.value(etype, True)[0] for _ in range(n)]
            return (items if keep_arrays or etype in _SCALARS else None), n
        raise ModelFormatError(f"{self.path!r}: unknown GGUF value type {vtype} (corrupt file)")

    def skip_strings(self, n: int) -> None:
        # a vocabulary is ~100k strings: skip them without decoding, one length read each
        read, seek, size = self.f.read, self.f.seek, self.size
        for _ in range(n):
            raw = read(8)
            if len(raw) != 8:
                raise ModelFormatError(f"{self.path!r}: GGUF header ends early (truncated file)")
            length = int.from_bytes(raw, "little")
            if length > _MAX_STRING or length > size:
                raise ModelFormatError(
                    f"{self.path!r}: GGUF string length {length} is implausible (corrupt file)"
                )
            seek(length, 1)
        if self.f.tell() > size:
            raise ModelFormatError(f"{self.path!r}: GGUF header ends early (truncated file)")


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
        if n_tensors * 24 > size:  # a tensor info takes at least 24 bytes
            raise ModelFormatError(
                f"{str(p)!r}: GGUF claims {n_tensors} tensors in {size} bytes (corrupt file)"
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
        parameters = expert_parameters = 0
        nbytes: int | None = 0
        type_elements: dict[int, int] = {}
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.unpack("<I")
            if n_dims > _MAX_DIMS:
                raise ModelFormatError(f"{str(p)!r}: a tensor with {n_dims} dimensions (corrupt file)")
            elements = 1
            for _ in range(n_dims):
                elements *= r.unpack("<Q")
            if elements > _MAX_ELEMENTS:
                raise ModelFormatError(
                    f"{str(p)!r}: tensor {name!r} claims {elements} elements (corrupt file)"
                )
            ttype, offset = r.unpack("<I"), r.unpack("<Q")
            parameters += elements
            if "_exps" in name:
                expert_parameters += elements
            type_elements[ttype] = type_elements.get(ttype, 0) + elements
            block = GGML_BLOCKS.get(ttype)
            if block is None or end is None or nbytes is None:
                end = nbytes = None
            else:
                tensor_bytes = elements // block[0] * block[1]
                nbytes += tensor_bytes
                end = max(end, offset + tensor_bytes)
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
        parameters,
        nbytes,
        expert_parameters,
        type_elements,
    )


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
    p = Path(path_or_id).expanduser()
    if p.exists():
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
    missing = [q.name for q in parts if not q.is_file()]
    if missing:
        raise ModelFormatError(
            f"{str(p)!r} is part of a {count}-part split GGUF but {', '.join(missing[:5])} "
            f"{'is' if len(missing) == 1 else 'are'} missing: download every part into one directory"
        )
    return parts


def _inspect_gguf(p: Path) -> ModelInfo:
    parts = _gguf_parts(p)
    headers = [read_gguf_header(q) for q in parts]
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
    nbytes = None if any(b is None for b in sizes) else sum(b for b in sizes if b is not None)
    type_elements: dict[int, int] = {}
    for h in headers:
        for t, n in h.type_elements.items():
            type_elements[t] = type_elements.get(t, 0) + n
    quant = None
    ftype = _int(md.get("general.file_type"))
    if ftype is not None:
        quant = GGUF_FILE_TYPES.get(ftype & ~_FTYPE_GUESSED)
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
    )


# ---- Hugging Face directories -----------------------------------------------------------------

# safetensors dtype -> the name unquantized weights go by
_DTYPE_NAMES = {
    "BF16": "bf16", "F16": "f16", "F32": "f32", "F64": "f64", "F8_E4M3": "fp8", "F8_E5M2": "fp8",
    "bfloat16": "bf16", "float16": "f16", "half": "f16", "float32": "f32", "float": "f32",
    "float64": "f64",
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
    if index.is_file():
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
            if not (d / name).is_file():
                raise ModelFormatError(
                    f"{str(index)!r} names the shard {name!r}, which is missing: download it again"
                )
            files.append(d / name)
        return files
    files = sorted(d.glob("*.safetensors"))
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
    """(name, dtype, elements, bytes) per tensor, from the 8-byte length and the JSON header."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ModelFormatError(f"{str(path)!r} is truncated: no safetensors header")
        n = int.from_bytes(raw, "little")
        if n > _MAX_SAFETENSORS_HEADER or n > size - 8:
            raise ModelFormatError(
                f"{str(path)!r}: safetensors header length {n} is implausible for a file of "
                f"{size} bytes (corrupt or hostile file)"
            )
        data = f.read(n)
    try:
        header = _parse_json(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelFormatError(f"{str(path)!r}: the safetensors header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ModelFormatError(f"{str(path)!r}: the safetensors header is not a JSON object")
    payload = size - 8 - n
    out = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        bad = f"{str(path)!r}: tensor {name[:200]!r} has a malformed entry (corrupt file)"
        if not isinstance(t, dict):
            raise ModelFormatError(bad)
        dtype, shape, offsets = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        if (
            not isinstance(dtype, str)
            or not isinstance(shape, list)
            or len(shape) > _MAX_DIMS
            or not isinstance(offsets, list)
            or len(offsets) != 2
        ):
            raise ModelFormatError(bad)
        elements = 1
        for dim in shape:
            if _int(dim) is None:
                raise ModelFormatError(bad)
            elements *= dim
        start, end = _int(offsets[0]), _int(offsets[1])
        if start is None or end is None or start > end or elements > _MAX_ELEMENTS:
            raise ModelFormatError(bad)
        if end > payload:
            raise ModelFormatError(
                f"{str(path)!r} is truncated: tensor {name[:200]!r} ends at byte {end} of a "
                f"{payload}-byte payload; download it again"
            )
        out.append((name, dtype, elements, end - start))
    return out
