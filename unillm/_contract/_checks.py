"""The checks every backend makes the same way: on what users hand in (text must be text, token
ids must be ints of the vocabulary, a prompt must fit the context; ``Engine`` applies the first two
at its edge), whether an engine's packages are installed (without importing them), and how many
leading tokens a request shares with what a cache holds."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from unillm._errors import ConfigError, ContextLengthExceeded
from unillm._types import Availability

__all__ = ["check_prompt", "check_text", "check_token_ids", "installed", "shared_prefix"]


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


class _Tokens(Protocol):
    """A list of token ids, or the numpy array an engine keeps them in."""

    def __len__(self) -> int: ...
    def __getitem__(self, i: int, /) -> Any: ...


def installed(*packages: tuple[str, str], hint: str) -> Availability:
    """Available when every ``(module, distribution)`` is importable, without importing it; the
    version is the distribution's, or each one named when there are several."""
    versions = []
    for module, dist in packages:
        if importlib.util.find_spec(module) is None:
            return Availability(False, f"{dist} is not installed", hint)
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions.append((dist, importlib.metadata.version(dist)))
    if not versions:
        return Availability(True)
    if len(packages) == 1:
        return Availability(True, version=versions[0][1])
    # several packages (mlx and mlx-lm): name each, or "0.32.2" reads as the wrong one's
    return Availability(True, version=", ".join(f"{d} {v}" for d, v in versions))


def check_prompt(ids: Sequence[int], context: int | None, max_tokens: int) -> None:
    """Refuse an empty prompt, and one that fills ``context`` (None: the cache rotates)."""
    if not ids:
        raise ConfigError("the prompt is empty: give at least one token")
    if context is not None and len(ids) >= context:
        raise ContextLengthExceeded(len(ids), context, max_tokens)


def shared_prefix(held: _Tokens, ids: Sequence[int]) -> int:
    """How many leading tokens ``ids`` shares with what a cache holds, leaving at least one token
    of ``ids`` to evaluate (so the next token's logits are fresh)."""
    limit = min(len(held), len(ids) - 1)
    n = 0
    while n < limit and held[n] == ids[n]:
        n += 1
    return n
