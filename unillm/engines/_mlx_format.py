"""The MLX backend's structured output, through llguidance: a response format becomes a token
matcher, and the sampler draws only from the tokens the matcher allows, then tells it the token.

llguidance was chosen over xgrammar and outlines-core: it builds its tokenizer from
``tokenizer.json`` alone (no transformers, no torch), in milliseconds, and never reaches for the
network. The mask is applied where tokens are drawn, so the logprobs a request gets stay the
model's own (as for ``logit_bias``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from unillm._errors import BackendUnavailable, ConfigError
from unillm._structured import OutputFormat

__all__ = ["FormatGuide"]

INSTALL = "pip install 'unillm[mlx]' (it brings llguidance)"


class FormatGuide:
    """One engine's llguidance tokenizer (built on first use) and the samplers it constrains."""

    def __init__(self, model_dir: Path, n_vocab: int, eos_ids: Sequence[int]) -> None:
        self._file = model_dir / "tokenizer.json"
        self._n_vocab = n_vocab
        self._eos = sorted(eos_ids)
        self._tokenizer: Any = None

    def _llg(self) -> Any:
        try:
            import llguidance
        except ImportError as exc:
            raise BackendUnavailable("mlx", f"response_format needs llguidance: {exc}", INSTALL) from exc
        if self._tokenizer is None:
            if not self._file.is_file():
                raise ConfigError(
                    f"response_format on MLX needs the model's tokenizer.json, and {self._file} is not there"
                )
            self._tokenizer = llguidance.LLTokenizer(
                str(self._file), n_vocab=self._n_vocab, eos_token=self._eos or None
            )
        return llguidance

    def check(self, fmt: OutputFormat) -> None:
        """Raise ``ConfigError`` now if ``fmt`` makes no grammar (at the call, not the first token)."""
        self.matcher(fmt)

    def matcher(self, fmt: OutputFormat) -> Any:
        llg = self._llg()
        # compact JSON (no free whitespace, which a model can run on for ever); a keyword
        # llguidance does not implement is an error, never dropped (lenient stays off)
        if fmt.kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(fmt.pattern)
        elif fmt.kind == "choice":  # lark string literals take JSON's escapes
            grammar = llg.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in fmt.choices)
            )
        else:
            grammar = llg.LLMatcher.grammar_from_json_schema(
                fmt.json_schema, defaults={"whitespace_flexible": False}
            )
        matcher = llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConfigError(f"llguidance cannot enforce this response_format: {matcher.get_error()}")
        return matcher

    def constrain(self, mx: Any, draw: Callable[[Any], Any], fmt: OutputFormat) -> Callable[[Any], Any]:
        """``draw`` (an mlx-lm sampler) limited to what ``fmt`` allows next; each drawn token
        advances the matcher, so the sampler serves one request, called once per token in order."""
        import numpy as np

        matcher = self.matcher(fmt)
        neg_inf = mx.array(-float("inf"))

        def sample(logprobs: Any) -> Any:
            width = logprobs.shape[-1]
            allowed = np.zeros(width, dtype=bool)
            bias = np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8)[:width]
            allowed[: len(bias)] = bias > 0
            if not allowed.any():  # the format is done or broken (a parse then says which): end
                if not self._eos:
                    return draw(logprobs)
                allowed[[e for e in self._eos if e < width]] = True
            token = draw(mx.where(mx.array(allowed), logprobs, neg_inf))
            matcher.consume_token(int(token.reshape(-1)[0].item()))
            return token

        return sample
