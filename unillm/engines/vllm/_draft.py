"""The vLLM backend's ``draft_model``/``num_draft_tokens`` options, as vLLM's ``speculative_config``.

vLLM 0.32's CPU build runs ``method="draft_model"`` (measured: the tiny model drafting for itself
gives the same greedy tokens as without a draft). Its acceptance counts are engine-wide (the
scheduler's ``spec_decoding_stats``, summed over every running request), so ``Usage`` leaves
``draft_tokens``/``accepted_draft_tokens`` None rather than guess a request's share.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from unillm import ConfigError
from unillm.backend import hf_dir_in

__all__ = ["speculative_config"]

_DEFAULT_DRAFT_TOKENS = 4  # vLLM has no default for a draft model's num_speculative_tokens


def speculative_config(opts: Any, target: Path) -> dict[str, Any] | None:
    """``speculative_config`` as given, or built from ``draft_model``; both set is refused, as is a
    draft that is not a model directory or whose vocabulary differs from ``target``'s."""
    draft, k = opts.draft_model, opts.num_draft_tokens
    if draft is None:
        if k is not None:
            raise ConfigError("num_draft_tokens is set without draft_model; set both or neither")
        return opts.speculative_config  # type: ignore[no-any-return]
    if opts.speculative_config is not None:
        raise ConfigError("draft_model and speculative_config are both set: set one of them")
    path = hf_dir_in(draft)
    if path is None:
        what = "does not exist" if not Path(draft).expanduser().exists() else "holds no config.json"
        raise ConfigError(f"draft_model {draft!r} {what}: vLLM drafts with an HF model directory")
    mismatch = _vocab_mismatch(path, target)
    if mismatch:
        raise ConfigError(
            f"draft_model {draft!r} has another vocabulary than the model ({mismatch}); a draft "
            "must share the target's tokenizer"
        )
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k or _DEFAULT_DRAFT_TOKENS}


def _vocab_mismatch(draft: Path, target: Path) -> str:
    a, b = _read(draft / "config.json").get("vocab_size"), _read(target / "config.json").get("vocab_size")
    if a != b:
        return f"vocab_size {a}, the model's {b}"
    va, vb = _vocab(draft), _vocab(target)
    if va is not None and vb is not None and va != vb:
        return "tokenizer.json maps tokens differently"
    return ""


def _vocab(model_dir: Path) -> Any:
    model = _read(model_dir / "tokenizer.json").get("model")
    return model.get("vocab") if isinstance(model, dict) else None


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
