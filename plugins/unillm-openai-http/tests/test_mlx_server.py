"""The backend against ``mlx_lm.server`` on the tiny HF directory: a server that says nothing of
itself in /v1/models (so only OpenAI's own parameters are sent unless ``server_kind`` says
``mlx``), has no tokenizer route, and sends usage when asked."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _procs import Proc, free_port
from unillm_openai_http._errors import ServedModelNotFound, TokenizerUnavailable
from unillm_openai_http.engine import OpenAIHTTPEngine

from unillm import KVStats, UnsupportedParameter
from unillm.testing import TinyModel, check_closed

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="mlx-lm is not installed")
GREEDY = {"temperature": 0.0, "max_tokens": 12}
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(tiny: TinyModel, logs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    port = free_port()
    hub = tmp_path_factory.mktemp("hf-hub")  # empty: /v1/models lists the hub cache and fails without one
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(tiny.hf_dir), "--host", "127.0.0.1",
           "--port", str(port)]  # fmt: skip
    s = Proc(cmd, port, logs / "mlx-lm.log", env={"HF_HUB_CACHE": str(hub)}).wait_ready("/v1/models")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine(server: Proc, tiny: TinyModel) -> Iterator[OpenAIHTTPEngine]:
    with OpenAIHTTPEngine({"model": str(tiny.hf_dir), "options": {"base_url": server.url + "/v1"}}) as e:
        yield e


def _whole(server: Proc, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=60)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


def test_greedy_stream_equals_the_servers_whole_answer_with_its_usage(
    engine: OpenAIHTTPEngine, server: Proc, tiny: TinyModel
) -> None:
    assert engine.server_kind == "openai"
    whole = _whole(server, {"model": str(tiny.hf_dir), "prompt": PROMPT, **GREEDY})
    chunks = list(engine.stream(PROMPT, GREEDY))
    done = engine.generate(PROMPT, GREEDY)
    assert "".join(c.text for c in chunks) == done.text == whole["choices"][0]["text"]
    assert done.finish_reason == whole["choices"][0]["finish_reason"] == "length"
    usage = whole["usage"]
    # the server's usage event (include_usage), not a count of its merged text events
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (usage["prompt_tokens"], 12)
    assert done.timings.ttft_s <= done.timings.total_s


def test_only_openais_parameters_unless_told_it_is_mlx(server: Proc, tiny: TinyModel) -> None:
    generic = OpenAIHTTPEngine({"model": str(tiny.hf_dir), "options": {"base_url": server.url}}).load()
    try:
        with pytest.raises(UnsupportedParameter, match="top_k"):
            generic.generate(PROMPT, top_k=1)
    finally:
        generic.close()
    options = {"base_url": server.url, "server_kind": "mlx"}
    with OpenAIHTTPEngine({"model": str(tiny.hf_dir), "options": options}) as mlx:
        # top_k=1 is greedy: it must give the greedy text, whatever the temperature
        assert (
            mlx.generate(PROMPT, {**GREEDY, "temperature": 1.0, "top_k": 1}).text
            == mlx.generate(PROMPT, GREEDY).text
        )


def test_chat_and_what_the_server_lacks(engine: OpenAIHTTPEngine, server: Proc, tiny: TinyModel) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": str(tiny.hf_dir), "messages": messages, **GREEDY},
        timeout=60,
    )
    assert engine.chat(messages, GREEDY).text == r.json()["choices"][0]["message"]["content"]
    with pytest.raises(TokenizerUnavailable, match="no tokenize"):
        engine.tokenize("hi")
    assert engine.kv_stats() == KVStats()
    with pytest.raises(ServedModelNotFound):
        OpenAIHTTPEngine({"model": "other-model", "options": {"base_url": server.url}}).load()


def test_closed(server: Proc, tiny: TinyModel) -> None:
    e = OpenAIHTTPEngine({"model": str(tiny.hf_dir), "options": {"base_url": server.url}})
    assert "generate" in check_closed(e)  # never loaded
    e.load()
    e.close()
    assert "generate" in check_closed(e)
