"""The ExLlamaV2 backend's structured output: a response format becomes an exllamav2 sampling
filter backed by llguidance (unillm/backend/llguidance.py, the matcher MLX uses too).

exllamav2's dynamic generator asks each job's filters, before every token, which tokens may come
next (``next()``: the allowed set and the end set), samples among those only, and feeds every
sampled token back (``feed``); drawing an end token ends the job. The end set here is the
end-of-sequence tokens the format allows, which are also the job's stop tokens, so a job under a
format ends exactly when the format is complete. ``next()`` runs on the generator's filter pool,
overlapping the forward pass (``use_background_worker``). The filter passes token lists (sets
before exllamav2 0.2.1), the path every exllamav2 since 0.2 takes; its logit-mask path would need
torch tensors, which unillm never handles. This module imports exllamav2: the backend imports it
at load, not before.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from exllamav2.generator.filters import ExLlamaV2Filter

from unillm.backend import OutputFormat
from unillm.backend.llguidance import INSTALL, Guide, allowed

__all__ = ["FormatFilter", "Formats"]


class FormatFilter(ExLlamaV2Filter):  # type: ignore[misc]
    """One job's response format: an llguidance matcher advanced by the tokens the job samples."""

    def __init__(self, model: Any, tokenizer: Any, matcher: Any, eos: frozenset[int], width: int) -> None:
        super().__init__(model, tokenizer)
        self.matcher = matcher
        self.eos = eos
        self.width = width

    def clone(self, c: Any = None) -> Any:
        if c is None:
            c = FormatFilter.__new__(FormatFilter)
        super().clone(c)
        c.matcher = self.matcher.deep_copy()
        c.eos, c.width, c.background_result = self.eos, self.width, None
        return c

    def begin(self, prefix_str: str = "") -> None:
        self.matcher.reset()  # the generator begins a job's filters before its first token

    def feed(self, token: Any) -> None:
        self.matcher.consume_token(int(token))  # a (1, 1) tensor from the generator, or an int

    def next(self) -> tuple[Collection[int] | None, Collection[int] | None]:
        mask = allowed(self.matcher, self.width)
        if not mask.any():  # the format is done or broken (a parse then says which): end
            mask[[e for e in self.eos if e < self.width]] = True
            if not mask.any():
                return None, None
        end = [e for e in sorted(self.eos) if e < self.width and mask[e]]
        pass_tokens = np.flatnonzero(mask).tolist()  # ascending
        # a sorted list goes to exllamav2's kernel as it is; a set (all exllamav2 before 0.2.1
        # takes) it sorts on the sampling thread, every token: ~10 ms on a 128k vocabulary
        if getattr(self, "allow_return_type_list", False):
            return pass_tokens, end
        return set(pass_tokens), set(end)

    def use_background_worker(self) -> bool:
        return True  # a grammar is CPU work: overlap it with the forward pass


class Formats:
    """One engine's llguidance tokenizer (built on first use) and the filters it makes."""

    def __init__(self, model_dir: Path, n_vocab: int, eos_ids: Sequence[int], model: Any, tokenizer: Any):
        self._guide = Guide("exllamav2", INSTALL, model_dir, n_vocab, eos_ids)
        self._model = model
        self._tokenizer = tokenizer

    def filters(self, fmt: OutputFormat | None) -> list[FormatFilter]:
        """The filters for one job under ``fmt`` (none without a format); compiling the format
        here, at the call, makes one llguidance cannot enforce a ``ConfigError`` before any work."""
        if fmt is None:
            return []
        g = self._guide
        return [FormatFilter(self._model, self._tokenizer, g.matcher(fmt), frozenset(g.eos), g.n_vocab)]
