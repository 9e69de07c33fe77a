"""Small pieces every backend needs the same way: an availability check that imports nothing,
prompt validation, and the shared-prefix count for KV-cache reuse."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Sequence
from typing import Any, Protocol

from unillm._errors import ConfigError, ContextLengthExceeded
from unillm._types import Availability

__all__ = ["check_prompt", "installed", "shared_prefix", "token_ids"]


class _Tokens(Protocol):
    """A list of token ids, or the numpy array an engine keeps them in."""

    def __len__(self) -> int: ...
    def __getitem__(self, i: int, /) -> Any: ...


def installed(*packages: tuple[str, str], hint: str) -> Availability:
    """Available when every ``(module, distribution)`` is importable, without importing it; the
    version reported is the last distribution's."""
    for module, dist in packages:
        if importlib.util.find_spec(module) is None:
            return Availability(False, f"{dist} is not installed", hint)
    try:
        version = importlib.metadata.version(packages[-1][1])
    except importlib.metadata.PackageNotFoundError:
        version = None
    return Availability(True, version=version)


def token_ids(prompt: Sequence[int], vocab: int) -> list[int]:
    """A token-id prompt as ints, every id inside the vocabulary."""
    ids = [int(t) for t in prompt]
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ConfigError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
    return ids


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
