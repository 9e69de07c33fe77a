"""LLGuidanceFilter (exllamav3/generator/filter/llguidance.py, the same in v1.4.1 and v1.6.5),
with the real llguidance: the same constructor (exactly one grammar source), tokenizer (built
from the HF tokenizer's JSON with the config's EOS list) and packed int32 bitmask; the mask is a
numpy array (no torch)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from .filter import Filter

try:
    from llguidance import LLMatcher, LLTokenizer, grammar_from

    llguidance_available = True
except (ModuleNotFoundError, ImportError):
    llguidance_available = False


def create_ll_tokenizer(tokenizer: Any) -> Any:
    cached = getattr(tokenizer, "_fake_ll_tokenizer", None)
    if cached is None:
        cfg = tokenizer.config
        eos = (
            list(cfg.eos_token_id_list) if getattr(cfg, "eos_token_id_list", None) else tokenizer.eos_token_id
        )
        cached = LLTokenizer(tokenizer.tokenizer.to_str(), eos_token=eos)
        tokenizer._fake_ll_tokenizer = cached
    return cached


class LLGuidanceFilter(Filter):
    def __init__(
        self,
        tokenizer: Any,
        trigger_token: int | None = None,
        prefix_str: str | None = None,
        eos_after_completed: bool = False,
        json_schema: dict[str, Any] | str | None = None,
        regex: str | None = None,
        lark_grammar: str | None = None,
        gbnf_grammar: str | None = None,
        llg_grammar: str | None = None,
        consume_prefix: bool = False,
    ) -> None:
        if not llguidance_available:
            raise ValueError("llguidance package is not available.")
        super().__init__(tokenizer, trigger_token, prefix_str, eos_after_completed)
        sources = [
            ("json_schema", json_schema),
            ("regex", regex),
            ("lark", lark_grammar),
            ("gbnf", gbnf_grammar),
            ("llguidance", llg_grammar),
        ]
        given = [(f, g) for f, g in sources if g is not None]
        assert len(given) == 1, (
            "Specify exactly one of json_schema, regex, lark_grammar, gbnf_grammar, llg_grammar"
        )
        g_format, g_text = given[0]
        if isinstance(g_text, dict):
            g_text = json.dumps(g_text)
        self._ll_tokenizer = create_ll_tokenizer(tokenizer)
        self._grammar = grammar_from(g_format, g_text)
        err = LLMatcher.validate_grammar(self._grammar, self._ll_tokenizer)
        if err:
            raise ValueError(f"Invalid grammar: {err}")
        self._matcher = LLMatcher(self._ll_tokenizer, self._grammar)
        self._bitmask = np.empty(((self._ll_tokenizer.vocab_size + 31) // 32,), dtype=np.int32)
        self._check_error()

    def _check_error(self) -> None:
        if self._matcher.is_error():
            raise RuntimeError(f"llguidance matcher error: {self._matcher.get_error()}")

    def reset(self) -> None:
        if self._matcher.is_error():
            self._matcher = LLMatcher(self._ll_tokenizer, self._grammar)
        else:
            self._matcher.reset()

    def accept_token(self, token: int) -> None:
        if self._matcher.is_stopped():
            return
        self._matcher.consume_token(token)
        self._check_error()

    def get_next_logit_mask(self) -> Any:
        bm = self._bitmask
        self._matcher.unsafe_compute_mask_ptr(bm.ctypes.data, bm.size * bm.itemsize)
        self._check_error()
        return bm

    def is_completed(self) -> bool:
        return bool(self._matcher.is_stopped())
