"""A unillm backend in one file: define it, register it, load it, check it.

    python examples/minimal_plugin.py

``ShoutEngine`` streams the prompt back word by word, in upper case. It is registered on a fresh
``unillm.Registry`` through a hook implementation, exactly as an installed plugin's entry point
would be, then loaded by name and put through ``unillm.testing.check_engine``, the conformance
checks every backend passes. plugins/unillm-reverse is a plugin of the same shape, packaged.

A backend named in the config is loaded even when ``unillm.detect_format`` does not know what the
"model" is (here: this script's own path): the backend itself decides what it can read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import unillm
from unillm import Capabilities, Engine, NoOptions, Request, SamplingParams
from unillm.testing import WordVocab, check_engine


class ShoutEngine(Engine[NoOptions]):
    """Replies with the prompt's words in upper case, one word per token."""

    name: ClassVar[str] = "shout"
    formats: ClassVar[frozenset[str]] = frozenset({"shout"})
    capabilities: ClassVar[Capabilities] = Capabilities(sampling=frozenset({"temperature"}))

    def _load(self) -> None:
        self._vocab = WordVocab()  # a toy word-level tokenizer; a real engine brings its own

    def _encode(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        # Runs eagerly inside stream(), so a bad prompt fails at the call.
        return self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)

    def _stream(
        self, ids: list[int], params: SamplingParams, req: Request
    ) -> Iterator[tuple[str, tuple[int, ...], None]]:
        req.prompt_tokens = len(ids)  # the one field a backend must fill
        for n, word in enumerate(self._vocab.split(self._vocab.decode(ids).upper())):
            if n == params.max_tokens:
                req.finish_reason = "length"
                return
            yield word, (self._vocab.id(word),), None
        req.finish_reason = "stop"

    def _chat_template(self) -> str:
        return "{{ messages[-1]['content'] }}"

    def tokenize(self, text: str) -> list[int]:
        return self._vocab.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._vocab.decode(ids)


class ShoutPlugin:
    """A plugin is any object (usually a module) with hook implementations."""

    @unillm.hookimpl
    def unillm_register_backends(self, register: Callable[[type[Engine[Any]]], None]) -> None:
        register(ShoutEngine)


def main() -> None:
    registry = unillm.Registry(entry_points=False)  # built-ins, and no installed plugins
    registry.register_plugin(ShoutPlugin(), name="shout-example")
    for info in registry.backends().values():
        print(f"registered: {info.name} (from {info.source})")

    engine = unillm.load_engine({"model": __file__, "backend": "shout"}, registry=registry)
    print(f"load_engine: loaded {engine.name!r} through the registry")

    with engine:
        print("stream:", "|".join(c.text for c in engine.stream("the quick brown fox")))
        reply = engine.chat([{"role": "user", "content": "hello plugin world"}])
        print(f"chat: {reply.text} (finish={reply.finish_reason}, usage={reply.usage})")
        print("conformance passed:", ", ".join(check_engine(engine)))


if __name__ == "__main__":
    main()
