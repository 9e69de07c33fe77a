"""The backend against ``unillm serve`` on llama.cpp, compared with the in-process llama.cpp
engine on the same GGUF: greedy text and usage equal, stops, chat, errors, tokenizer, KV
stats from the server's metrics, retries across a restart, cancellation and close."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from _procs import Proc, free_port, unillm_serve, wait_until
from pydantic import BaseModel
from unillm_openai_http._errors import (
    AuthenticationFailed,
    ServedModelNotFound,
    ServerRefused,
    ServerUnreachable,
)
from unillm_openai_http._metrics import kv_from_metrics
from unillm_openai_http.engine import OpenAIHTTPEngine

from unillm import (
    BackendUnavailable,
    ConfigError,
    EngineClosed,
    GenerationError,
    ModelNotFound,
    UnillmError,
    UnsupportedParameter,
)
from unillm.testing import Conformance, TinyModel, check_closed, check_engine, tiny_embedding_model

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("fastapi") is None,
    reason="unillm serve on llama.cpp needs unillm[server,llamacpp]",
)

KEY = "sk-plugin-test"
PROMPTS = ("The quick brown fox", "Once upon a time", "1, 2, 3,")
GREEDY = {"temperature": 0.0, "max_tokens": 16}
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server(tiny: TinyModel, logs: Path) -> Iterator[Proc]:
    s = unillm_serve(tiny.gguf_path, free_port(), logs / "unillm-serve.log").wait_ready("/ready")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def guarded(tiny: TinyModel, logs: Path) -> Iterator[Proc]:
    """A second server, behind an API key; the retry test restarts it on its port."""
    port = free_port()
    s = unillm_serve(tiny.gguf_path, port, logs / "guarded-1.log", "--api-key", KEY).wait_ready("/ready")
    yield s
    s.stop()  # the retry test stops it itself: stopping twice is harmless


@pytest.fixture(scope="module")
def engine(server: Proc) -> Iterator[OpenAIHTTPEngine]:
    with OpenAIHTTPEngine({"model": "tiny", "options": {"base_url": server.url + "/v1"}}) as e:
        yield e


@pytest.fixture(scope="module")
def local(tiny: TinyModel) -> Iterator[Any]:
    """The in-process llama.cpp engine on the same GGUF, loaded the way the server loads it."""
    from unillm.engines.llamacpp import LlamaCppEngine

    with LlamaCppEngine({"model": str(tiny.gguf_path)}) as e:
        yield e


def test_reads_what_the_server_is(engine: OpenAIHTTPEngine) -> None:
    assert engine.server_kind == "unillm"
    caps = engine.capabilities
    assert {"top_k", "min_p", "stop_token_ids", "seed"} <= caps.sampling and caps.token_prompts
    assert caps.batching  # the server schedules: callers are never serialized here


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_text_and_usage_equal_the_in_process_engine(
    engine: OpenAIHTTPEngine, local: Any, prompt: str
) -> None:
    theirs = local.generate(prompt, GREEDY)
    mine = engine.generate(prompt, GREEDY)
    assert (mine.text, mine.finish_reason) == (theirs.text, theirs.finish_reason)
    assert (mine.usage.prompt_tokens, mine.usage.completion_tokens) == (
        theirs.usage.prompt_tokens,
        theirs.usage.completion_tokens,
    )
    assert asyncio.run(engine.agenerate(prompt, GREEDY)).text == theirs.text
    # token-id prompts go to the server as ids
    assert (
        engine.generate(local.tokenize(prompt), GREEDY).text
        == local.generate(local.tokenize(prompt), GREEDY).text
    )


def test_streams_piece_by_piece_with_usage_and_timings_last(engine: OpenAIHTTPEngine, local: Any) -> None:
    chunks = list(engine.stream(PROMPTS[0], GREEDY))
    assert len(chunks) > 2 and all(c.finish_reason is None for c in chunks[:-1])
    assert "".join(c.text for c in chunks) == local.generate(PROMPTS[0], GREEDY).text
    last = chunks[-1]
    assert last.finish_reason == "length" and last.usage is not None and last.timings is not None
    assert last.usage.completion_tokens == GREEDY["max_tokens"]
    assert last.usage.cached_prompt_tokens is not None  # the server reports its prefix cache
    assert engine.usage_source == "server"
    t = last.timings
    assert t.source == "wall" and 0 < t.ttft_s <= t.total_s
    assert t.decode_tokens_per_s is None or t.decode_tokens_per_s > 0
    assert t.prefill_tokens_per_s is not None and t.prefill_tokens_per_s > 0


def test_concurrent_streams_are_not_serialized_here(engine: OpenAIHTTPEngine, local: Any) -> None:
    async def all_at_once() -> list[str]:
        done = await asyncio.gather(*(engine.agenerate(p, GREEDY) for p in PROMPTS * 2))
        return [d.text for d in done]

    assert asyncio.run(all_at_once()) == [local.generate(p, GREEDY).text for p in PROMPTS * 2]


def test_max_tokens_one_is_one_token_and_length(engine: OpenAIHTTPEngine, local: Any) -> None:
    one = engine.generate(PROMPTS[0], {**GREEDY, "max_tokens": 1})
    want = local.generate(PROMPTS[0], {**GREEDY, "max_tokens": 1})
    assert (one.text, one.usage.completion_tokens, one.finish_reason) == (want.text, 1, "length")


def test_a_stop_string_cuts_as_in_process(engine: OpenAIHTTPEngine, local: Any) -> None:
    text = local.generate(PROMPTS[1], GREEDY).text
    stop = next(text[i : i + 2] for i in range(2, len(text) - 2) if text[i : i + 2].strip())
    want = local.generate(PROMPTS[1], {**GREEDY, "stop": [stop]})
    got = engine.generate(PROMPTS[1], {**GREEDY, "stop": [stop]})
    assert (got.text, got.finish_reason) == (want.text, "stop") and stop not in got.text


def test_chat_goes_through_the_servers_template(engine: OpenAIHTTPEngine, local: Any) -> None:
    want = local.chat(HELLO, GREEDY)
    got = engine.chat(HELLO, GREEDY)
    assert (got.text, got.usage.prompt_tokens) == (want.text, want.usage.prompt_tokens)
    assert asyncio.run(engine.achat(HELLO, GREEDY)).text == want.text
    streamed = list(engine.stream_chat(HELLO, GREEDY))
    assert "".join(c.text for c in streamed) == want.text


def test_a_configured_chat_template_is_rendered_here(server: Proc, local: Any) -> None:
    config = {
        "model": "tiny",
        "chat_template": "{{ messages[-1]['content'] }}!"
        "{% for t in tools or [] %} {{ t.function.name }}{% endfor %}",
        "options": {"base_url": server.url},
    }
    with OpenAIHTTPEngine(config) as e:
        assert e.render_chat(HELLO) == "Say hello.!"
        assert e.chat(HELLO, GREEDY).text == local.generate("Say hello.!", GREEDY).text
        assert asyncio.run(e.achat(HELLO, GREEDY)).text == local.generate("Say hello.!", GREEDY).text
        # tools are rendered here too, as in-process (the tiny model calls none: plain text back)
        tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
        said = e.chat(HELLO, GREEDY, tools=[tool])
        assert said.text == local.generate("Say hello.! lookup", GREEDY).text and not said.tool_calls


def test_tokenizer_round_trip_is_the_engines(engine: OpenAIHTTPEngine, local: Any) -> None:
    text = "The quick brown fox jumps"
    ids = engine.tokenize(text)
    assert ids == local.tokenize(text)
    assert engine.detokenize(ids) == text


def test_kv_stats_come_from_the_servers_metrics(engine: OpenAIHTTPEngine, server: Proc) -> None:
    before = engine.kv_stats()
    assert before.prefix_cache_queries is not None and before.prefix_cache_hits is not None
    done = engine.generate("A prompt of its own, never sent before", GREEDY)
    after = engine.kv_stats()
    assert after.prefix_cache_queries is not None and after.prefix_cache_hits is not None
    assert after.prefix_cache_queries - before.prefix_cache_queries == done.usage.prompt_tokens
    assert after.prefix_cache_hits - before.prefix_cache_hits == done.usage.cached_prompt_tokens
    assert after.capacity_tokens is None  # a usage fraction alone says no token counts: None, not 0
    assert kv_from_metrics(httpx.get(server.url + "/metrics").text, "tiny") == after


class Thing(BaseModel):
    kind: Literal["a", "b"]
    n: int
    ok: bool


def test_a_response_format_is_sent_and_the_server_enforces_it(engine: OpenAIHTTPEngine) -> None:
    finished = 0
    for seed in range(6):
        done = engine.generate("x", response_format=Thing, temperature=1.0, seed=seed, max_tokens=120)
        if done.finish_reason == "stop":
            finished += 1
            assert isinstance(done.parsed(), Thing), done.text
    assert finished >= 4, finished
    unique = {"type": "object", "properties": {"n": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(ServerRefused) as info:  # unillm serve refuses what no engine enforces
        engine.generate("x", response_format=unique)
    assert info.value.status == 400 and "uniqueItems" in str(info.value)
    bounded = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}}
    for seed in range(3):  # bounds, which llama.cpp's grammar once refused, hold through the server
        value = engine.generate("x", response_format=bounded, temperature=1.0, seed=seed, max_tokens=40)
        assert 1 <= value.parsed().get("n", 1) <= 9, value.text


def test_refuses_what_it_cannot_send(engine: OpenAIHTTPEngine) -> None:
    with pytest.raises(UnsupportedParameter, match="logprobs"):
        engine.generate("hi", logprobs=1)
    with pytest.raises(ServerRefused) as info:  # the server's own range check: 400
        engine.generate("hi", temperature=3.0)
    assert info.value.status == 400 and "temperature" in str(info.value)
    with pytest.raises(ServerRefused) as big:  # over the server's body limit (4 MiB)
        engine.generate("word " * (1 << 20))
    assert big.value.status == 413 and isinstance(big.value, ConfigError)


def test_an_unknown_model_is_model_not_found(server: Proc) -> None:
    with pytest.raises(ServedModelNotFound) as info:
        OpenAIHTTPEngine({"model": "no-such-model", "options": {"base_url": server.url}}).load()
    assert isinstance(info.value, ModelNotFound) and info.value.served == ["tiny"]
    assert "'tiny'" in str(info.value) and server.url in str(info.value)


def test_a_bad_or_missing_key_is_an_authentication_error(guarded: Proc) -> None:
    for key in ("sk-wrong", None):
        options: dict[str, Any] = {"base_url": guarded.url, "retries": 0}
        if key:
            options["api_key"] = key
        with pytest.raises(AuthenticationFailed) as info:
            OpenAIHTTPEngine({"model": "tiny", "options": options}).load()
        assert info.value.status == 401 and isinstance(info.value, UnillmError)
    with OpenAIHTTPEngine({"model": "tiny", "options": {"base_url": guarded.url, "api_key": KEY}}) as e:
        assert e.generate(PROMPTS[0], GREEDY).usage.completion_tokens == GREEDY["max_tokens"]


def test_a_refused_connection_says_the_url_and_what_to_check() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerUnreachable) as info:
        OpenAIHTTPEngine(
            {"model": "tiny", "options": {"base_url": url, "retries": 2, "retry_backoff_s": 0.01}}
        ).load()
    assert isinstance(info.value, BackendUnavailable)
    assert url in str(info.value) and "connection refused" in str(info.value) and "running" in str(info.value)


def test_retries_carry_a_request_across_a_server_restart(
    guarded: Proc, tiny: TinyModel, logs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    options = {
        "base_url": guarded.url,
        "api_key": KEY,
        "retries": 200,
        "retry_backoff_s": 0.05,
        "max_backoff_s": 0.2,
    }
    with OpenAIHTTPEngine({"model": "tiny", "options": options}) as e:
        first = e.generate(PROMPTS[2], GREEDY)
        # mid-stream, the server goes: the half-streamed request fails, and is never replayed
        stream = e.stream(PROMPTS[2], {**GREEDY, "max_tokens": 3900, "ignore_eos": True})
        next(stream)
        sent: list[str] = []  # the requests sent from here on, counted where httpx sends them
        send = httpx.Client.send

        def counted(client: httpx.Client, request: httpx.Request, **kwargs: Any) -> httpx.Response:
            sent.append(f"{request.method} {request.url.path}")
            return send(client, request, **kwargs)

        with pytest.MonkeyPatch.context() as patched:
            patched.setattr(httpx.Client, "send", counted)
            guarded.kill()
            with pytest.raises(GenerationError):
                for _ in stream:
                    pass
            assert sent == []  # no retry loop behind it: the request is not sent again, nor any other
            # the next request finds nothing listening, retries, and is answered once it is back
            again = unillm_serve(tiny.gguf_path, guarded.port, logs / "guarded-2.log", "--api-key", KEY)
            try:
                with caplog.at_level(logging.INFO, logger="unillm_openai_http"):
                    second = e.generate(PROMPTS[2], GREEDY)
                assert second.text == first.text
                assert any("retrying" in r.getMessage() for r in caplog.records)
                assert len(sent) >= 2, sent  # these retries were counted: the count above saw sends
            finally:
                again.stop()


def _aborted(server: Proc) -> float:
    """Requests the server counted as ended by a client gone."""
    text = httpx.get(server.url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("unillm:request_success_total") and 'finished_reason="abort"' in line
    )


def test_breaking_out_closes_the_request_on_the_server(engine: OpenAIHTTPEngine, server: Proc) -> None:
    def aborted() -> float:
        return _aborted(server)

    before = aborted()
    stream = engine.stream(PROMPTS[0], {"temperature": 0.0, "max_tokens": 3000, "ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # type: ignore[attr-defined]
    wait_until(lambda: aborted() == before + 1, 20, "the server to count the request as aborted")
    assert engine.generate(PROMPTS[0], GREEDY).finish_reason == "length"  # the engine goes on


def test_cancelling_an_async_stream_closes_the_request_on_the_server(
    engine: OpenAIHTTPEngine, server: Proc
) -> None:
    before = _aborted(server)

    async def consume(started: asyncio.Event) -> None:
        params = {"temperature": 0.0, "max_tokens": 3000, "ignore_eos": True}
        async for _ in engine.astream(PROMPTS[1], params):
            started.set()

    async def cancel_it() -> None:
        started = asyncio.Event()
        task = asyncio.create_task(consume(started))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_it())
    wait_until(lambda: _aborted(server) == before + 1, 20, "the server to count the request as aborted")


def test_conformance_checks(engine: OpenAIHTTPEngine) -> None:
    # the server streams text, not ids: capabilities.token_ids says so and the checks follow it
    assert not engine.capabilities.token_ids
    assert "generate-equals-stream" in check_engine(engine)


class TestConformance(Conformance):
    """The conformance kit against unillm serve, llama.cpp in-process as the parity reference."""

    @pytest.fixture
    def unillm_engine(self, engine: OpenAIHTTPEngine) -> OpenAIHTTPEngine:
        return engine

    @pytest.fixture
    def unillm_engine_factory(self, server: Proc) -> Any:
        return lambda: OpenAIHTTPEngine({"model": "tiny", "options": {"base_url": server.url}})

    @pytest.fixture
    def unillm_reference(self, local: Any) -> Any:
        return local

    # without token ids the parity report cannot compare ids; the text parity is
    # test_greedy_text_and_usage_equal_the_in_process_engine above
    test_greedy_parity_with_the_reference_engine = None

    @pytest.fixture
    def unillm_embed_engine(self, embed_engine: OpenAIHTTPEngine) -> OpenAIHTTPEngine:
        return embed_engine

    @pytest.fixture
    def unillm_embed_reference(self, local_embed: Any) -> Any:
        return local_embed


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return tiny_embedding_model("last", cache_dir=tmp_path_factory.mktemp("embed"))


@pytest.fixture(scope="module")
def embed_server(embed_model: TinyModel, logs: Path) -> Iterator[Proc]:
    """unillm serve with the tiny embedding GGUF (it loads for embed from the file's pooling)."""
    s = unillm_serve(embed_model.gguf_path, free_port(), logs / "unillm-serve-embed.log").wait_ready("/ready")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def embed_engine(embed_server: Proc) -> Iterator[OpenAIHTTPEngine]:
    with OpenAIHTTPEngine({"model": "tiny", "options": {"base_url": embed_server.url}}) as e:
        yield e


@pytest.fixture(scope="module")
def local_embed(embed_model: TinyModel) -> Iterator[Any]:
    from unillm.engines.llamacpp import LlamaCppEngine

    with LlamaCppEngine({"model": str(embed_model.gguf_path)}) as e:
        yield e


def test_embeds_through_the_servers_embeddings_route(
    embed_engine: OpenAIHTTPEngine, local_embed: Any
) -> None:
    import numpy as np

    assert (embed_engine.task, embed_engine.pooling) == ("embed", "last")  # as /v1/models lists them
    texts = ["The quick brown fox", "Hello, world!", "Once upon a time " * 8]
    got, want = embed_engine.embed(texts), local_embed.embed(texts)
    assert np.abs(got.array() - want.array()).max() < 1e-5
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert np.abs(asyncio.run(embed_engine.aembed(texts, dimensions=8)).array()
                  - local_embed.embed(texts, dimensions=8).array()).max() < 1e-5  # fmt: skip
    with pytest.raises(ConfigError, match="embeds what it is given whole"):
        embed_engine.embed("x", truncate=True)
    with pytest.raises(ConfigError, match="load the model with task='generate'"):
        embed_engine.generate("x", max_tokens=2)  # refused here: the server listed its task


def test_close_closes_the_clients_and_the_engine(server: Proc) -> None:
    e = OpenAIHTTPEngine({"model": "tiny", "options": {"base_url": server.url}}).load()
    assert e.generate(PROMPTS[0], GREEDY).text
    wire = e._wire
    e.close()
    assert wire._client is None and wire._aclient is None
    assert "kv_stats" in check_closed(e)
    with pytest.raises(EngineClosed):
        e.chat(HELLO)
    with pytest.raises(EngineClosed):
        list(e.stream_chat(HELLO))


def test_the_async_client_is_closed_on_its_loop(server: Proc) -> None:
    async def run() -> tuple[str, Any]:
        async with OpenAIHTTPEngine({"model": "tiny", "options": {"base_url": server.url}}) as e:
            done = await e.agenerate(PROMPTS[0], GREEDY)
            client = e._wire._aclient
        return done.text, client

    text, client = asyncio.run(run())
    assert text and client is not None and client.is_closed


def test_is_selected_only_with_a_configured_server(server: Proc, monkeypatch: pytest.MonkeyPatch) -> None:
    model = type("Info", (), {"path": "/models/tiny", "format": "gguf"})()
    unset = OpenAIHTTPEngine.suitability(None, model, None)
    assert unset.blockers and "UNILLM_OPENAI_BASE_URL" in unset.blockers[0]
    monkeypatch.setenv("UNILLM_OPENAI_BASE_URL", server.url + "/v1")
    served = OpenAIHTTPEngine.suitability(None, model, None)
    assert not served.blockers and "serves it as 'tiny'" in served.reasons[0]
    other = OpenAIHTTPEngine.suitability(None, type("Info", (), {"path": "/m/other.gguf"})(), None)
    assert other.blockers and "serves tiny" in other.blockers[0]
    with pytest.raises(ConfigError, match="base_url"):
        monkeypatch.delenv("UNILLM_OPENAI_BASE_URL")
        OpenAIHTTPEngine({"model": "tiny"}).load()
