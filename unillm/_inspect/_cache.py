"""Where a model is: a local path, or a Hugging Face repo id resolved through the local cache only.

``resolve_model_dir`` and ``read_model_config`` are the resolution and the ``config.json`` read
``inspect_model`` does, for a backend that needs a model directory and its config: every path is
looked at as inspection looks at it (a FIFO or device refused without blocking, an unreadable or
too-long path reported) and the config read within inspection's bounds.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from unillm._errors import ModelFormatError, ModelNotFound
from unillm._inspect._files import _expand, _kind
from unillm._inspect._json import _MAX_CONFIG_BYTES, _load_json

__all__ = ["read_model_config", "resolve_model_dir"]

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


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


def resolve_model_dir(path_or_id: str | Path) -> Path:
    """The local directory of a model, resolved as ``inspect_model`` resolves ``path_or_id``.

    ``path_or_id`` is a directory (``~`` expanded) or a Hugging Face repo id (``owner/name``, a
    ``str``) already in the local cache, never downloaded. Raises ``ModelNotFound`` for a missing
    path or an uncached id (or one named while ``huggingface_hub`` is not installed), and
    ``ModelFormatError`` for a path that is a file, a FIFO or device, or cannot be looked at. The
    directory's contents are not checked: ``read_model_config`` reads its ``config.json``.
    """
    p = _resolve(path_or_id)
    kind = _kind(p)
    if kind is None:  # the hub named a snapshot that is gone
        raise ModelNotFound(str(path_or_id))
    if kind != "dir":
        raise ModelFormatError(
            f"{str(p)!r} is a file, not a model directory: pass a Hugging Face-style model directory "
            "(config.json, *.safetensors, tokenizer) or the repo id of one in the local Hugging Face cache"
        )
    return p


def read_model_config(model_dir: str | Path) -> dict[str, Any]:
    """The ``config.json`` of ``model_dir`` as a dict, read as ``inspect_model`` reads it.

    Only a regular file is opened (a FIFO or device is refused without blocking); it must hold at
    most 16 MiB of UTF-8 JSON whose numbers and nesting stay within bounds, and be an object.
    NaN and Infinity are accepted, as real configs hold them. Nothing of what the object holds is
    checked (``model_type`` and the like are the caller's). Raises ``ModelFormatError`` when the
    directory has no ``config.json`` or it cannot be read or is not such an object.
    """
    d = _expand(model_dir)
    config = d / "config.json"
    if _kind(config) != "file":
        raise ModelFormatError(f"{str(d)!r} has no config.json: not a Hugging Face-style model directory")
    return _load_json(config, _MAX_CONFIG_BYTES)
