"""Structured output through llguidance, the one constraint compiler of every built-in backend:
llama.cpp (a sampler at the head of its chain), MLX (its sampler), ExLlamaV2 (job filters) and
vLLM (its ``guidance`` structured-output backend). One reading of a format, one grammar, one
refusal: a schema is accepted, enforced and refused the same on each.

The rules, decided here once:

- JSON is compact: no free whitespace between tokens (a model can write whitespace for ever;
  random weights do).
- An object schema that lists ``properties`` (or ``patternProperties``) and does not say
  ``additionalProperties`` allows no other properties (:func:`closed`): what llama.cpp's grammars,
  xgrammar and OpenAI's strict mode do, and what keeps a small model from inventing keys.
- A keyword llguidance does not implement (``not``, ``if``/``then``, ``uniqueItems``, ...) or an
  unknown ``format`` is refused (:func:`check`), never dropped: llguidance's lenient mode stays off.

llguidance was chosen over xgrammar and outlines-core: it builds its tokenizer from
``tokenizer.json`` alone or from llama.cpp's vocabulary (no transformers, no torch), in
milliseconds, and never reaches for the network. Each backend applies the matcher's mask where its
engine draws tokens.
"""

from __future__ import annotations

import copy
import functools
import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from unillm._errors import BackendUnavailable, ConfigError
from unillm._structured import OutputFormat, subschemas

__all__ = ["INSTALL", "Guide", "allowed", "check", "closed", "grammar"]

INSTALL = "pip install 'llguidance>=1.7,<1.8' (the version unillm tests)"


def closed(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema that lists ``properties`` or
    ``patternProperties`` without saying ``additionalProperties`` says ``false``."""
    out = copy.deepcopy(schema)
    _close(out)
    return out


def _close(node: Any) -> None:
    if not isinstance(node, dict):
        return
    for sub in subschemas(node):
        _close(sub)
    if "additionalProperties" not in node and (
        isinstance(node.get("properties"), dict) or isinstance(node.get("patternProperties"), dict)
    ):
        node["additionalProperties"] = False


def _llguidance(backend: str, install: str) -> Any:
    try:
        import llguidance
    except ImportError as exc:
        raise BackendUnavailable(backend, f"response_format needs llguidance: {exc}", install) from exc
    return llguidance


def grammar(fmt: OutputFormat, backend: str = "unillm", install: str = INSTALL) -> str:
    """``fmt`` as llguidance's grammar (a cache hit for a format seen before)."""
    text = json.dumps(fmt.schema, sort_keys=True) if fmt.schema is not None else None
    return _grammar(fmt.kind, text, fmt.pattern, fmt.choices, backend, install)


@functools.lru_cache(maxsize=256)
def _grammar(
    kind: str, schema: str | None, pattern: str | None, choices: tuple[str, ...], backend: str, install: str
) -> str:
    llg = _llguidance(backend, install)
    if kind == "regex":
        text = llg.LLMatcher.grammar_from_regex(pattern)
    elif kind == "choice":  # lark string literals take JSON's escapes
        text = llg.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        )
    else:
        body = closed(json.loads(schema)) if schema is not None else {"type": "object"}
        text = llg.LLMatcher.grammar_from_json_schema(body, defaults={"whitespace_flexible": False})
    if error := llg.LLMatcher.validate_grammar(text):
        raise _refused(
            f"response_format cannot be enforced: {error}. unillm enforces the same JSON Schema "
            "keywords on every engine (docs/structured.md lists them): drop this one and check it "
            "after parsing"
        )
    return text


def _refused(message: str) -> ConfigError:
    error = ConfigError(message)
    error.fields = ("response_format",)  # the field a server's 400 names
    return error


def check(fmt: OutputFormat, backend: str = "unillm", install: str = INSTALL) -> None:
    """Raise ``ConfigError`` now (at the call, not at the first token) if ``fmt`` cannot be
    enforced; the same words on every engine."""
    grammar(fmt, backend, install)


class Guide:
    """One engine's llguidance tokenizer (built on first use, once) and the matchers it compiles.

    The tokenizer comes from the model's ``tokenizer.json`` (``model_dir``), or from ``tokenizer``,
    a function of the llguidance module that builds it (llama.cpp's vocabulary). ``backend`` and
    ``install`` name the engine and how to get llguidance for it, in the errors."""

    def __init__(
        self,
        backend: str,
        install: str,
        model_dir: Path | None,
        n_vocab: int,
        eos_ids: Sequence[int],
        *,
        tokenizer: Callable[[Any], Any] | None = None,
    ) -> None:
        self._backend = backend
        self._install = install
        self._file = model_dir / "tokenizer.json" if model_dir is not None else None
        self._make = tokenizer
        self.n_vocab = n_vocab
        self.eos = tuple(sorted(eos_ids))
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def _llg(self) -> Any:
        llg = _llguidance(self._backend, self._install)
        with self._lock:  # two first requests build it once
            if self._tokenizer is None:
                self._tokenizer = self._build(llg)
        return llg

    def _build(self, llg: Any) -> Any:
        if self._make is not None:
            return self._make(llg)
        if self._file is None or not self._file.is_file():
            raise ConfigError(
                f"response_format on {self._backend} needs the model's tokenizer.json, and "
                f"{self._file} is not there"
            )
        return llg.LLTokenizer(str(self._file), n_vocab=self.n_vocab, eos_token=list(self.eos) or None)

    def check(self, fmt: OutputFormat) -> None:
        """Raise ``ConfigError`` now if ``fmt`` cannot be enforced (see :func:`check`)."""
        check(fmt, self._backend, self._install)

    def matcher(self, fmt: OutputFormat) -> Any:
        """A fresh ``llguidance.LLMatcher`` for one request under ``fmt``; ``ConfigError`` when
        it cannot be enforced, ``BackendUnavailable`` when llguidance is not installed."""
        text = grammar(fmt, self._backend, self._install)
        llg = self._llg()
        matcher = llg.LLMatcher(self._tokenizer, text, log_level=0)
        if matcher.is_error():
            raise _refused(f"response_format cannot be enforced: {matcher.get_error()}")
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
