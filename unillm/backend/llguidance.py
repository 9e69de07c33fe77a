"""Structured output through llguidance, shared by the backends that enforce a response format with
it (MLX's sampler, ExLlamaV2's filters): one tokenizer per engine, one matcher per request.

llguidance was chosen over xgrammar and outlines-core: it builds its tokenizer from
``tokenizer.json`` alone (no transformers, no torch), in milliseconds, and never reaches for the
network. Each backend applies the matcher's mask where its engine draws tokens, so the formats
and their rules (compact JSON, a regex whole, one of the choices) are the same on every one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from unillm._errors import BackendUnavailable, ConfigError
from unillm._structured import OutputFormat

__all__ = ["Guide", "allowed"]


class Guide:
    """One engine's llguidance tokenizer (built on first use) and the matchers it compiles.

    ``backend`` and ``install`` name the engine and how to get llguidance for it, in the errors."""

    def __init__(
        self, backend: str, install: str, model_dir: Path, n_vocab: int, eos_ids: Sequence[int]
    ) -> None:
        self._backend = backend
        self._install = install
        self._file = model_dir / "tokenizer.json"
        self.n_vocab = n_vocab
        self.eos = tuple(sorted(eos_ids))
        self._tokenizer: Any = None

    def _llg(self) -> Any:
        try:
            import llguidance
        except ImportError as exc:
            msg = f"response_format needs llguidance: {exc}"
            raise BackendUnavailable(self._backend, msg, self._install) from exc
        if self._tokenizer is None:
            if not self._file.is_file():
                raise ConfigError(
                    f"response_format on {self._backend} needs the model's tokenizer.json, and "
                    f"{self._file} is not there"
                )
            self._tokenizer = llguidance.LLTokenizer(
                str(self._file), n_vocab=self.n_vocab, eos_token=list(self.eos) or None
            )
        return llguidance

    def check(self, fmt: OutputFormat) -> None:
        """Raise ``ConfigError`` now if ``fmt`` makes no grammar (at the call, not the first token)."""
        self.matcher(fmt)

    def matcher(self, fmt: OutputFormat) -> Any:
        """A fresh ``llguidance.LLMatcher`` for one request under ``fmt``; ``ConfigError`` when
        llguidance cannot compile it, ``BackendUnavailable`` when llguidance is not installed."""
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


def allowed(matcher: Any, width: int) -> Any:
    """The tokens ``matcher`` allows next, as a numpy bool array of ``width`` (the logits' width;
    ids past the tokenizer's vocabulary are never allowed). All False when the format is done
    and its tokenizer has no end-of-sequence token, or when the matcher is in error."""
    import numpy as np

    mask = np.zeros(width, dtype=bool)
    bias = np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8)[:width]
    mask[: len(bias)] = bias > 0
    return mask
