"""The MLX backend's structured output, through llguidance (unillm/backend/llguidance.py): a
response format becomes a token matcher, and the sampler draws only from the tokens the matcher
allows, then tells it the token.

The mask is applied where tokens are drawn, so the logprobs a request gets stay the model's own
(as for ``logit_bias``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from unillm.backend import OutputFormat
from unillm.backend.llguidance import Guide, allowed

__all__ = ["FormatGuide"]

INSTALL = "pip install 'unillm[mlx]' (it brings llguidance)"


class FormatGuide(Guide):
    """One MLX engine's llguidance tokenizer (built on first use) and the samplers it constrains."""

    def __init__(self, model_dir: Path, n_vocab: int, eos_ids: Sequence[int]) -> None:
        super().__init__("mlx", INSTALL, model_dir, n_vocab, eos_ids)

    def constrain(self, mx: Any, draw: Callable[[Any], Any], fmt: OutputFormat) -> Callable[[Any], Any]:
        """``draw`` (an mlx-lm sampler) limited to what ``fmt`` allows next; each drawn token
        advances the matcher, so the sampler serves one request, called once per token in order.

        The matcher is told a token at the next call, not when it is drawn: reading it at once
        would wait for its forward pass inside mlx-lm's step and undo the overlap of one token's
        forward pass with the handling of the one before (by then it has been computed)."""
        matcher = self.matcher(fmt)
        neg_inf = mx.array(-float("inf"))
        eos = list(self.eos)
        drawn: list[Any] = []  # the token drawn at the previous call, not yet told to the matcher

        def sample(logprobs: Any) -> Any:
            if drawn:
                matcher.consume_token(int(drawn.pop().reshape(-1)[0].item()))
            width = logprobs.shape[-1]
            mask = allowed(matcher, width)
            if not mask.any():  # the format is done or broken (a parse then says which): end
                if not eos:
                    return draw(logprobs)
                mask[[e for e in eos if e < width]] = True
            token = draw(mx.where(mx.array(mask), logprobs, neg_inf))
            drawn.append(token)
            return token

        return sample
