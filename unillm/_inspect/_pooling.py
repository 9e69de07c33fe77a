"""What a model says about embedding: its pooling, read from headers only, and so its task.

A sentence-transformers model says it in ``modules.json`` (a ``Pooling`` module, whose folder's
``config.json`` names the mode, and maybe a ``Normalize`` module); a GGUF in
``{arch}.pooling_type`` (llama.cpp's enum: 0 none, 1 mean, 2 cls, 3 last, 4 rank); a reranker
(cross-encoder) is a ``*ForSequenceClassification`` with one label, or a GGUF with rank pooling.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["GGUF_POOLING", "gguf_pooling", "hf_pooling", "task_of"]

#: llama.cpp's ``pooling_type`` values by name (``LLAMA_POOLING_TYPE_*``); "none" keeps every token.
GGUF_POOLING = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}
_BY_NUMBER = {v: k for k, v in GGUF_POOLING.items()}
# sentence-transformers' Pooling config keys, in the order it reads them
_ST_MODES = (
    ("pooling_mode_lasttoken", "last"),
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_mean_tokens", "mean"),
)
_MAX_JSON = 1 << 20


def _json(path: Path) -> Any:
    try:
        if path.stat().st_size > _MAX_JSON:
            return None
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def hf_pooling(d: Path, config: dict[str, Any]) -> str | None:
    """The pooling a Hugging Face directory declares: its sentence-transformers Pooling module's
    mode, "rank" for a one-label sequence classifier, else None (a generative model says none)."""
    modules = _json(d / "modules.json")
    if isinstance(modules, list):
        for m in modules[:16]:
            if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling"):
                folder = m.get("path")
                if not isinstance(folder, str) or ".." in folder:
                    return "mean"
                cfg = _json(d / folder / "config.json")
                if isinstance(cfg, dict):
                    mode = cfg.get("pooling_mode")
                    if mode in ("mean", "cls", "lasttoken"):
                        return "last" if mode == "lasttoken" else mode
                    for key, name in _ST_MODES:
                        if cfg.get(key) is True:
                            return name
                return "mean"  # sentence-transformers' own default
    archs = config.get("architectures")
    classifier = isinstance(archs, list) and any(
        isinstance(a, str) and a.endswith("ForSequenceClassification") for a in archs
    )
    if classifier:
        labels = config.get("num_labels")
        id2label = config.get("id2label")
        n = labels if isinstance(labels, int) else len(id2label) if isinstance(id2label, dict) else 1
        if n == 1:
            return "rank"
    return None


def gguf_pooling(metadata: dict[str, Any], arch: str | None) -> str | None:
    """The pooling a GGUF declares (``{arch}.pooling_type``), None when it declares none."""
    value = metadata.get(f"{arch}.pooling_type")
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    name = _BY_NUMBER.get(value)
    return None if name in (None, "none") else name


def task_of(pooling: str | None) -> str:
    """What a model with this pooling is for: "rerank" (rank), "embed" (mean, cls, last), else "generate"."""
    if pooling == "rank":
        return "rerank"
    return "embed" if pooling in ("mean", "cls", "last") else "generate"
