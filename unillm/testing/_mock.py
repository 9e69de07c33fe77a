"""``MockEngine``: an Engine driven by a plain function, for tests of code that uses unillm.

    from unillm.testing import MockEngine

    engine = MockEngine(lambda prompt, params: "Paris is the capital.").load()
    assert engine.generate("Capital of France?").text == "Paris is the capital."

The function returns the whole reply (split into word-sized tokens) or an iterable of token
strings. Everything around it (stop strings, max tokens, usage, timings, async, chat) is the real
base-class machinery, so what passes against MockEngine behaves the same on a real backend.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

from unillm._contract._engine import Engine, RequestState
from unillm._errors import ContextLengthExceeded
from unillm._types import Capabilities, EngineConfig, KVStats, SamplingParams

__all__ = ["MockEngine", "WordVocab"]

Responder = Callable[[str, SamplingParams], "str | Iterable[str]"]
_WORD = re.compile(r"\s*\S+|\s+")
_MOCK_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


class WordVocab:
    """A toy word-level tokenizer for test engines: a token is a word with the spaces before it,
    and ids are handed out as words are first seen, so ``decode(encode(x)) == x``."""

    __slots__ = ("_ids", "_words")

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._words: list[str] = []

    def id(self, word: str) -> int:
        """The id of ``word``, assigning the next free one on first sight."""
        i = self._ids.get(word)
        if i is None:
            i = self._ids[word] = len(self._words)
            self._words.append(word)
        return i

    def encode(self, text: str) -> list[int]:
        return [self.id(w) for w in _WORD.findall(text)]

    def split(self, text: str) -> list[str]:
        """``text`` cut into its word tokens."""
        return _WORD.findall(text)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self._words[i] for i in ids)

    def __len__(self) -> int:
        return len(self._words)


class MockEngine(Engine[Any]):
    """An engine whose replies come from ``respond(prompt, params)``.

    Tokens are word-sized pieces of the reply; a token's id is its index in a vocabulary the
    engine grows as it sees pieces, so ``detokenize(tokenize(x)) == x``.
    """

    name: ClassVar[str] = "mock"
    formats: ClassVar[frozenset[str]] = frozenset({"mock"})
    capabilities: ClassVar[Capabilities] = Capabilities(
        sampling=frozenset(SamplingParams.model_fields),
    )

    def __init__(
        self,
        respond: Responder | str | EngineConfig = "",
        config: EngineConfig | None = None,
        *,
        capabilities: Capabilities | None = None,
        context_length: int = 4096,
        **kwargs: Any,
    ) -> None:
        if isinstance(respond, EngineConfig):  # built by a registry: cls(config)
            config, respond = respond, ""
        if config is None:
            kwargs.setdefault("model", "mock")
            kwargs.setdefault("chat_template", _MOCK_TEMPLATE)
        super().__init__(config, **kwargs)
        self._respond: Responder = (lambda _p, _s: respond) if isinstance(respond, str) else respond
        if capabilities is not None:
            self.capabilities = capabilities  # type: ignore[misc]
        self.context_length = self.config.context_length or context_length
        self._vocab = WordVocab()
        self._used = 0
        self.requests: list[str] = []

    def _load(self) -> None:
        pass

    def _close(self) -> None:
        self._used = 0

    def _encode(self, prompt: str | Sequence[int], params: SamplingParams) -> str:
        text = prompt if isinstance(prompt, str) else self.detokenize(prompt)
        n = len(self.tokenize(text))
        limit = self.context_length
        if limit is not None and n >= limit:  # as a real engine refuses a prompt that fills its context
            raise ContextLengthExceeded(n, limit, params.max_tokens)
        return text

    def _stream(
        self, prepared: str, params: SamplingParams, req: RequestState
    ) -> Iterator[tuple[str, tuple[int, ...], tuple[float, ...] | None]]:
        self.requests.append(prepared)
        req.prompt_tokens = len(self.tokenize(prepared))
        reply = self._respond(prepared, params)
        pieces: Iterable[str] = self._vocab.split(reply) if isinstance(reply, str) else reply
        self._used = req.prompt_tokens
        for n, piece in enumerate(pieces):
            if n >= params.max_tokens:
                req.finish_reason = "length"
                return
            self._used += 1
            # the mock's reply is certain: each piece has probability 1
            yield piece, (self._vocab.id(piece),), (0.0,) if params.logprobs is not None else None
        req.finish_reason = "stop"

    def tokenize(self, text: str) -> list[int]:
        return self._vocab.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._vocab.decode(ids)

    def kv_stats(self) -> KVStats:
        return KVStats(capacity_tokens=self.context_length, used_tokens=self._used)
