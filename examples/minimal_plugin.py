"""A unillm backend in one file: define it, register it, load it, check it.

    python examples/minimal_plugin.py

``ReverseEngine`` streams the prompt back word by word, last word first. It is registered on a fresh
``unillm.Registry`` through a hook implementation, exactly as an installed plugin's entry point
would be, then loaded by name and put through ``unillm.testing.check_engine``, the conformance
checks every backend passes. plugins/unillm-reverse is the same engine as an installable package.

A backend named in the config is loaded even when ``unillm.detect_format`` does not know what the
"model" is (here: this script's own path): the backend itself decides what it can read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import unillm
from unillm import Capabilities, Engine, NoOptions, Request, SamplingParams
from unillm.testing import check_engine

_WORD = re.compile(r"\s*\S+|\s+")


class ReverseEngine(Engine[NoOptions]):
    """Replies with the prompt's words, last first, one word per token."""

    name: ClassVar[str] = "reverse"
    formats: ClassVar[frozenset[str]] = frozenset({"reverse"})
    capabilities: ClassVar[Capabilities] = Capabilities(
        sampling=frozenset({"max_tokens", "temperature", "stop"})
    )

    def _load(self) -> None:
        self._vocab: dict[str, int] = {}
        self._words: list[str] = []

    def _encode(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        # Runs eagerly inside stream(), so a bad prompt fails at the call.
        return self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)

    def _stream(
        self, ids: list[int], params: SamplingParams, req: Request
    ) -> Iterator[tuple[str, tuple[int, ...], None]]:
        req.prompt_tokens = len(ids)  # the one field a backend must fill
        words = [w for w in (self._words[i].strip() for i in reversed(ids)) if w]
        for n, word in enumerate(words[: params.max_tokens]):
            piece = word if n == 0 else " " + word
            yield piece, (self._id(piece),), None
        req.finish_reason = "length" if len(words) > params.max_tokens else "stop"

    def _chat_template(self) -> str:
        return "{{ messages[-1]['content'] }}"

    def tokenize(self, text: str) -> list[int]:
        return [self._id(w) for w in _WORD.findall(text)]

    def detokenize(self, ids: Sequence[int]) -> str:
        return "".join(self._words[i] for i in ids)

    def _id(self, word: str) -> int:
        if word not in self._vocab:
            self._vocab[word] = len(self._words)
            self._words.append(word)
        return self._vocab[word]


class ReversePlugin:
    """A plugin is any object (usually a module) with hook implementations."""

    @unillm.hookimpl
    def unillm_register_backends(self, register: Callable[[type[Engine[Any]]], None]) -> None:
        register(ReverseEngine)


def main() -> None:
    registry = unillm.Registry(entry_points=False)  # built-ins, and no installed plugins
    registry.register_plugin(ReversePlugin(), name="reverse-example")
    for info in registry.backends().values():
        print(f"registered: {info.name} (from {info.source})")

    engine = unillm.load_engine({"model": __file__, "backend": "reverse"}, registry=registry)
    print(f"load_engine: loaded {engine.name!r} through the registry")

    with engine:
        print("stream:", "|".join(c.text for c in engine.stream("the quick brown fox")))
        reply = engine.chat([{"role": "user", "content": "hello plugin world"}])
        print(f"chat: {reply.text} (finish={reply.finish_reason}, usage={reply.usage})")
        print("conformance passed:", ", ".join(check_engine(engine)))


if __name__ == "__main__":
    main()
