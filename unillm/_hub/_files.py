"""Which files of a repo a name means: its GGUF models (a split set counted as one), the
quantization each is in, the one a tag names, and the default when none is named.

Pure functions over file names and sizes: what the hub lists and what the cache holds are read
by the same rules.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from unillm._errors import QuantNotFound
from unillm._inspect import bits_per_weight
from unillm._inspect._paths import SPLIT_GGUF

__all__ = ["DEFAULT_TAGS", "GgufFile", "gguf_files", "hf_files", "pick_gguf", "quant_of"]

#: llama.cpp's ``-hf repo`` rule when no tag is given: the first of these a repo has, else its first GGUF
DEFAULT_TAGS = ("Q4_K_M", "Q8_0")

# A quantization in a file name: Q4_K_M, IQ4_XS, Q8_0, TQ1_0, F16, BF16, F32, MXFP4 (and UD-Q4_K_XL)
_QUANT = re.compile(
    r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q\d(?:_[A-Z0-9]{1,4}){0,2}|TQ\d_\d|BF16|F16|F32|FP16|FP32|MXFP4))(?![A-Za-z0-9])",
    re.IGNORECASE,
)
# Weights an HF-format download leaves out when safetensors are there (the same weights again)
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".onnx_data", ".ot", ".gguf")


@dataclass(frozen=True)
class GgufFile:
    """One GGUF model in a repo: its ``parts`` (one path, or a split set first part first), their
    total ``size`` in bytes and the ``quant`` its name says (None when it says none)."""

    parts: tuple[str, ...]
    size: int
    quant: str | None

    @property
    def path(self) -> str:
        """The path a loader opens: the file, or a split set's first part."""
        return self.parts[0]

    @property
    def bits(self) -> float | None:
        """Bits per weight of its quantization (the planner's table), when known."""
        return bits_per_weight(self.quant) if self.quant else None


def quant_of(path: str) -> str | None:
    """The quantization a GGUF file's name says (upper case, ``Q4_K_M``), or None."""
    name = path.rsplit("/", 1)[-1]
    m = SPLIT_GGUF.fullmatch(name)
    stem = m["stem"] if m else name.removesuffix(".gguf")
    found = _QUANT.findall(stem)
    return found[-1].upper() if found else None


def gguf_files(sizes: Mapping[str, int]) -> list[GgufFile]:
    """The GGUF models among ``sizes`` (path -> bytes), in path order: a split set's parts count as
    one model; vision projectors (``mmproj*``) and incomplete split sets are left out."""
    singles: dict[str, list[str]] = {}
    for path in sorted(sizes):
        name = path.rsplit("/", 1)[-1]
        if not name.lower().endswith(".gguf") or name.lower().startswith("mmproj"):
            continue
        m = SPLIT_GGUF.fullmatch(name)
        key = f"{path[: len(path) - len(name)]}{m['stem']}-of-{m['count']}" if m else path
        singles.setdefault(key, []).append(path)
    out = []
    for paths in singles.values():
        m = SPLIT_GGUF.fullmatch(paths[0].rsplit("/", 1)[-1])
        if m and (int(m["no"]) != 1 or len(paths) != int(m["count"])):
            continue
        out.append(GgufFile(tuple(paths), sum(sizes[p] for p in paths), quant_of(paths[0])))
    return out


def pick_gguf(repo: str, files: list[GgufFile], tag: str | None) -> GgufFile:
    """The GGUF ``tag`` names (case-insensitive, its quantization or else a part of its name), or
    with no tag llama.cpp's default: Q4_K_M, else Q8_0, else the first. Raises ``QuantNotFound``
    listing the repo's quantizations."""
    if tag is not None:
        want = tag.upper()
        exact = [f for f in files if f.quant == want]
        named = exact or [f for f in files if want in f.path.rsplit("/", 1)[-1].upper()]
        if named:
            return named[0]
        raise QuantNotFound(repo, tag, tags(files))
    if not files:
        raise QuantNotFound(repo, "GGUF", [])
    for default in DEFAULT_TAGS:
        for f in files:
            if f.quant == default:
                return f
    return files[0]


def tags(files: list[GgufFile]) -> list[str]:
    """The quantizations ``files`` are in, each once, in file order (a file that names none: its path)."""
    return list(dict.fromkeys(f.quant or f.path for f in files))


def hf_files(paths: list[str]) -> list[str]:
    """What an HF-format model needs of a repo's ``paths``: everything but GGUF files and, when
    safetensors are there, the other copies of the weights."""
    safetensors = any(p.endswith(".safetensors") for p in paths)
    return [
        p
        for p in paths
        if not p.endswith(".gguf")
        and not (safetensors and p.endswith(_OTHER_WEIGHTS))
        and not p.startswith(".")
    ]
