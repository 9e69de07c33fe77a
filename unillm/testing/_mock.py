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

from unillm._engine import Engine, Request
from unillm._types import Capabilities, EngineConfig, KVStats, SamplingParams

__all__ = ["MockEngine"]

Responder = Callable[[str, SamplingParams], "str | Iterable[str]"]
_WORD = re.compile(r"\s*\S+|\s+")
_MOCK_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


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
        self._vocab: dict[str, int] = {}
        self._pieces: list[str] = []
        self._used = 0
        self.requests: list[str] = []

    def _load(self) -> None:
        pass

    def _close(self) -> None:
        self._used = 0

    def _encode(self, prompt: str | Sequence[int], params: SamplingParams) -> str:
        return prompt if isinstance(prompt, str) else self.detokenize(prompt)

    def _stream(
        self, prepared: str, params: SamplingParams, req: Request
    ) -> Iterator[tuple[str, tuple[int, ...], None]]:
        self.requests.append(prepared)
        req.prompt_tokens = len(self.tokenize(prepared))
        reply = self._respond(prepared, params)
        pieces: Iterable[str] = _WORD.findall(reply) if isinstance(reply, str) else reply
        self._used = req.prompt_tokens
        for n, piece in enumerate(pieces):
            if n >= params.max_tokens:
                req.finish_reason = "length"
                return
            self._used += 1
            yield piece, (self._id(piece),), None
        req.finish_reason = "stop"

    def tokenize(self, text: str) -> list[int]:
        return [self._id(p) for p in _WORD.findall(text)]

    def detokenize(self, ids: Sequence[int]) -> str:
        return "".join(self._pieces[i] for i in ids)

    def kv_stats(self) -> KVStats:
        return KVStats(capacity_tokens=self.context_length, used_tokens=self._used)

    def _id(self, piece: str) -> int:
        i = self._vocab.get(piece)
        if i is None:
            i = self._vocab[piece] = len(self._pieces)
            self._pieces.append(piece)
        return i
