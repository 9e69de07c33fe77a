"""The Engine contract, exercised through MockEngine (the real base-class machinery)."""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import Iterator

import pytest

from unillm import (
    Capabilities,
    ConfigError,
    EngineClosed,
    GenerationError,
    Request,
    SamplingParams,
    UnillmWarning,
    UnsupportedParameter,
)
from unillm.testing import MockEngine, check_engine

REPLY = "Paris is the capital of France. It has <|end|> many museums."


def engine(reply: str = REPLY, **kw: object) -> MockEngine:
    return MockEngine(lambda _p, _s: reply, **kw).load()  # type: ignore[arg-type]


def test_generate_is_the_fold_of_stream() -> None:
    e = engine()
    chunks = list(e.stream("q"))
    done = e.generate("q")
    assert "".join(c.text for c in chunks) == done.text == REPLY
    assert tuple(i for c in chunks for i in c.token_ids) == done.token_ids
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == done.finish_reason == "stop"


def test_stop_string_across_token_boundaries_is_never_emitted() -> None:
    # the mock emits word-sized tokens: "<|end|>" arrives split as " <|" + "end|>"
    e = MockEngine(lambda _p, _s: [" has", " <|", "end", "|>", " more"]).load()
    chunks = list(e.stream("q", stop=["<|end|>"]))
    text = "".join(c.text for c in chunks)
    assert text == " has "
    assert all("<|" not in c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_stop_string_inside_one_token() -> None:
    done = engine().generate("q", stop=["capital"])
    assert done.text == "Paris is the "
    assert done.finish_reason == "stop"


def test_max_tokens_and_length_finish() -> None:
    done = engine().generate("q", max_tokens=3)
    assert done.text == "Paris is the"
    assert done.finish_reason == "length"
    assert done.usage.completion_tokens == 3 == len(done.token_ids)


def test_usage_and_timings_are_present_and_ordered() -> None:
    done = engine().generate("one two three")
    assert done.usage.prompt_tokens == 3
    assert done.usage.total_tokens == 3 + done.usage.completion_tokens
    t = done.timings
    assert 0 <= t.ttft_s <= t.total_s
    assert t.decode_s >= 0 and t.source == "wall"
    assert t.decode_tokens_per_s is None or t.decode_tokens_per_s > 0


def test_async_mirrors_sync() -> None:
    e = engine()

    async def main() -> tuple[str, str, str]:
        parts = [c.text async for c in e.astream("q")]
        done = await e.agenerate("q")
        chat = await e.achat([{"role": "user", "content": "hi"}])
        return "".join(parts), done.text, chat.text

    streamed, generated, chatted = asyncio.run(main())
    assert streamed == generated == chatted == e.generate("q").text


def test_async_cancellation_stops_generation_and_frees_the_engine() -> None:
    produced: list[int] = []
    release = threading.Event()

    def slow(_p: str, _s: SamplingParams):  # type: ignore[no-untyped-def]
        for i in range(1000):
            produced.append(i)
            release.wait(0.01)
            yield f" t{i}"

    e = MockEngine(slow).load()

    async def main() -> None:
        streaming = asyncio.Event()

        async def consume() -> None:
            async for _ in e.astream("q", max_tokens=1000):
                streaming.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(streaming.wait(), 60)  # cancelled mid-stream, once tokens come
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    # the worker stops at the next token; the engine lock is then free again
    done = MockEngine.generate(e, "q", max_tokens=2)
    assert done.usage.completion_tokens == 2
    assert len(produced) < 1000


def test_breaking_a_stream_leaves_the_engine_usable() -> None:
    e = engine()
    for i, _ in enumerate(e.stream("q")):
        if i == 2:
            break
    assert e.generate("q").text == REPLY


def test_chat_uses_the_template() -> None:
    e = engine()
    e.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital?"}])
    assert e.requests[-1] == "<system>Be brief.</system>\n<user>Capital?</user>\n<assistant>"


@pytest.mark.parametrize(
    "messages",
    [[], [{"role": "wizard", "content": "x"}], [{"content": "no role"}], [{"role": "user", "content": 3}]],
)
def test_bad_chat_messages_are_config_errors(messages: list[dict[str, object]]) -> None:
    with pytest.raises(ConfigError):
        engine().chat(messages)  # type: ignore[arg-type]


def test_no_template_is_a_clear_error() -> None:
    e = MockEngine("x", chat_template=None).load()
    e.config = e.config.model_copy(update={"chat_template": None})
    with pytest.raises(ConfigError, match="no chat template"):
        e.chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("field", "value", "fix"),
    [("temperature", -0.5, "greater than or equal to 0"), ("top_p", 1.5, "less than or equal to 1")],
)
def test_bad_sampling_values_are_typed_errors(field: str, value: float, fix: str) -> None:
    with pytest.raises(ConfigError, match=fix) as err:
        SamplingParams(**{field: value})
    assert field in str(err.value)
    with pytest.raises(ConfigError):
        engine().generate("q", **{field: value})


