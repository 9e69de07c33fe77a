"""The checks every backend needs the same way on what users hand in: text must be text, token
ids must be ints of the vocabulary. ``Engine`` applies them at its edge; backends may call them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from unillm._errors import ConfigError

__all__ = ["check_text", "check_token_ids"]


def check_text(text: Any, what: str = "the prompt is") -> str:
    """``text`` as a str that encodes (no lone surrogates); ConfigError otherwise."""
    if not isinstance(text, str):
        raise ConfigError(f"{what} a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(
            f"the text holds a lone surrogate {text[exc.start]!r} at position {exc.start}, which is "
            "not valid Unicode; decode your input with errors='replace' (or fix its source)"
        ) from None
    return text


def check_token_ids(ids: Any, vocab: int | None) -> list[int]:
    """``ids`` as a list of ints inside the vocabulary (when known); ConfigError otherwise.

    Floats, booleans, strings and bytes are refused rather than coerced: ``int(2.7)`` would
    silently pick another token, and bytes iterate as numbers.
    """
    if isinstance(ids, (str, bytes, bytearray, memoryview, Mapping)) or not hasattr(ids, "__iter__"):
        raise ConfigError(
            f"token ids must be a sequence of ints, got {type(ids).__name__}; pass text as a str"
        )
    out: list[int] = []
    for t in ids:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise ConfigError(f"token ids must be ints, got {t!r} ({type(t).__name__})")
        out.append(t.__index__())
    if vocab is not None:
        bad = [t for t in out if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
    return out
