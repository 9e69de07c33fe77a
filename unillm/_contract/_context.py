"""The context length an engine loads with: one rule for every engine and every door.

Asked for (``context_length`` in the config), it is what was asked. Not asked for, it is the
model's trained context, at most ``DEFAULT_CONTEXT`` tokens: a KV cache sized for a model's full
trained context (128k tokens for many) would take more memory than the weights, for requests that
rarely need it. ``auto_engine``'s plan, ``unillm select`` and ``plan``, the server's fit check
and each built-in engine's load call ``resolve_context``; the reason it returns says what was
left out, for the selection's explanation and the engine's options' docs.

Asked for more than the model was trained for, every engine loads with the trained context and
says so (``context_for``: a ``UnillmWarning`` naming what was asked, what is used and why), unless
the engine is told the model extends it (llama.cpp's ``allow_longer_context``, RoPE scaling). A
context that memory cannot hold is reduced by ``auto_engine``'s fallback steps, with a warning
too; only a context that cannot run at all is refused.
"""

from __future__ import annotations

from unillm._errors import warn

__all__ = ["DEFAULT_CONTEXT", "context_for", "resolve_context"]

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


def context_for(
    engine: str,
    model: str,
    requested: int | None,
    trained: int | None,
    *,
    longer: str | None = None,
    allowed: bool = False,
) -> int:
    """The context ``engine`` loads ``model`` with: ``resolve_context``'s, and a request beyond the
    trained context reduced to it with a ``UnillmWarning`` (past its trained length a model's
    output degrades), unless ``allowed`` (the model extends it). ``longer`` names the engine's own
    way to allow it, for the warning; None where it has none."""
    tokens, _ = resolve_context(requested, trained)
    if not (requested and trained and trained > 0 and requested > trained) or allowed:
        return tokens
    how = f"; set {longer} if the model extends its context (RoPE scaling)" if longer else ""
    warn(
        f"{engine}: context_length {requested} was asked for, {trained} is used: {model!r} was "
        f"trained for {trained} tokens, and past them its output degrades{how}"
    )
    return trained
