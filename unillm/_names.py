"""A model's name on the Hugging Face Hub, as every door takes it: ``org/name``,
``org/name@revision``, ``org/name:QUANT`` and ``org/name@revision:QUANT``.

The grammar lives here, in the vocabulary, because the config reader must tell a name from a
relative path before anything is resolved (a TOML file's relative ``model`` path is read from its
folder; a name is not); ``unillm._hub`` resolves what it names. A string is a name when nothing is
at that path, it has the shape above, and its last part is not a model file's (``x/y.gguf`` is a
missing path, not a repo).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["ModelName", "parse_model_name"]

# A repo id as the hub allows it: letters, digits, ``-``, ``_``, ``.``; no ``--`` or ``..``.
_NAME = re.compile(
    r"(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})"
    r"(?:@(?P<revision>[\w.\-/]{1,200}?))?"
    r"(?::(?P<tag>[A-Za-z0-9][\w.-]{0,63}))?"
)
_FILE_SUFFIXES = (".gguf", ".safetensors", ".json", ".bin", ".toml")


@dataclass(frozen=True)
class ModelName:
    """``repo`` (``org/name``), the ``revision`` asked for (a branch, tag or commit; None: the
    default branch) and the quantization ``tag`` (None: chosen)."""

    repo: str
    revision: str | None = None
    tag: str | None = None

    def __str__(self) -> str:
        return (
            self.repo + (f"@{self.revision}" if self.revision else "") + (f":{self.tag}" if self.tag else "")
        )


def parse_model_name(text: str | os.PathLike[str]) -> ModelName | None:
    """The name ``text`` is, or None when it is a path (something is there, or it has no name's
    shape)."""
    if not isinstance(text, str):
        return None
    m = _NAME.fullmatch(text)
    if m is None or "--" in m["repo"] or ".." in m["repo"]:
        return None
    if m["repo"].lower().endswith(_FILE_SUFFIXES) and not m["tag"]:
        return None
    try:
        if os.path.lexists(os.path.expanduser(text)):
            return None
    except (OSError, ValueError):
        return None
    return ModelName(m["repo"], m["revision"], m["tag"])
