"""Which file or directory of a model a backend reads.

A model can be given as the set of its formats: a directory holding an HF directory and a GGUF of
the same weights (as ``unillm.testing``'s builders write), so that ``UNILLM_BACKEND`` alone moves
an application between llama.cpp and MLX or vLLM. Each backend takes the one it reads:

- ``gguf_in(path)``: the path itself when it is a file; in a directory, its one GGUF (or the first
  part of its one split GGUF);
- ``hf_dir_in(path)``: the directory itself when it holds ``config.json``; else its one
  sub-directory that does.

Both return None when there is no single answer; the backend then reports the path as given.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["gguf_in", "hf_dir_in", "model_formats"]

#: A split GGUF file's name: ``stem-0000N-of-0000M.gguf`` (llama.cpp's gguf-split writes it)
SPLIT_GGUF = re.compile(r"(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
_MAX_ENTRIES = 10_000  # a model directory lists a few dozen files; do not walk a whole disk


def _entries(d: Path) -> list[Path]:
    out: list[Path] = []
    try:
        for i, p in enumerate(d.iterdir()):
            if i >= _MAX_ENTRIES:
                break
            out.append(p)
    except OSError:
        return []
    return sorted(out)


def gguf_in(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names or holds, or None when it holds none or several models."""
    p = Path(path).expanduser()
    try:
        if not p.is_dir():
            return p if p.suffix == ".gguf" else None
    except OSError:
        return None
    ggufs = [e for e in _entries(p) if e.suffix == ".gguf" and is_file(e)]
    whole = [e for e in ggufs if not SPLIT_GGUF.fullmatch(e.name)]
    firsts = [e for e in ggufs if (m := SPLIT_GGUF.fullmatch(e.name)) and int(m["no"]) == 1]
    models = whole + firsts
    return models[0] if len(models) == 1 else None


def hf_dir_in(path: str | Path) -> Path | None:
    """The HF model directory ``path`` is or holds (``config.json`` inside), or None."""
    p = Path(path).expanduser()
    try:
        if not p.is_dir():
            return None
        if (p / "config.json").is_file():
            return p
    except OSError:
        return None
    subs = [e for e in _entries(p) if is_dir(e) and (e / "config.json").is_file()]
    return subs[0] if len(subs) == 1 else None


def model_formats(path: str | Path) -> dict[str, Path]:
    """The formats a model directory holds side by side: ``{"gguf": file, "hf": directory}``,
    only those present. A plain GGUF file or HF directory gives one entry."""
    out: dict[str, Path] = {}
    gguf, hf = gguf_in(path), hf_dir_in(path)
    if gguf is not None and is_file(gguf):
        out["gguf"] = gguf
    if hf is not None:
        out["hf"] = hf
    return out


def is_file(p: Path) -> bool:
    """``p`` is a file; False, not an error, for what cannot be looked at."""
    try:
        return p.is_file()
    except OSError:
        return False


def is_dir(p: Path) -> bool:
    """``p`` is a directory; False, not an error, for what cannot be looked at."""
    try:
        return p.is_dir()
    except OSError:
        return False


def exists(p: Path) -> bool:
    """Something is at ``p`` (a dangling link counts); True for what cannot be looked at, which
    is not "not found"."""
    try:
        return p.exists() or p.is_symlink()
    except OSError:
        return True
