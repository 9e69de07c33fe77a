"""The conformance kit: the engine contract as pytest tests a backend's own suite switches on in a line.

    # tests/test_conformance.py of a plugin
    from unillm.testing import Conformance

    class TestConformance(Conformance):
        pass

with fixtures in the plugin's ``conftest.py`` (any scope; module or session keeps it quick):

``unillm_engine`` (required)
    a loaded engine of the backend under test, deterministic at temperature 0.
``unillm_engine_factory`` (optional)
    a callable returning a fresh, *unloaded* engine of the same configuration: the checks that
    close an engine (close while streaming, close twice) use their own and leave ``unillm_engine``
    alone. Without it those checks skip.
``unillm_reference`` (optional)
    a loaded engine of another backend on the same weights (llama.cpp on the GGUF of the same
    tensors, say): greedy tokens, finish reasons and counts must agree (``check_parity``, which
    tells near-ties from bugs). Without it the parity check skips.
``unillm_embed_engine`` (required when the backend declares ``capabilities.embeddings``)
    a loaded engine of the backend for embeddings (``task="embed"``): the embed checks use it.
``unillm_embed_reference`` (optional)
    a loaded embedding engine of another backend on the same weights and pooling: the vectors must
    agree (cosine >= 0.999, ``check_parity``). Without it that check skips.
``unillm_missing_model`` (optional)
    a model path the backend would take but that does not exist; default: a ``.gguf``-less
    directory name under the system's temp dir. Loading it must raise ``ModelNotFound`` or
    another ``ModelLoadError``/``ConfigError``.

Every check is a test of its own, so a failure names the rule broken. A skipped check says why.
A backend for which a rule cannot apply turns that check off in its subclass, with the reason:

    class TestConformance(Conformance):
        test_a_missing_model_is_a_typed_error = None  # a remote server: no model files here
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from unillm._contract._engine import Engine
from unillm._errors import (
    ConfigError,
    ContextLengthExceeded,
    EngineClosed,
    ModelLoadError,
    UnsupportedParameter,
)
from unillm._types import KVStats, SamplingParams
from unillm.testing._conformance import check_closed

__all__ = ["Conformance"]

PROMPT = "The quick brown fox"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
HELLO = [{"role": "user", "content": "Why is the sky blue?"}]
AnyEngine = Engine[Any]

# A non-default value for each sampling parameter a backend may declare: passing it must work.
PROBES: dict[str, Any] = {
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "seed": 7,
    "stop_token_ids": (0,),
    "ignore_eos": True,
    "min_tokens": 2,
    "logprobs": 0,  # the chosen token's; above 0 is top_logprobs, probed on its own
    "logit_bias": {0: -1.0},
    "response_format": {"type": "json_object"},
}


def _greedy(**update: Any) -> SamplingParams:
    return GREEDY.model_copy(update=update)


def _optional(request: pytest.FixtureRequest, name: str) -> Any:
    try:
        return request.getfixturevalue(name)
    except pytest.FixtureLookupError:
        return None


class Conformance:
    """The engine contract, one test per rule. Subclass it in a test module (see the module doc)."""

    # ---- generation ----

    def test_generate_equals_the_joined_stream(self, unillm_engine: AnyEngine) -> None:
        chunks = list(unillm_engine.stream(PROMPT, GREEDY))
        full = unillm_engine.generate(PROMPT, GREEDY)
        assert "".join(c.text for c in chunks) == full.text
        assert tuple(i for c in chunks for i in c.token_ids) == full.token_ids
        assert full.finish_reason == chunks[-1].finish_reason
        if unillm_engine.capabilities.token_ids:
            assert full.token_ids, "capabilities.token_ids is True but no chunk carried token ids"
        else:
            assert not full.token_ids, "capabilities.token_ids is False but chunks carried token ids"

    def test_only_the_last_chunk_finishes_with_usage_and_timings(self, unillm_engine: AnyEngine) -> None:
        chunks = list(unillm_engine.stream(PROMPT, GREEDY))
        last = chunks[-1]
        assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
        assert last.finish_reason in ("stop", "length"), last
        assert last.usage is not None and last.timings is not None, last
        t = last.timings
        assert 0 <= t.ttft_s <= t.total_s, t
        assert t.prefill_s >= 0 and t.decode_s >= 0, t
        assert last.usage.prompt_tokens > 0, last.usage
        if unillm_engine.capabilities.token_ids:
            n = sum(len(c.token_ids) for c in chunks)
            assert last.usage.completion_tokens == n <= GREEDY.max_tokens, (last.usage, n)
        else:  # text only: the count is the engine's (a server's usage, or counted client-side)
            assert 0 < last.usage.completion_tokens <= GREEDY.max_tokens, last.usage

    def test_max_tokens_is_honoured_with_finish_reason_length(self, unillm_engine: AnyEngine) -> None:
        for k in (1, 3):
            out = unillm_engine.generate(PROMPT, _greedy(max_tokens=k, ignore_eos=False))
            assert out.usage.completion_tokens <= k
            if out.usage.completion_tokens == k:
                assert out.finish_reason == "length", out
            else:
                assert out.finish_reason == "stop", out  # the model ended first

    def test_a_stop_string_across_chunks_cuts_before_it(self, unillm_engine: AnyEngine) -> None:
        chunks = list(unillm_engine.stream(PROMPT, _greedy(max_tokens=16)))
        text = "".join(c.text for c in chunks)
        # a stop string made of the end of one chunk and the start of the next
        ends = [len("".join(c.text for c in chunks[: i + 1])) for i in range(len(chunks) - 1)]
        cuts = [e for e in ends if 0 < e < len(text) and text[e - 1 : e + 1].strip() and e > 1]
        if not cuts:
            pytest.skip(f"the greedy output {text!r} has no chunk boundary to stop across")
        e = cuts[len(cuts) // 2]
        stop = text[e - 1 : e + 1]
        want = text[: text.find(stop)]
        out = unillm_engine.generate(PROMPT, _greedy(max_tokens=16, stop=(stop,)))
        assert (out.text, out.finish_reason, out.stop_sequence) == (want, "stop", stop), (stop, out)
        streamed = list(unillm_engine.stream(PROMPT, _greedy(max_tokens=16, stop=(stop,))))
        assert "".join(c.text for c in streamed) == want  # never emitted, not even in pieces

    def test_chat_renders_the_template_and_answers(self, unillm_engine: AnyEngine) -> None:
        if not unillm_engine.capabilities.chat:
            pytest.skip("capabilities.chat is False")
        try:
            rendered = unillm_engine.render_chat(HELLO)
        except ConfigError:
            pass  # no template here (a server applies its own): chat() must still answer
        else:
            assert isinstance(rendered, str) and "Why is the sky blue?" in rendered
        out = unillm_engine.chat(HELLO, GREEDY)
        assert out.usage.prompt_tokens > 0 and out.finish_reason in ("stop", "length")
        joined = "".join(c.text for c in unillm_engine.stream_chat(HELLO, GREEDY))
        assert joined == out.text

    # ---- async mirrors and cancellation ----

    def test_async_mirrors_equal_the_sync_calls(self, unillm_engine: AnyEngine) -> None:
        full = unillm_engine.generate(PROMPT, GREEDY)

        async def both() -> tuple[str, str]:
            a = await unillm_engine.agenerate(PROMPT, GREEDY)
            s = "".join([c.text async for c in unillm_engine.astream(PROMPT, GREEDY)])
            return a.text, s

        assert asyncio.run(both()) == (full.text, full.text)

    def test_a_broken_stream_leaves_the_engine_usable(self, unillm_engine: AnyEngine) -> None:
        full = unillm_engine.generate(PROMPT, GREEDY)
        stream = unillm_engine.stream(PROMPT, GREEDY)
        next(iter(stream))
        stream.close()  # type: ignore[attr-defined]
        assert unillm_engine.generate(PROMPT, GREEDY).text == full.text

    def test_a_cancelled_async_stream_leaves_the_engine_usable(self, unillm_engine: AnyEngine) -> None:
        full = unillm_engine.generate(PROMPT, GREEDY)

        async def cancel_then_generate() -> str:
            started = asyncio.Event()

            async def consume() -> None:
                async for _ in unillm_engine.astream(PROMPT, _greedy(max_tokens=64)):
                    started.set()
                    await asyncio.sleep(0)

            task = asyncio.create_task(consume())
            await asyncio.wait_for(started.wait(), 120)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return (await unillm_engine.agenerate(PROMPT, GREEDY)).text

        assert asyncio.run(cancel_then_generate()) == full.text

    def test_two_threads_at_once_both_get_their_answer(self, unillm_engine: AnyEngine) -> None:
        want = unillm_engine.generate(PROMPT, GREEDY).text
        got: list[Any] = [None, None]

        def work(i: int) -> None:
            try:
                got[i] = unillm_engine.generate(PROMPT, GREEDY).text
            except BaseException as exc:
                got[i] = exc

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert got == [want, want], got

    # ---- state and errors ----

    def test_kv_stats_are_typed_and_unknown_is_none_not_zero(self, unillm_engine: AnyEngine) -> None:
        stats = unillm_engine.kv_stats()
        assert isinstance(stats, KVStats)
        for f in dataclasses.fields(stats):
            value = getattr(stats, f.name)
            if f.name == "dtype":
                assert value is None or (isinstance(value, str) and value), (f.name, value)
            else:
                assert value is None or (isinstance(value, int) and not isinstance(value, bool)), (
                    f.name,
                    value,
                )
                assert value is None or value >= 0, (f.name, value)
        for total in ("capacity_tokens", "capacity_bytes", "total_blocks", "block_size", "bytes_per_token"):
            # a capacity of zero is a number nobody measured: say None instead
            assert getattr(stats, total) != 0, f"kv_stats().{total} is 0: unknown must be None"
        if stats.capacity_tokens is not None and stats.used_tokens is not None:
            assert stats.used_tokens <= stats.capacity_tokens, stats
        if stats.prefix_cache_queries is not None and stats.prefix_cache_hits is not None:
            assert stats.prefix_cache_hits <= stats.prefix_cache_queries, stats

    def test_tokenize_and_detokenize_round_trip(self, unillm_engine: AnyEngine) -> None:
        try:
            ids = unillm_engine.tokenize(PROMPT)
        except NotImplementedError:
            pytest.skip("the backend has no tokenizer")
        assert ids and all(isinstance(i, int) for i in ids)
        assert unillm_engine.detokenize(ids) == PROMPT

    def test_a_prompt_over_the_context_is_a_typed_error(self, unillm_engine: AnyEngine) -> None:
        n = unillm_engine.context_length
        if n is None:
            pytest.skip("the engine reports no context_length")
        words = " ".join(["fox"] * (n + 16))
        with pytest.raises(ContextLengthExceeded):
            unillm_engine.generate(words, GREEDY)
        assert unillm_engine.generate(PROMPT, GREEDY).usage.completion_tokens > 0  # still usable

    def test_a_missing_model_is_a_typed_error(
        self, request: pytest.FixtureRequest, unillm_engine: AnyEngine
    ) -> None:
        missing = _optional(request, "unillm_missing_model") or str(
            Path(tempfile.gettempdir()) / "unillm-conformance-no-such-model"
        )
        engine = type(unillm_engine)(model=missing)
        with pytest.raises((ModelLoadError, ConfigError)):
            engine.load()
        engine.close()

    def test_capabilities_match_behaviour(self, unillm_engine: AnyEngine) -> None:
        sampling = unillm_engine.capabilities.sampling
        for name in sorted(sampling & PROBES.keys()):
            out = unillm_engine.generate(PROMPT, _greedy(max_tokens=4, **{name: PROBES[name]}))
            assert out.finish_reason in ("stop", "length"), (name, out)
        if "logprobs" in sampling:
            out = unillm_engine.generate(PROMPT, _greedy(logprobs=0))
            assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids), out
            assert all(lp <= 0.0 for lp in out.logprobs), out.logprobs
        if "top_logprobs" in sampling:  # logprobs above 0: k alternatives per token, likeliest first
            out = unillm_engine.generate(PROMPT, _greedy(logprobs=2))
            assert out.top_logprobs is not None and len(out.top_logprobs) == len(out.token_ids), out
            for top in out.top_logprobs:
                assert len(top) == 2 and top[0][1] >= top[1][1] and all(v <= 0.0 for _, v in top), top
        elif "logprobs" in sampling and unillm_engine.config.unsupported_params == "strict":
            with pytest.raises(UnsupportedParameter):  # never an empty top_logprobs
                unillm_engine.generate(PROMPT, _greedy(logprobs=2))
        if "min_tokens" in sampling:
            out = unillm_engine.generate(PROMPT, _greedy(min_tokens=3, max_tokens=4))
            assert out.usage.completion_tokens >= 3, out
        if "seed" in sampling and "temperature" in sampling:
            hot = _greedy(temperature=1.0, seed=11, max_tokens=8)
            assert unillm_engine.generate(PROMPT, hot).text == unillm_engine.generate(PROMPT, hot).text
        unsupported = sorted(PROBES.keys() - sampling)
        if "response_format" in unsupported:  # never dropped, whatever the policy
            with pytest.raises(UnsupportedParameter):
                unillm_engine.generate(PROMPT, response_format={"type": "json_object"})
        if unillm_engine.config.unsupported_params == "strict":
            for name in unsupported:
                with pytest.raises(UnsupportedParameter):
                    unillm_engine.generate(PROMPT, _greedy(**{name: PROBES[name]}))

    # ---- lifetime ----

    def test_close_while_streaming_then_close_twice(self, request: pytest.FixtureRequest) -> None:
        factory: Callable[[], Engine[Any]] | None = _optional(request, "unillm_engine_factory")
        if factory is None:
            pytest.skip("no unillm_engine_factory fixture: the kit closes only engines it owns")
        engine = factory().load()
        stream = iter(engine.stream(PROMPT, _greedy(max_tokens=64)))
        next(stream)
        engine.close()
        try:
            rest = list(stream)  # either ends or says the engine closed; never hangs or crashes
        except EngineClosed:
            rest = []
        assert all(c.text is not None for c in rest)
        engine.close()  # twice is fine
        assert check_closed(engine)

    def test_an_unloaded_engine_raises_engine_closed(self, request: pytest.FixtureRequest) -> None:
        factory: Callable[[], Engine[Any]] | None = _optional(request, "unillm_engine_factory")
        if factory is None:
            pytest.skip("no unillm_engine_factory fixture")
        assert check_closed(factory())

    # ---- parity ----

    def test_greedy_parity_with_the_reference_engine(
        self, request: pytest.FixtureRequest, unillm_engine: AnyEngine
    ) -> None:
        reference: Engine[Any] | None = _optional(request, "unillm_reference")
        if reference is None:
            pytest.skip("no unillm_reference fixture: parity is checked against a reference engine")
        from unillm.testing._parity import check_parity

        prompts = [PROMPT, "Hello world", "Why is the sky blue?", "0 1 2 3", "Paris is the capital of"]
        report = check_parity({"reference": reference, "engine": unillm_engine}, prompts, max_tokens=16)
        report.assert_parity(min_share=0.8)  # and every other difference a near-tie

    # ---- embeddings: every backend that declares capabilities.embeddings ----

    def _embedder(self, request: pytest.FixtureRequest, engine: AnyEngine) -> AnyEngine | None:
        """The engine the embed checks use; None (after checking that ``embed`` is refused with a
        typed error) for a backend that declares no embeddings."""
        if not type(engine).capabilities.embeddings:
            with pytest.raises(ConfigError):
                engine.embed(PROMPT)
            return None
        embedder: Engine[Any] | None = _optional(request, "unillm_embed_engine")
        if embedder is None:
            pytest.fail(
                f"{engine.name} declares capabilities.embeddings: give a unillm_embed_engine fixture (an "
                "engine loaded with task='embed') so the kit checks embed(), or turn these checks off "
                "in the subclass with the reason"
            )
        return embedder

    def test_embed_batches_like_one_text_at_a_time(
        self, request: pytest.FixtureRequest, unillm_engine: AnyEngine
    ) -> None:
        import numpy as np

        e = self._embedder(request, unillm_engine)
        if e is None:
            return
        texts = [PROMPT, "Hello world", "Why is the sky blue? " * 5, "0 1 2 3"]
        batch = e.embed(texts)
        assert batch.array().shape == (len(texts), batch.dimensions) and batch.dimensions > 0
        assert batch.usage.prompt_tokens >= len(texts)
        one = np.stack([e.embed(t).array()[0] for t in texts])
        cos = (batch.array() * one).sum(axis=1)  # both unit length
        assert cos.min() >= 0.999, f"a batch's vectors differ from one text at a time: cosines {cos}"

    def test_embed_normalizes_and_cuts_dimensions(
        self, request: pytest.FixtureRequest, unillm_engine: AnyEngine
    ) -> None:
        import numpy as np

        e = self._embedder(request, unillm_engine)
        if e is None:
            return
        unit = e.embed([PROMPT, "Hello world"]).array()
        assert np.allclose(np.linalg.norm(unit, axis=1), 1.0, atol=1e-4)
        raw = e.embed([PROMPT, "Hello world"], normalize=False).array()
        assert np.allclose(unit, raw / np.linalg.norm(raw, axis=1, keepdims=True), atol=1e-4)
        half = max(1, unit.shape[1] // 2)
        cut = e.embed([PROMPT], dimensions=half).array()
        head = raw[:1, :half]
        assert np.allclose(cut, head / np.linalg.norm(head), atol=1e-4)

    def test_embed_refuses_bad_input_with_a_typed_error(
        self, request: pytest.FixtureRequest, unillm_engine: AnyEngine
    ) -> None:
        e = self._embedder(request, unillm_engine)
        if e is None:
            return
        for bad in ("", [], ["ok", ""]):
            with pytest.raises(ConfigError):
                e.embed(bad)
        with pytest.raises(ConfigError):
            e.embed(PROMPT, dimensions=0)

    def test_embed_on_a_generation_engine_works_or_says_how(
        self, request: pytest.FixtureRequest, unillm_engine: AnyEngine
    ) -> None:
        if self._embedder(request, unillm_engine) is None:
            return
        try:
            got = unillm_engine.embed(PROMPT)
        except ConfigError as exc:
            assert "task=" in str(exc), f"the refusal does not say how to load for embed: {exc}"
        else:
            assert got.dimensions > 0

    def test_embed_parity_with_the_reference_engine(
        self, request: pytest.FixtureRequest, unillm_engine: AnyEngine
    ) -> None:
        e = self._embedder(request, unillm_engine)
        if e is None:
            return
        reference: Engine[Any] | None = _optional(request, "unillm_embed_reference")
        if reference is None:
            pytest.skip("no unillm_embed_reference fixture: vectors are checked against a reference engine")
        from unillm.testing._parity import check_parity

        prompts = [PROMPT, "Hello world", "Why is the sky blue?", "0 1 2 3", "Paris is the capital of"]
        check_parity({"reference": reference, "engine": e}, prompts).assert_parity()
