"""The MLX backend's structured output, through llguidance (unillm/engines/_llguidance.py): a
response format becomes a token matcher, and the sampler draws only from the tokens the matcher
allows, then tells it the token.

The mask is applied where tokens are drawn, so the logprobs a request gets stay the model's own
(as for ``logit_bias``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from unillm._structured import OutputFormat
from unillm.engines._llguidance import Guide, allowed

__all__ = ["FormatGuide"]

INSTALL = "pip install 'unillm[mlx]' (it brings llguidance)"


class FormatGuide(Guide):
    """One MLX engine's llguidance tokenizer (built on first use) and the samplers it constrains."""

    def __init__(self, model_dir: Path, n_vocab: int, eos_ids: Sequence[int]) -> None:
        super().__init__("mlx", INSTALL, model_dir, n_vocab, eos_ids)

    def constrain(self, mx: Any, draw: Callable[[Any], Any], fmt: OutputFormat) -> Callable[[Any], Any]:
        """``draw`` (an mlx-lm sampler) limited to what ``fmt`` allows next; each drawn token
        advances the matcher, so the sampler serves one request, called once per token in order."""
        matcher = self.matcher(fmt)
        neg_inf = mx.array(-float("inf"))
        eos = list(self.eos)

        def sample(logprobs: Any) -> Any:
            width = logprobs.shape[-1]
            mask = allowed(matcher, width)
            if not mask.any():  # the format is done or broken (a parse then says which): end
                if not eos:
                    return draw(logprobs)
                mask[[e for e in eos if e < width]] = True
            token = draw(mx.where(mx.array(mask), logprobs, neg_inf))
            matcher.consume_token(int(token.reshape(-1)[0].item()))
            return token

        return sample
