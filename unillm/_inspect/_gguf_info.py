"""A GGUF model (one file or every part of a split set) inspected into a ``ModelInfo``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unillm._errors import ModelFormatError
from unillm._inspect._files import _kind
from unillm._inspect._gguf import read_gguf_header
from unillm._inspect._gguf_reader import _FTYPE_GUESSED, GGML_TYPE_NAMES, GGUF_FILE_TYPES, GGUFHeader
from unillm._inspect._model import ModelInfo, _active, _bpw, _int, bits_per_weight
from unillm._inspect._paths import SPLIT_GGUF
from unillm._inspect._pooling import gguf_pooling

# ---- GGUF ------------------------------------------------------------------------------------

_HYBRID_ARCHS = {
    "gemma2", "gemma3", "gemma3n", "cohere2", "jamba", "falcon-h1", "nemotron_h", "granitehybrid",
    "qwen3next", "lfm2", "plamo2", "mamba", "mamba2", "rwkv6", "rwkv7", "gpt-oss", "llama4",
}  # fmt: skip
_MULTIMODAL_ARCHS = {"clip", "mllama", "qwen2vl", "qwen25vl", "qwen3vl", "qwen3vlmoe"}
_MAX_SPLITS = 1024


def _split_stem(p: Path) -> str:
    m = SPLIT_GGUF.fullmatch(p.name)
    return m["stem"] if m else p.name


def _gguf_parts(p: Path) -> list[Path]:
    m = SPLIT_GGUF.fullmatch(p.name)
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
    return gguf_info(str(p), [str(q) for q in parts], headers)


def gguf_info(p: str, parts: list[str], headers: list[GGUFHeader]) -> ModelInfo:
    """The ``ModelInfo`` of the GGUF model at ``p`` from the headers of its ``parts`` (one file,
    or a split set first part first), however they were read: from disk, or by range requests
    before a download (``read_gguf_stream``; each read lazily when ``lazy_enough`` says it holds
    what inspection needs)."""
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
        files=tuple(parts),
        estimated=estimated,
        pooling=gguf_pooling(md, arch),
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


lazy_enough = _lazy_enough  # for a header read elsewhere (``gguf_info``'s callers)
