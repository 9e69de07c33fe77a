"""Speculative decoding for the MLX backend: mlx-lm's ``stream_generate(draft_model=...)``.

mlx-lm drafts ``num_draft_tokens`` with the draft model, verifies them in one pass of the target
and keeps the prefix the target's own samples agree with (``speculative_generate_step``); each
response says whether its token came from the draft (``from_draft``). Its prompt cache is the
target's layers followed by the draft's, which the adapter's prefix reuse trims together, so both
parts are brought to the same length after every request. One request at a time: mlx-lm's
``BatchGenerator`` has no draft model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unillm import ConfigError, UnsupportedParameter
from unillm.backend import RequestState, SamplingParams, hf_dir_in

__all__ = [
    "Draft",
    "Tally",
    "check_options",
    "check_request",
    "draft_kwargs",
    "load_draft",
    "make_cache",
    "settle",
]

_DEFAULT_DRAFT_TOKENS = 2  # mlx-lm's own default


class Draft:
    """A loaded draft model and how many tokens it proposes per step."""

    def __init__(self, model: Any, k: int) -> None:
        self.model, self.k = model, k


def check_options(opts: Any) -> Any:
    """``draft_model`` runs one request at a time: ``batch_size`` left unset becomes 1; set above 1
    it is refused. ``num_draft_tokens`` needs a ``draft_model``; a rotating cache cannot rewind."""
    if opts.draft_model is None:
        if opts.num_draft_tokens is not None:
            raise ValueError("num_draft_tokens is set without draft_model; set both or neither")
        return opts
    if "batch_size" not in opts.model_fields_set:
        opts.batch_size = 1
    elif opts.batch_size > 1:
        raise ValueError(
            f"draft_model runs one request at a time (mlx-lm's BatchGenerator has no draft model); "
            f"batch_size={opts.batch_size} asks for batching: set batch_size=1 or leave it unset"
        )
    if opts.max_kv_size is not None:
        raise ValueError(
            "draft_model needs a cache it can rewind, and max_kv_size makes a rotating one: unset one"
        )
    return opts


def load_draft(mlx_lm: Any, draft: str | None, k: int | None, tokenizer: Any) -> Draft | None:
    """The draft model the ``draft_model`` option names (an HF or MLX directory with the target's
    vocabulary), or None when unset."""
    if draft is None:
        return None
    path = hf_dir_in(draft)
    if path is None:
        what = "does not exist" if not Path(draft).expanduser().exists() else "holds no config.json"
        raise ConfigError(f"draft_model {draft!r} {what}: MLX drafts with a model directory (HF or MLX)")
    try:
        model, dtok = mlx_lm.load(str(path))[:2]
    except (ValueError, KeyError, OSError) as exc:
        raise ConfigError(f"draft_model {draft!r} failed to load in mlx-lm: {exc}") from exc
    if dtok.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(
            f"draft_model {draft!r} has another vocabulary than the model ({len(dtok)} tokens, the "
            f"model has {len(tokenizer)} or a different mapping); a draft must share its tokenizer"
        )
    return Draft(model, k or _DEFAULT_DRAFT_TOKENS)


def check_request(draft: Draft | None, params: SamplingParams) -> None:
    # mlx-lm samples all verified positions in one call: a grammar that advances per call cannot
    if draft is not None and params.response_format is not None:
        raise UnsupportedParameter(
            "mlx", ["response_format"], "Not with a draft_model (speculative decoding): unset one."
        )


def draft_kwargs(draft: Draft | None) -> dict[str, Any]:
    return {} if draft is None else {"draft_model": draft.model, "num_draft_tokens": draft.k}


def make_cache(draft: Draft | None, cache_mod: Any, model: Any, max_kv_size: int | None) -> list[Any]:
    """A fresh prompt cache: the target's layers, then the draft's (mlx-lm's layout)."""
    cache = cache_mod.make_prompt_cache(model, max_kv_size=max_kv_size)
    return cache if draft is None else [*cache, *cache_mod.make_prompt_cache(draft.model)]


def settle(draft: Draft | None, cache: list[Any] | None, model: Any, cache_mod: Any) -> int | None:
    """Tokens the prompt cache holds, after trimming the target's and the draft's parts to the same
    length (mlx-lm leaves the draft's a token short when it kept every draft)."""
    if not cache:
        return None
    if any(getattr(c, "offset", None) is None for c in cache):
        return None
    offsets: list[int] = [int(c.offset) for c in cache]
    if draft is not None:
        n = len(model.layers)
        low = min(offsets[0], offsets[n])
        for part, offset in ((cache[:n], offsets[0]), (cache[n:], offsets[n])):
            if offset > low:
                cache_mod.trim_prompt_cache(part, offset - low)
        return low
    return offsets[0]


class Tally:
    """One request's drafted and accepted counts: mlx-lm drafts min(left, k) tokens at the start of
    each round, and a round ends with the first token not from the draft."""

    def __init__(self, draft: Draft | None, max_tokens: int, req: RequestState) -> None:
        self._k, self._left, self._req = (draft.k if draft else 0), max_tokens, req
        self._new_round = True
        if draft is not None:
            req.draft_tokens = req.accepted_draft_tokens = 0

    def see(self, from_draft: bool) -> None:
        if not self._k:
            return
        req = self._req
        if self._new_round:
            req.draft_tokens = (req.draft_tokens or 0) + min(self._left, self._k)
        self._left -= 1
        if from_draft:
            req.accepted_draft_tokens = (req.accepted_draft_tokens or 0) + 1
        self._new_round = not from_draft
