"""The context length an engine loads with: one rule for every engine and every door.

Asked for (``context_length`` in the config), it is what was asked. Not asked for, it is the
model's trained context, at most ``DEFAULT_CONTEXT`` tokens: a KV cache sized for a model's full
trained context (128k tokens for many) would take more memory than the weights, for requests that
rarely need it. ``auto_engine``'s plan, ``unillm select`` and ``plan``, the server's fit check
and each built-in engine's load call ``resolve_context``; the reason it returns says what was
left out, for the selection's explanation and the engine's options' docs.
"""

from __future__ import annotations

__all__ = ["DEFAULT_CONTEXT", "resolve_context"]

#: Tokens an engine loads with when no context length is asked for and the model trains on more.
DEFAULT_CONTEXT = 4096


def resolve_context(requested: int | None, trained: int | None) -> tuple[int, str | None]:
    """``(tokens, reason)``: the context to load with, and why it is below the model's trained
    context when it is (None when it is not, or the trained context is unknown)."""
    if requested:
        return requested, None
    trained = trained if isinstance(trained, int) and trained > 0 else None
    if trained is None:
        return DEFAULT_CONTEXT, None
    if trained <= DEFAULT_CONTEXT:
        return trained, None
    return DEFAULT_CONTEXT, (
        f"context {DEFAULT_CONTEXT} tokens, unillm's default, of the {trained} the model trains on: "
        "set context_length for more"
    )
