"""The tutorial plugin's tests: unillm's conformance checks, then what makes it ``reverse``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import unillm_reverse
from unillm_reverse.engine import ReverseEngine

from unillm import KVStats, ModelNotFound, Registry, UnsupportedParameter
from unillm.testing import MockEngine, check_engine


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[ReverseEngine]:
    # The engine reads no weights, but like every backend it refuses a model path that is not there.
    with ReverseEngine({"model": str(tmp_path)}) as e:
        yield e


def test_passes_the_conformance_checks(engine: ReverseEngine) -> None:
    passed = check_engine(engine)
    assert "stop-strings" in passed
    assert "tokenizer-round-trip" in passed


def test_streams_the_words_back_last_first(engine: ReverseEngine) -> None:
    chunks = list(engine.stream("one two three"))
    assert [c.text for c in chunks] == ["three", " two", " one", ""]
    last = chunks[-1]
    assert last.finish_reason == "stop"
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 3)
    assert last.usage.cached_prompt_tokens is None  # no cache, so it cannot tell
    assert last.timings is not None and last.timings.source == "wall"


@pytest.mark.parametrize(
    ("params", "text", "finish"),
    [
        ({}, "d c b a", "stop"),
        ({"max_tokens": 2}, "d c", "length"),
        ({"stop": " b"}, "d c", "stop"),
        ({"temperature": 0.0, "stop": ["c", "zzz"]}, "d ", "stop"),
    ],
)
def test_behaves_like_the_mock_engine(
    engine: ReverseEngine, params: dict[str, object], text: str, finish: str
) -> None:
    mock = MockEngine(lambda prompt, _: " ".join(reversed(prompt.split()))).load()
    mine, theirs = engine.generate("a b c d", params), mock.generate("a b c d", params)
    assert (mine.text, mine.finish_reason) == (text, finish)
    assert (theirs.text, theirs.finish_reason) == (text, finish)
    assert mine.usage.completion_tokens == theirs.usage.completion_tokens


def test_chat_replies_to_the_last_message(engine: ReverseEngine) -> None:
    messages = [{"role": "system", "content": "ignored"}, {"role": "user", "content": "hello big world"}]
    assert engine.chat(messages).text == "world big hello"
    assert asyncio.run(engine.achat(messages)).text == "world big hello"


def test_token_prompts_round_trip(engine: ReverseEngine) -> None:
    ids = engine.tokenize("red green blue")
    assert engine.detokenize(ids) == "red green blue"
    assert engine.generate(ids).text == "blue green red"


def test_refuses_what_it_cannot_do(engine: ReverseEngine, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedParameter, match="top_p"):
        engine.generate("a b", top_p=0.5)
    assert engine.kv_stats() == KVStats()  # every field None: it has no KV cache to report
    with pytest.raises(ModelNotFound):
        ReverseEngine({"model": str(tmp_path / "missing")}).load()


def test_drop_policy_ignores_unsupported_parameters(tmp_path: Path) -> None:
    with ReverseEngine({"model": str(tmp_path), "unsupported_params": "drop"}) as engine:
        assert engine.generate("a b", top_p=0.5, seed=1).text == "b a"


def test_registers_through_its_hook() -> None:
    registry = Registry(builtins=False, entry_points=False)
    registry.register_plugin(unillm_reverse, name="reverse")
    assert registry.failures == []
    assert registry.get("Reverse") is ReverseEngine
    assert registry.backends()["reverse"].source == "reverse"
