"""The backend against llama-cpp-python's own server, which ignores
``stream_options.include_usage``: usage is counted here, and must equal what the server says in a
whole (non-streamed) answer to the same request."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import unillm_openai_http
from _procs import Proc, free_port
from unillm_openai_http.engine import OpenAIHTTPEngine

from unillm import KVStats, Registry, UnsupportedParameter, auto_engine
from unillm.testing import TinyModel


def _missing() -> str | None:
    """The package llama-cpp-python's server needs and this environment lacks, if any."""
    try:
        import llama_cpp.server.app  # noqa: F401
    except ModuleNotFoundError as exc:
        return exc.name or str(exc)
    return None


MISSING = _missing()
pytestmark = pytest.mark.skipif(
    MISSING is not None,
    reason=f"llama-cpp-python's server needs {MISSING} (pip install 'llama-cpp-python[server]')",
)
GREEDY = {"temperature": 0.0, "max_tokens": 12}
PROMPTS = ("The quick brown fox", "Once upon a time")


@pytest.fixture(scope="module")
def server(tiny: TinyModel, logs: Path) -> Iterator[Proc]:
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(tiny.gguf_path), "--host", "127.0.0.1",
           "--port", str(port), "--n_ctx", "512", "--interrupt_requests", "False"]  # fmt: skip
    s = Proc(cmd, port, logs / "llama-cpp-python.log").wait_ready("/v1/models")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine(server: Proc, tiny: TinyModel) -> Iterator[OpenAIHTTPEngine]:
    # the server lists the model by its path; the config names it by file name
    with OpenAIHTTPEngine({"model": tiny.gguf_path.name, "options": {"base_url": server.url}}) as e:
        yield e


def _whole(server: Proc, route: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.url + route, json={**body, "stream": False}, timeout=60)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


def test_reads_what_the_server_is(engine: OpenAIHTTPEngine, tiny: TinyModel) -> None:
    assert engine.server_kind == "llama-cpp-python"
    assert "repetition_penalty" in engine.capabilities.sampling  # sent as repeat_penalty
    assert engine.detokenize(engine.tokenize("hello world")) == "hello world"  # /extras/tokenize


@pytest.mark.parametrize("prompt", PROMPTS)
def test_usage_counted_here_equals_the_servers_whole_answer(
    engine: OpenAIHTTPEngine, server: Proc, tiny: TinyModel, prompt: str
) -> None:
    whole = _whole(server, "/v1/completions", {"model": str(tiny.gguf_path), "prompt": prompt, **GREEDY})
    mine = engine.generate(prompt, GREEDY)
    assert mine.text == whole["choices"][0]["text"]
    assert mine.finish_reason == whole["choices"][0]["finish_reason"]
    usage = whole["usage"]
    assert (mine.usage.prompt_tokens, mine.usage.completion_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert mine.usage.cached_prompt_tokens is None  # the server does not say: None, not 0
    assert engine.usage_source == "client"
    streamed = list(engine.stream(prompt, GREEDY))
    assert "".join(c.text for c in streamed) == mine.text
    assert streamed[-1].usage == mine.usage
    assert asyncio.run(engine.agenerate(prompt, GREEDY)).usage == mine.usage  # counted on both paths


def test_chat_and_repeat_penalty(engine: OpenAIHTTPEngine, server: Proc, tiny: TinyModel) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    whole = _whole(
        server, "/v1/chat/completions", {"model": str(tiny.gguf_path), "messages": messages, **GREEDY}
    )
    got = engine.chat(messages, GREEDY)
    assert got.text == whole["choices"][0]["message"]["content"]
    assert got.usage.completion_tokens == whole["usage"]["completion_tokens"]
    body = {"model": str(tiny.gguf_path), "prompt": PROMPTS[0], **GREEDY, "repeat_penalty": 1.5}
    penalized = _whole(server, "/v1/completions", body)["choices"][0]["text"]
    assert engine.generate(PROMPTS[0], {**GREEDY, "repetition_penalty": 1.5}).text == penalized


def test_stop_strings_and_kv_stats(engine: OpenAIHTTPEngine) -> None:
    text = engine.generate(PROMPTS[1], GREEDY).text
    stop = next(text[i : i + 2] for i in range(2, len(text) - 2) if text[i : i + 2].strip())
    cut = engine.generate(PROMPTS[1], {**GREEDY, "stop": [stop]})
    assert (cut.text, cut.finish_reason) == (text[: text.find(stop)], "stop")
    assert engine.kv_stats() == KVStats()  # no /metrics: every field None
    with pytest.raises(UnsupportedParameter, match="stop_token_ids"):
        engine.generate("hi", stop_token_ids=[3])


def test_auto_engine_considers_it_only_with_a_server_configured(
    server: Proc, tiny: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = Registry(entry_points=False)  # the built-ins and this plugin, nothing installed
    registry.register_plugin(unillm_openai_http, name="openai-http")
    path = str(tiny.gguf_path)
    with auto_engine(path, registry=registry, context_length=512) as local:
        mine = {c.name: c for c in local.selection.candidates}["openai-http"]
        assert not mine.eligible and "UNILLM_OPENAI_BASE_URL" in mine.blockers[0]
        want = local.generate(PROMPTS[0], GREEDY)
    monkeypatch.setenv("UNILLM_OPENAI_BASE_URL", server.url + "/v1")
    with auto_engine(path, registry=registry, context_length=512) as chosen:
        mine = {c.name: c for c in chosen.selection.candidates}["openai-http"]
        assert mine.eligible and f"serves it as {path!r}" in mine.reasons[0]
        assert chosen.name == "llama.cpp"  # in-process wins a tie for its own format (the guide's bonus)
    with auto_engine(path, registry=registry, backend="openai-http") as remote:
        assert remote.name == "openai-http" and remote.selection.chosen_by == "config"
        got = remote.generate(PROMPTS[0], GREEDY)
        # the same weights, in-process and in the server: the same greedy tokens, counted alike
        assert got.usage.completion_tokens == want.usage.completion_tokens
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