def test_min_tokens_above_max_tokens_is_refused_at_once() -> None:
    # vLLM would refuse it only when the request reaches it; every backend refuses it here
    with pytest.raises(ConfigError, match=r"min_tokens \(20\) is more than max_tokens \(10\)"):
        SamplingParams(min_tokens=20, max_tokens=10)
    with pytest.raises(ConfigError, match="min_tokens"):
        engine().generate("q", min_tokens=20, max_tokens=10)
    assert SamplingParams(min_tokens=10, max_tokens=10).min_tokens == 10


def test_unknown_sampling_field_is_refused() -> None:
    with pytest.raises(ConfigError, match="tempreature: unknown field"):
        SamplingParams(tempreature=0.1)  # type: ignore[call-arg]


NARROW = Capabilities(sampling=frozenset({"max_tokens", "temperature", "stop"}))


def test_unsupported_parameter_strict_raises_with_the_fix() -> None:
    e = MockEngine(REPLY, capabilities=NARROW).load()
    with pytest.raises(UnsupportedParameter, match="top_k") as err:
        e.generate("q", top_k=5)
    assert "unsupported_params" in str(err.value)
    assert e.generate("q", top_k=None).text == REPLY  # the default is never "unsupported"


def test_unsupported_parameter_warn_and_drop() -> None:
    warn = MockEngine(REPLY, capabilities=NARROW, unsupported_params="warn").load()
    with pytest.warns(UnillmWarning, match="ignores top_k") as caught:
        assert warn.generate("q", top_k=5).text == REPLY
    # the warning points at the caller's line (generate calls stream inside unillm)
    assert caught[0].filename == __file__
    drop = MockEngine(REPLY, capabilities=NARROW, unsupported_params="drop").load()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert drop.generate("q", top_k=5).text == REPLY


def test_generating_before_load_or_after_close_is_an_error() -> None:
    e = MockEngine(REPLY)
    with pytest.raises(EngineClosed, match="load"):
        e.generate("q")
    with e:
        assert e.generate("q").text == REPLY
    with pytest.raises(EngineClosed):
        e.generate("q")


def test_threads_are_serialized() -> None:
    inside = 0
    peak = 0
    lock = threading.Lock()

    def respond(_p: str, _s: SamplingParams):  # type: ignore[no-untyped-def]
        nonlocal inside, peak
        with lock:
            inside += 1
            peak = max(peak, inside)
        for w in ("a", " b", " c"):
            threading.Event().wait(0.002)
            yield w
        with lock:
            inside -= 1

    e = MockEngine(respond).load()
    results: list[str] = []

    def work() -> None:
        results.append(e.generate("q").text)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ["a b c"] * 8
    assert peak == 1


def test_nested_stream_in_the_same_thread_is_refused() -> None:
    e = engine()
    outer = e.stream("q")
    next(outer)
    with pytest.raises(GenerationError, match="one sequence at a time"):
        e.generate("q")
    outer.close()  # type: ignore[attr-defined]
    assert e.generate("q").text == REPLY


def test_mock_engine_passes_the_conformance_suite() -> None:
    assert "stop-strings" in check_engine(engine())


def test_kv_stats_unknown_fields_are_none() -> None:
    stats = engine().kv_stats()
    assert stats.capacity_tokens == 4096
    assert stats.bytes_per_token is None and stats.prefix_hit_rate is None


def test_mock_engine_loads_through_a_registry() -> None:
    from unillm import Registry, load_engine

    reg = Registry(builtins=False, entry_points=False)
    reg.register_backend(MockEngine)
    e = load_engine({"model": "anything", "backend": "mock", "context_length": 64}, registry=reg)
    assert e.name == "mock" and e.kv_stats().capacity_tokens == 64
    assert e.generate("q").finish_reason == "stop"


def test_check_closed_on_a_never_loaded_and_a_closed_engine() -> None:
    from unillm.testing import check_closed

    e = MockEngine(REPLY)
    assert "generate" in check_closed(e)  # never loaded
    e.load()
    e.close()
    check_closed(e)


class TextOnly(MockEngine):
    """A backend that streams text without ids and knows its count otherwise (a remote server's
    usage event, say): it sets ``req.completion_tokens``."""

    def _stream(
        self, prepared: str, params: SamplingParams, req: Request
    ) -> Iterator[tuple[str, tuple[int, ...], None]]:
        n = 0
        for text, _ids, lp in super()._stream(prepared, params, req):
            n += 1
            yield text, (), lp
        req.completion_tokens = n


def test_a_backend_that_streams_no_ids_gives_its_own_count() -> None:
    e = TextOnly(lambda _p, _s: "one two three four").load()
    done = e.generate("x", max_tokens=50)
    assert done.token_ids == () and done.text == "one two three four"
    assert done.usage.completion_tokens == 4
    t = done.timings
    assert t.decode_tokens_per_s is None or t.decode_tokens_per_s == pytest.approx(3 / t.decode_s)
    # left None, the count is the ids streamed: what every built-in backend relies on
    assert MockEngine(lambda _p, _s: "a b").load().generate("x").usage.completion_tokens == 2
