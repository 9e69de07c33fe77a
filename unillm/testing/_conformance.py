"""The conformance checks every backend passes: built-ins run them in CI, plugins should too.

    from unillm.testing import check_engine

    def test_my_engine_conforms(my_loaded_engine):
        check_engine(my_loaded_engine)

Each check uses greedy decoding, so the engine must be deterministic at temperature 0.
Failures raise ``AssertionError`` naming the check.
"""

from __future__ import annotations

import asyncio
from typing import Any

from unillm._contract._engine import Engine
from unillm._errors import EngineClosed
from unillm._types import KVStats, SamplingParams

__all__ = ["check_closed", "check_engine"]


def check_engine(engine: Engine[Any], prompt: str = "The quick brown fox", max_tokens: int = 12) -> list[str]:
    """Run the contract checks on a loaded ``engine``; return the names of the checks passed."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    passed: list[str] = []

    chunks = list(engine.stream(prompt, greedy))
    full = engine.generate(prompt, greedy)
    joined = "".join(c.text for c in chunks)
    _check(joined == full.text, "generate equals the joined stream", f"{joined!r} != {full.text!r}")
    ids = tuple(i for c in chunks for i in c.token_ids)
    _check(ids == full.token_ids, "stream and generate give the same token ids", f"{ids} != {full.token_ids}")
    passed.append("generate-equals-stream")

    last = chunks[-1]
    _check(
        last.finish_reason in ("stop", "length") and last.usage is not None and last.timings is not None,
        "the last chunk carries finish_reason, usage and timings",
        repr(last),
    )
    _check(all(c.finish_reason is None for c in chunks[:-1]), "only the last chunk finishes", "")
    t = full.timings
    _check(0 <= t.ttft_s <= t.total_s, "timings are ordered (0 <= ttft <= total)", repr(t))
    _check(full.usage.prompt_tokens > 0, "usage counts the prompt", repr(full.usage))
    if engine.capabilities.token_ids:
        _check(
            full.usage.completion_tokens == len(full.token_ids) <= max_tokens,
            "usage counts the completion, within max_tokens",
            f"{full.usage} vs {len(full.token_ids)} ids",
        )
    else:  # a backend that streams text only (a remote server): its count, within max_tokens
        _check(
            0 < full.usage.completion_tokens <= max_tokens and not full.token_ids,
            "usage counts the completion within max_tokens, and no ids are claimed",
            repr(full.usage),
        )
    passed.append("final-chunk")

    one = engine.generate(prompt, greedy.model_copy(update={"max_tokens": 1}))
    _check(
        one.usage.completion_tokens == 1 and one.finish_reason == "length",
        "max_tokens=1 gives one token and finish_reason 'length'",
        repr(one),
    )
    passed.append("max-tokens")

    text = full.text
    if len(text.strip()) >= 4:
        mid = len(text) // 2
        stop = text[mid : mid + 2]
        cut = engine.generate(prompt, greedy.model_copy(update={"stop": (stop,)}))
        want = text[: text.find(stop)]
        _check(
            cut.text == want and cut.finish_reason == "stop",
            "a stop string cuts the output before it and finishes with 'stop'",
            f"stop={stop!r}: got {cut.text!r} ({cut.finish_reason}), want {want!r}",
        )
        passed.append("stop-strings")

    stream = engine.stream(prompt, greedy)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()  # type: ignore[attr-defined]
    again = engine.generate(prompt, greedy)
    _check(again.text == full.text, "the engine generates the same after a broken stream", "")
    passed.append("break-and-resume")

    async_full = asyncio.run(engine.agenerate(prompt, greedy))
    _check(async_full.text == full.text, "agenerate equals generate", f"{async_full.text!r}")
    passed.append("async-mirror")

    _check(isinstance(engine.kv_stats(), KVStats), "kv_stats returns KVStats", "")
    passed.append("kv-stats")

    try:
        ids_rt = engine.tokenize(prompt)
    except NotImplementedError:
        pass
    else:
        _check(engine.detokenize(ids_rt) == prompt, "detokenize(tokenize(x)) == x", f"{ids_rt}")
        passed.append("tokenizer-round-trip")
    return passed


def check_closed(engine: Engine[Any]) -> list[str]:
    """Check that every public method of a closed (or never-loaded) ``engine`` raises
    ``EngineClosed``; return the names of the methods checked."""
    hello = [{"role": "user", "content": "hi"}]
    calls = {
        "kv_stats": engine.kv_stats,
        "tokenize": lambda: engine.tokenize("hi"),
        "detokenize": lambda: engine.detokenize([1]),
        "render_chat": lambda: engine.render_chat(hello),
        "chat": lambda: engine.chat(hello),
        "reset": engine.reset,
        "generate": lambda: engine.generate("hi"),
        "stream": lambda: engine.stream("hi"),
        "agenerate": lambda: asyncio.run(engine.agenerate("hi")),
    }
    for name, call in calls.items():
        try:
            call()
        except EngineClosed:
            continue
        raise AssertionError(f"conformance: {name}() on a closed engine did not raise EngineClosed")
    return list(calls)


def _check(ok: bool, what: str, detail: str) -> None:
    if not ok:
        raise AssertionError(f"conformance: {what} failed. {detail}".rstrip())
