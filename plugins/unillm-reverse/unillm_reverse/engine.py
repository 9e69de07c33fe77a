"""``ReverseEngine``: replies with the prompt's words in reverse order, one word per token.

No weights and no engine library: only the methods every backend writes. The base class derives
the rest (stop strings, ``max_tokens``, usage, timings, ``generate``, ``chat``, async).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import ClassVar

from unillm import ModelNotFound
from unillm.backend import Capabilities, Engine, NoOptions, Request, SamplingParams, check_token_ids
from unillm.testing import WordVocab

__all__ = ["ReverseEngine"]


class ReverseEngine(Engine[NoOptions]):
    """Streams the words of the prompt back, last word first."""

    name: ClassVar[str] = "reverse"
    # A format no model detector reports, so auto_engine never picks this engine on its own.
    formats: ClassVar[frozenset[str]] = frozenset({"reverse"})
    # Reversing is deterministic: every temperature gives the greedy answer. Stop strings are
    # applied by the base class. Any other parameter (top_p, seed, ...) is refused.
    capabilities: ClassVar[Capabilities] = Capabilities(
        sampling=frozenset({"max_tokens", "temperature", "stop"})
    )

    def _load(self) -> None:
        if not Path(self.config.model).expanduser().exists():
            raise ModelNotFound(self.config.model)
        self._vocab = WordVocab()  # a toy word-level tokenizer; a real engine brings its own

    def _encode(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        # this toy vocabulary grows as it reads text, so ids are checked against it now (an
        # engine with a fixed vocabulary sets ``self.vocab_size`` at load and the base class checks)
        return check_token_ids(prompt, len(self._vocab))

    def _stream(
        self, ids: list[int], params: SamplingParams, req: Request
    ) -> Iterator[tuple[str, tuple[int, ...], None]]:
        req.prompt_tokens = len(ids)
        words = [w for w in (self._vocab.decode([i]).strip() for i in reversed(ids)) if w]
        for n, word in enumerate(words[: params.max_tokens]):
            piece = word if n == 0 else " " + word
            yield piece, (self._vocab.id(piece),), None
        req.finish_reason = "length" if len(words) > params.max_tokens else "stop"

    def _chat_template(self) -> str:
        return "{{ messages[-1]['content'] }}"  # reply to the last message only

    def tokenize(self, text: str) -> list[int]:
        return self._vocab.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._vocab.decode(ids)
