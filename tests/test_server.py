"""``unillm serve`` end to end: real ``unillm serve`` processes on llama.cpp and the tiny GGUF,
spoken to over loopback by the official ``openai`` and ``anthropic`` clients (and httpx where the
raw HTTP matters); the pool's TTL and LRU unloading in-process through the ASGI app.

Two servers serve most of the module, each started once: ``server`` (open, defaults) and
``guarded`` (an API key, a queue of one, a 4 KiB body limit); one test starts a third from a
config file (llama.cpp and MLX side by side). Counter checks read deltas, so the order the tests
run in does not matter.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from typer.testing import CliRunner

import unillm
from unillm import ConfigError
from unillm.cli import app
from unillm.server import Pool, ServerConfig, create_app, model_spec, read_server_config
from unillm.testing import TinyModel

from ._server_util import Server, metric, metrics, parse_metrics, start_server, wait_until
from .conftest import HAS_LLAMA_CPP, needs_llama_cpp

ALIAS = "tiny"
KEY = "sk-unillm-test-key"
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]  # the tiny model answers it at length
PROMPT = "Once upon a time"
LLAMA = {"model_name": ALIAS, "backend": "llama.cpp"}
# anthropic 2.x's client takes no sampling arguments; the server still reads them from the body
GREEDY = {"temperature": 0}
CONTEXT = 4096  # what llama.cpp gets for the tiny model by default (its trained length)


@pytest.fixture(scope="module")
def server(tiny_gguf: Path) -> Iterator[Server]:
    if not HAS_LLAMA_CPP:
        pytest.skip("llama-cpp-python is not installed")
    s = start_server([str(tiny_gguf), "--backend", "llama.cpp", "--alias", ALIAS])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def guarded(tiny_gguf: Path) -> Iterator[Server]:
    if not HAS_LLAMA_CPP:
        pytest.skip("llama-cpp-python is not installed")
    # one request at a time (--concurrency 1: llama.cpp without batching), so the queue fills
    s = start_server([str(tiny_gguf), "--backend", "llama.cpp", "--alias", ALIAS, "--api-key", KEY,
                      "--max-queue", "1", "--max-body-bytes", "4096", "--concurrency", "1"])  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(tiny_gguf: Path) -> Iterator[Any]:
    """The in-process engine the server's greedy answers must equal."""
    if not HAS_LLAMA_CPP:
        pytest.skip("llama-cpp-python is not installed")
    with unillm.load_engine({"model": str(tiny_gguf), "backend": "llama.cpp"}) as e:
        yield e


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _counts(usage: Any) -> tuple[int, int, int]:
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def _clean(body: str, *paths: Path) -> None:
    """An error body a client may see: no stack trace, no filesystem path."""
    assert "Traceback" not in body and 'File "' not in body, body
    assert not re.search(r"(?<![\w.])/(?:tmp|home|work|usr|root|var|private|opt)/", body), body
    for p in paths:
        assert str(p) not in body and p.name not in body, body


def _a_stop_in(text: str) -> tuple[str, int]:
    """Two letters of ``text`` whose first occurrence is after its start, and where that is."""
    for m in re.finditer(r"(?=([A-Za-z]{2}))", text):
        at = text.find(m.group(1))
        if at > 0:
            return m.group(1), at
    raise AssertionError(f"no two letters to stop at in {text!r}")


# ---- the OpenAI routes, with the official client ----


@needs_llama_cpp
def test_chat_equals_the_engine_greedily_streamed_or_not(oai: openai.OpenAI, engine: Any) -> None:
    want = engine.chat(MESSAGES, temperature=0, max_tokens=16)
    assert want.text  # an empty answer would make every equality below hold trivially
    r = oai.chat.completions.create(model=ALIAS, messages=MESSAGES, temperature=0, max_tokens=16)
    assert r.model == ALIAS and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == _finish(want.finish_reason)
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        want.usage.prompt_tokens, want.usage.completion_tokens, want.usage.total_tokens,
    )  # fmt: skip

    chunks = list(
        oai.chat.completions.create(
            model=ALIAS, messages=MESSAGES, temperature=0, max_tokens=16, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    *body, final = chunks
    assert body[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in body) == want.text
    assert body[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert all(c.usage is None for c in body) and len({c.id for c in chunks}) == 1
    assert final.choices == [] and final.usage is not None
    assert _counts(final.usage) == _counts(r.usage)  # cached_tokens may differ: the cache is warm now

    plain = list(oai.chat.completions.create(model=ALIAS, messages=MESSAGES, temperature=0, max_tokens=16,
                                             stream=True))  # fmt: skip
    assert all(c.usage is None and c.choices for c in plain)  # usage only when asked for
    assert "".join(c.choices[0].delta.content or "" for c in plain) == want.text


@needs_llama_cpp
def test_completions_equal_the_engine_greedily_streamed_or_not(oai: openai.OpenAI, engine: Any) -> None:
    want = engine.generate(PROMPT, temperature=0, max_tokens=20)
    assert want.text
    r = oai.completions.create(model=ALIAS, prompt=PROMPT, temperature=0, max_tokens=20)
    assert r.object == "text_completion" and r.model == ALIAS
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == _finish(want.finish_reason)
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        want.usage.prompt_tokens, want.usage.completion_tokens,
    )  # fmt: skip

    chunks = list(
        oai.completions.create(
            model=ALIAS, prompt=PROMPT, temperature=0, max_tokens=20, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    *body, final = chunks
    assert "".join(c.choices[0].text for c in body) == want.text
    assert body[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert final.choices == [] and final.usage is not None
    assert _counts(final.usage) == _counts(r.usage)


@needs_llama_cpp
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_ends_the_text_before_it(oai: openai.OpenAI, stream: bool) -> None:
    full = oai.completions.create(model=ALIAS, prompt=PROMPT, temperature=0, max_tokens=40).choices[0].text
    stop, at = _a_stop_in(full)
    call = {"model": ALIAS, "prompt": PROMPT, "temperature": 0, "max_tokens": 40, "stop": ["\x01never", stop]}
    if stream:
        chunks = list(oai.completions.create(**call, stream=True))
        text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        choice = oai.completions.create(**call).choices[0]
        text, finish = choice.text, choice.finish_reason
    assert (text, finish) == (full[:at], "stop")

    whole = oai.chat.completions.create(model=ALIAS, messages=MESSAGES, temperature=0, max_tokens=40)
    content = whole.choices[0].message.content or ""
    stop, at = _a_stop_in(content)
    call = {"model": ALIAS, "messages": MESSAGES, "temperature": 0, "max_tokens": 40, "stop": stop}
    if stream:
        pieces = list(oai.chat.completions.create(**call, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in pieces)
        finish = pieces[-1].choices[0].finish_reason
    else:
        message = oai.chat.completions.create(**call).choices[0]
        text, finish = message.message.content, message.finish_reason
    assert (text, finish) == (content[:at], "stop")


@needs_llama_cpp
def test_a_seed_reproduces_a_sampled_text(oai: openai.OpenAI) -> None:
    def sampled(seed: int, stream: bool = False) -> str:
        call = {"model": ALIAS, "prompt": PROMPT, "temperature": 1.0, "max_tokens": 16, "seed": seed}
        if stream:
            return "".join(c.choices[0].text for c in oai.completions.create(**call, stream=True))
        return oai.completions.create(**call).choices[0].text

    first = sampled(11)
    assert sampled(11) == first and sampled(11, stream=True) == first
    assert {sampled(s) for s in (12, 13, 14)} - {first}, "four seeds gave one text: is the seed ignored?"


SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["kind", "n", "ok"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}


@needs_llama_cpp
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_schema_response_format_is_enforced(oai: openai.OpenAI, stream: bool) -> None:
    finished = 0
    for seed in range(6):
        call = {"model": ALIAS, "messages": MESSAGES, "temperature": 1.0, "seed": seed, "max_tokens": 120}
        if stream:
            chunks = list(oai.chat.completions.create(**call, response_format=FORMAT, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)
        else:
            got = oai.chat.completions.create(**call, response_format=FORMAT)
            text, finish = got.choices[0].message.content or "", got.choices[0].finish_reason
        if finish == "stop":
            finished += 1
            value = json.loads(text)
            assert set(value) == {"kind", "n", "ok"} and value["kind"] in ("a", "b"), text
            assert isinstance(value["n"], int) and isinstance(value["ok"], bool), text
    assert finished >= 4, finished


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
UNIQUE = {"type": "array", "uniqueItems": True}  # no engine enforces it: refused alike
UNENFORCEABLE = {"type": "json_schema", "json_schema": {"name": "n", "schema": UNIQUE}}
NO_SCHEMA = {"type": "json_schema", "json_schema": {}}
LONG = "hello " * (CONTEXT + 100)


@needs_llama_cpp
def test_n_choices_are_each_the_answer_one_request_with_its_seed_gets(oai: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": ALIAS, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.9,
                          "extra_body": {"ignore_eos": True}}  # fmt: skip
    three = oai.completions.create(**kw, n=3, seed=7)
    assert [c.index for c in three.choices] == [0, 1, 2]
    alone = [oai.completions.create(**kw, seed=7 + i) for i in range(3)]
    assert [c.text for c in three.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in three.choices}) > 1  # three seeds, three samples
    assert three.usage is not None and alone[0].usage is not None
    assert three.usage.completion_tokens == 24
    assert three.usage.prompt_tokens == alone[0].usage.prompt_tokens  # the prompt counted once
    chat = oai.chat.completions.create(model=ALIAS, messages=MESSAGES, max_tokens=8, n=2, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same


@needs_llama_cpp
def test_a_batch_of_prompts_with_n_choices_streamed_or_not(server: Server, oai: openai.OpenAI) -> None:
    """Choice i * n + j is prompt i's j-th (OpenAI's numbering); a stream interleaves them, each
    ending on its own finish event, the usage once after the last; the same seeds give the same
    texts either way, and each prompt is counted once. One prompt refused refuses the batch, and
    leaves nothing of it running."""
    prompts = [PROMPT, "The sky", "A"]
    kw: dict[str, Any] = {"model": ALIAS, "max_tokens": 6, "temperature": 0.9, "seed": 3,
                          "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = oai.completions.create(**kw, prompt=prompts, n=2)  # type: ignore[arg-type]
    assert [c.index for c in whole.choices] == list(range(6))
    alone = [oai.completions.create(**kw, prompt=p, n=2) for p in prompts]  # type: ignore[arg-type]
    assert [c.text for c in whole.choices] == [c.text for a in alone for c in a.choices]
    assert whole.usage is not None and all(a.usage is not None for a in alone)
    assert whole.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # type: ignore[union-attr]
    assert whole.usage.completion_tokens == 6 * 6

    texts, finishes, usages = [""] * 6, [0] * 6, []
    events = oai.completions.create(
        **kw, prompt=prompts, n=2, stream=True, stream_options={"include_usage": True}
    )  # type: ignore[arg-type]
    for event in events:
        if event.usage is not None:
            assert not finishes.count(0), "the usage comes after every choice has finished"
            usages.append(event.usage)
        for c in event.choices:
            texts[c.index] += c.text
            finishes[c.index] += c.finish_reason is not None
    assert texts == [c.text for c in whole.choices] and finishes == [1] * 6
    assert len(usages) == 1 and usages[0].total_tokens == whole.usage.total_tokens

    chat = {"model": ALIAS, "messages": MESSAGES, "max_tokens": 6, "temperature": 0.9, "seed": 5, "n": 3}
    answers = oai.chat.completions.create(**chat)  # type: ignore[call-overload]
    got = [""] * 3
    for event in oai.chat.completions.create(**chat, stream=True):  # type: ignore[call-overload]
        for c in event.choices:
            got[c.index] += c.delta.content or ""
    assert got == [c.message.content for c in answers.choices]

    for stream in (False, True):
        batch = {"model": ALIAS, "prompt": [PROMPT, "word " * (2 * CONTEXT)], "max_tokens": 200,
                 "ignore_eos": True, "stream": stream}  # fmt: skip
        r = httpx.post(server.v1 + "/completions", json=batch, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        wait_until(lambda: metric(metrics(server.url), "unillm:num_requests_running", **LLAMA) == 0, 10,
                   "the batch's other prompt to stop")  # fmt: skip


@needs_llama_cpp
def test_n_choices_stream_where_one_request_runs_at_a_time(guarded: Server) -> None:
    """On a server that runs one request at a time, n streamed choices take the slot in turn: the
    response starts with the first, and the second runs once the first has ended (a response that
    waited for every choice's first token would wait forever on a slot nobody frees)."""
    client = openai.OpenAI(base_url=guarded.v1, api_key=KEY, max_retries=0, timeout=60)
    texts = ["", ""]
    events = client.chat.completions.create(model=ALIAS, messages=MESSAGES, max_tokens=6, n=2, temperature=0,
                                            stream=True)  # fmt: skip
    for event in events:
        for c in event.choices:
            texts[c.index] += c.delta.content or ""
    assert texts[0] == texts[1] != ""


@needs_llama_cpp
def test_echo_best_of_and_max_tokens_zero_do_what_openai_does(oai: openai.OpenAI, engine: Any) -> None:
    """echo puts the prompt before the answer (a token-id prompt detokenized); max_tokens 0 counts
    the prompt and generates nothing; best_of n picks the candidate of the highest mean log
    probability among those n seeds give, and the usage counts every candidate."""
    kw: dict[str, Any] = {"model": ALIAS, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    plain = oai.completions.create(**kw).choices[0].text
    assert oai.completions.create(**kw, echo=True).choices[0].text == PROMPT + plain
    ids = engine.tokenize(PROMPT)
    echoed = oai.completions.create(**{**kw, "prompt": ids}, echo=True).choices[0].text
    assert echoed == engine.detokenize(ids) + plain
    streamed = "".join(
        e.choices[0].text for e in oai.completions.create(**kw, echo=True, stream=True) if e.choices
    )
    assert streamed == PROMPT + plain

    for echo in (False, True):
        zero = oai.completions.create(**{**kw, "max_tokens": 0}, echo=echo)
        assert zero.choices[0].text == (PROMPT if echo else "") and zero.choices[0].finish_reason == "length"
        assert zero.usage is not None and (zero.usage.prompt_tokens, zero.usage.completion_tokens) == (
            len(ids),
            0,
        )
        events = list(oai.completions.create(**{**kw, "max_tokens": 0}, echo=echo, stream=True))
        assert "".join(c.text for e in events for c in e.choices) == (PROMPT if echo else "")
    said = oai.chat.completions.create(model=ALIAS, messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
    for stream in (False, True):
        ask = {"model": ALIAS, "messages": MESSAGES, "max_completion_tokens": 0, "stream": stream}
        chat = httpx.post(str(oai.base_url.join("chat/completions")), json=ask, timeout=60)
        assert chat.status_code == 200, chat.text
        if not stream:
            answer = chat.json()
            assert answer["choices"][0]["message"]["content"] == ""
            assert answer["choices"][0]["finish_reason"] == "length"
            assert said.usage is not None
            assert (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]) == (
                said.usage.prompt_tokens,
                0,
            )
        else:
            assert '"finish_reason":"length"' in chat.text and chat.text.rstrip().endswith("[DONE]")

    sampled = {**kw, "temperature": 1.0, "seed": 11, "extra_body": {"ignore_eos": True}}
    three = oai.completions.create(**sampled, n=3, logprobs=0)
    means = [sum(c.logprobs.token_logprobs) / 6 for c in three.choices]  # type: ignore[union-attr]
    assert len({c.text for c in three.choices}) > 1  # three candidates to choose from
    best = oai.completions.create(**sampled, best_of=3)
    assert [c.text for c in best.choices] == [three.choices[means.index(max(means))].text]
    assert best.choices[0].logprobs is None  # ranked by them, not asked for them
    assert best.usage is not None and best.usage.completion_tokens == 18  # all three generated
    two = oai.completions.create(**sampled, best_of=3, n=2)
    ranked = sorted(range(3), key=lambda i: -means[i])[:2]
    assert [c.text for c in two.choices] == [three.choices[i].text for i in ranked]

    assert oai.completions.create(**{**kw, "prompt": None}).choices[0].finish_reason is not None  # type: ignore[arg-type]
    assert (
        oai.completions.create(**{**kw, "prompt": [""]}).choices[0].text
        == oai.completions.create(**{**kw, "prompt": ""}).choices[0].text
    )


@needs_llama_cpp
@pytest.mark.parametrize(
    ("call", "error", "param"),
    [
        ({"max_tokens": CONTEXT + 1}, openai.BadRequestError, "max_tokens"),
        ({"extra_body": {"frobnicate": 1}}, openai.BadRequestError, "frobnicate"),
        ({"top_logprobs": 2}, openai.BadRequestError, "top_logprobs"),  # without logprobs: true
        ({"tools": [TOOL]}, openai.BadRequestError, "tools"),
        ({"response_format": UNENFORCEABLE}, openai.BadRequestError, "response_format"),
        ({"response_format": NO_SCHEMA}, openai.BadRequestError, "response_format"),
        ({"messages": [{"role": "user", "content": LONG}]}, openai.BadRequestError, None),
        ({"messages": [{"role": "user", "content": LONG}], "stream": True}, openai.BadRequestError, None),
        ({"model": "no-such-model"}, openai.NotFoundError, "model"),
        ({"model": "no-such-model", "stream": True}, openai.NotFoundError, "model"),
    ],
    ids=["max_tokens", "unknown-field", "top_logprobs", "tools", "unenforced-schema",
         "bad-schema", "context", "context-streamed",
         "unknown-model", "unknown-model-streamed"],
)  # fmt: skip
def test_refusals_raise_the_clients_exception_classes(
    oai: openai.OpenAI,
    call: dict[str, Any],
    error: type[openai.APIStatusError],
    param: str | None,
    tiny: TinyModel,
) -> None:
    with pytest.raises(error) as info:
        oai.chat.completions.create(**{"model": ALIAS, "messages": MESSAGES, "max_tokens": 4, **call})
    err = info.value.response.json()["error"]
    assert err["param"] == param and err["message"]
    if "messages" in call:
        assert err["code"] == "context_length_exceeded"
    _clean(info.value.response.text, tiny.root)


@needs_llama_cpp
def test_a_path_given_as_model_is_refused_without_echoing_it(
    oai: openai.OpenAI, tiny_gguf: Path, tiny: TinyModel
) -> None:
    for model in (str(tiny_gguf), str(tiny.hf_dir), "../../etc/passwd"):
        with pytest.raises(openai.NotFoundError) as info:
            oai.completions.create(model=model, prompt=PROMPT, max_tokens=4)
        assert "by alias" in info.value.message and ALIAS in info.value.message
        assert "passwd" not in info.value.response.text
        _clean(info.value.response.text, tiny.root, tiny_gguf)


# ---- the Anthropic route, with the official client ----


@needs_llama_cpp
def test_anthropic_messages_whole_and_streamed(server: Server, oai: openai.OpenAI) -> None:
    ant = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    system = "You answer briefly."
    same = oai.chat.completions.create(
        model=ALIAS, messages=[{"role": "system", "content": system}, *MESSAGES], temperature=0, max_tokens=8
    )
    assert same.choices[0].finish_reason == "length"  # the tiny model does not end in 8 tokens
    want, usage = same.choices[0].message.content, same.usage
    assert usage is not None

    call: dict[str, Any] = {"model": ALIAS, "system": system, "messages": MESSAGES, "max_tokens": 8,
                            "extra_body": GREEDY}  # fmt: skip
    msg = ant.messages.create(**call)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == ALIAS
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == want
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)

    with ant.messages.stream(**call) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == want and final.content[0].text == want
    assert final.stop_reason == "max_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        msg.usage.input_tokens,
        msg.usage.output_tokens,
    )

    with pytest.raises(anthropic.NotFoundError) as info:
        ant.messages.create(model="no-such-model", messages=MESSAGES, max_tokens=8)
    body = info.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        ant.messages.create(model=ALIAS, messages=MESSAGES, max_tokens=CONTEXT + 1)


@needs_llama_cpp
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_stop_sequences_name_the_one_that_stopped(
    server: Server, oai: openai.OpenAI, stream: bool
) -> None:
    ant = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    full = oai.chat.completions.create(model=ALIAS, messages=MESSAGES, temperature=0, max_tokens=40)
    whole = full.choices[0].message.content or ""
    stop, at = _a_stop_in(whole)
    call: dict[str, Any] = {"model": ALIAS, "messages": MESSAGES, "max_tokens": 40, "extra_body": GREEDY,
                            "stop_sequences": ["\x01never", stop]}  # fmt: skip
    if stream:
        with ant.messages.stream(**call) as s:
            text = "".join(s.text_stream)
            msg = s.get_final_message()
    else:
        msg = ant.messages.create(**call)
        text = msg.content[0].text
    assert text == whole[:at]
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert msg.usage.output_tokens < (full.usage.completion_tokens if full.usage else 0)


# ---- raw HTTP: bodies, routes, keys ----


@needs_llama_cpp
def test_bodies_over_the_limit_are_413_with_or_without_a_length(guarded: Server, tiny: TinyModel) -> None:
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    big = json.dumps({"model": ALIAS, "prompt": "x" * 8000, "max_tokens": 2}).encode()
    for route, anthropic_shape in (("/v1/completions", False), ("/v1/messages", True)):
        r = httpx.post(guarded.url + route, content=big, headers=auth, timeout=30)
        assert r.status_code == 413, r.text
        if anthropic_shape:
            body = r.json()
            assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
            assert body["error"]["message"]
        else:
            assert r.json()["error"]["code"] == "request_too_large"
        _clean(r.text, tiny.root)

    def chunked(n: int) -> Iterator[bytes]:
        yield b'{"model": "tiny", "max_tokens": 2, "prompt": "'
        for _ in range(n):
            yield b"x" * 1024
        yield b'"}'

    for route in ("/v1/completions", "/v1/messages"):
        r = httpx.post(guarded.url + route, content=chunked(8), headers=auth, timeout=30)
        assert "content-length" not in r.request.headers
        assert r.request.headers["transfer-encoding"] == "chunked"
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert error.get("code", error["type"]) == "request_too_large", r.text
        _clean(r.text, tiny.root)
    # the same body under the limit goes through
    r = httpx.post(guarded.v1 + "/completions", content=chunked(2), headers=auth, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2


@needs_llama_cpp
def test_unknown_routes_and_bad_bodies_get_json_errors(server: Server, tiny: TinyModel) -> None:
    for method, path in (("GET", "/v2/nothing"), ("POST", "/v1/audio/speech"), ("GET", "/v1/models/no-such")):
        r = httpx.request(method, server.url + path, timeout=10)
        assert r.status_code == 404 and r.headers["content-type"] == "application/json"
        assert r.json()["error"]["message"]
        _clean(r.text, tiny.root)
    assert httpx.get(server.v1 + f"/models/{ALIAS}").json()["id"] == ALIAS
    r = httpx.get(server.v1 + "/chat/completions", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["message"]
    for content in (b"{not json", b"[]", b'{"model": "tiny", "prompt": "x", "max_tokens": "many"}'):
        r = httpx.post(server.v1 + "/completions", content=content,
                       headers={"Content-Type": "application/json"}, timeout=10)  # fmt: skip
        assert r.status_code == 400, (content, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
        _clean(r.text, tiny.root)


@needs_llama_cpp
def test_what_the_specs_allow_is_accepted_and_answered_in_their_shapes(server: Server, engine: Any) -> None:
    """Values OpenAI's and Anthropic's documents allow, sent as careless clients send them: null for
    an optional field is its default; top_p 0 is the likeliest token (greedy); an empty stop string
    stops nothing; completions' logprobs false asks for none. Answers carry the documented fields
    (message.refusal, logprobs.refusal, a top_logprobs dict per token at logprobs 0), refusals a
    code and the param, and /v1/messages/count_tokens counts the prompt a Messages call would take."""
    v1 = server.v1
    nulls = {"stream": None, "n": None, "logprobs": None, "stop": None, "stream_options": None, "seed": None}
    chat = {"model": ALIAS, "messages": MESSAGES, "max_tokens": 6, "temperature": 0, **nulls}
    r = httpx.post(v1 + "/chat/completions", json={**chat, "top_logprobs": None}, timeout=60)
    assert r.status_code == 200, r.text
    greedy = r.json()["choices"][0]
    assert greedy["message"]["refusal"] is None and greedy["logprobs"] is None
    top_p0 = {**chat, "temperature": 1.0, "top_p": 0, "stop": "", "seed": 7}
    r = httpx.post(v1 + "/chat/completions", json={**top_p0, "logprobs": True}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == greedy["message"]["content"]  # top_p 0: greedy
    assert choice["logprobs"]["refusal"] is None and len(choice["logprobs"]["content"]) == 6
    streamed = {
        **chat,
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
    }
    r = httpx.post(v1 + "/chat/completions", json=streamed, timeout=60)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text

    comp = {
        "model": ALIAS,
        "prompt": PROMPT,
        "max_tokens": 4,
        "temperature": 0,
        "echo": None,
        "best_of": None,
    }
    off = httpx.post(v1 + "/completions", json={**comp, "logprobs": False}, timeout=60).json()
    assert off["choices"][0]["logprobs"] is None  # false is off, not 0
    zero = httpx.post(v1 + "/completions", json={**comp, "logprobs": 0}, timeout=60).json()["choices"][0]
    tops = zero["logprobs"]["top_logprobs"]
    assert len(tops) == 4 and all(len(d) == 1 for d in tops)  # the chosen token's own, no alternatives
    assert [next(iter(d)) for d in tops] == zero["logprobs"]["tokens"]

    for body, param, code in (
        ({**comp, "logprobs": True}, "logprobs", "invalid_value"),
        ({**comp, "frobnicate": 1}, "frobnicate", "unknown_parameter"),
        ({"model": ALIAS, "max_tokens": 4}, "prompt", "missing_required_parameter"),
        ({**comp, "suffix": "x"}, "suffix", "unsupported_value"),  # the tiny model has no FIM tokens
        ({**comp, "echo": True, "logprobs": 0}, "echo", "unsupported_value"),  # the prompt's: not reported
        ({**comp, "n": 2, "best_of": 1}, "best_of", "invalid_value"),
        ({**comp, "best_of": 2, "stream": True}, "best_of", "invalid_value"),  # as OpenAI: ranks whole ones
        ({**comp, "prompt": [PROMPT] * 65, "best_of": 2}, "prompt", "invalid_value"),  # 130 generations
        ({**comp, "temperature": 9}, "temperature", "invalid_value"),
    ):
        r = httpx.post(v1 + "/completions", json=body, timeout=60)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert (error["param"], error["code"]) == (param, code), error

    ask = {"model": ALIAS, "messages": MESSAGES, "system": "Be brief."}
    counted = httpx.post(server.url + "/v1/messages/count_tokens", json=ask, timeout=60)
    assert counted.status_code == 200, counted.text
    ant = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    msg = ant.messages.create(**ask, max_tokens=2, extra_body=GREEDY)  # type: ignore[arg-type]
    assert counted.json() == {"input_tokens": msg.usage.input_tokens}
    assert ant.messages.count_tokens(**ask).input_tokens == msg.usage.input_tokens  # type: ignore[arg-type]


@needs_llama_cpp
def test_a_prompt_past_the_context_is_refused_before_it_queues(server: Server) -> None:
    """An over-long prompt is counted before it takes a place in the queue, not after its wait."""
    before = metrics(server.url)
    words = "word " * (2 * CONTEXT)
    for route, body in (
        ("/completions", {"prompt": words}),
        ("/chat/completions", {"messages": [{"role": "user", "content": words}]}),
    ):
        r = httpx.post(server.v1 + route, json={"model": ALIAS, "max_tokens": 4, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    after = metrics(server.url)
    queued = "unillm:request_queue_time_seconds_count"
    assert metric(after, queued, **LLAMA) == metric(before, queued, **LLAMA)  # neither entered the queue


@needs_llama_cpp
def test_an_api_key_guards_every_route_but_the_probes(guarded: Server) -> None:
    call = {"model": ALIAS, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    for key in ("sk-wrong", KEY + "x", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError) as info:
            openai.OpenAI(base_url=guarded.v1, api_key=key, max_retries=0).chat.completions.create(**call)
        assert info.value.response.json()["error"]["code"] == "invalid_api_key"
        _clean(info.value.response.text)
    for path in ("/v1/models", "/metrics", "/v1/chat/completions"):
        r = httpx.request("POST" if "chat" in path else "GET", guarded.url + path, json=call, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
    assert httpx.get(guarded.url + "/health", timeout=10).status_code == 200
    assert httpx.get(guarded.url + "/ready", timeout=10).json()["ready"] is True

    ok = openai.OpenAI(base_url=guarded.v1, api_key=KEY, max_retries=0).chat.completions.create(**call)
    assert ok.usage is not None and ok.usage.completion_tokens == 2
    # Anthropic's client sends the key as x-api-key
    ant = anthropic.Anthropic(base_url=guarded.url, api_key=KEY, max_retries=0)
    msg = ant.messages.create(model=ALIAS, messages=MESSAGES, max_tokens=2, extra_body=GREEDY)
    assert msg.usage.output_tokens == 2
    ant = anthropic.Anthropic(base_url=guarded.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        ant.messages.create(model=ALIAS, messages=MESSAGES, max_tokens=2)
    assert refused.value.response.json()["error"]["type"] == "authentication_error"
    assert "x-api-key" in refused.value.response.json()["error"]["message"]  # what its clients send
    _clean(refused.value.response.text)


# ---- a client gone, a queue full ----


# Per route, a request the tiny model answers to the end of the context unless stopped (greedy, it
# never ends "Why is the sky blue?"): long enough that a client gone early is told apart.
ASKED = CONTEXT - 100
_LONG = {
    "/v1/completions": {"prompt": PROMPT, "ignore_eos": True},
    "/v1/chat/completions": {"messages": MESSAGES, "ignore_eos": True},
    "/v1/messages": {"messages": MESSAGES},
}


def _long(route: str, *, stream: bool) -> dict[str, Any]:
    return {"model": ALIAS, "max_tokens": ASKED, "temperature": 0, "stream": stream, **_LONG[route]}


def _grown(after: Any, before: Any, name: str, **labels: str) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


def _aborted(s: Server, before: Any, headers: dict[str, str] | None = None) -> Any:
    """/metrics once one more request ended as aborted and none runs; then checks it stopped early."""
    abort = {**LLAMA, "finished_reason": "abort"}

    def settled() -> Any:
        m = metrics(s.url, headers)
        done = _grown(m, before, "unillm:request_success_total", **abort) == 1
        return m if done and metric(m, "unillm:num_requests_running", **LLAMA) == 0 else None

    after = wait_until(settled, 10, "the request to end as aborted")
    assert _grown(after, before, "unillm:request_success_total", **LLAMA, finished_reason="length") == 0
    # docs/server.md: the counter counts finished requests; an aborted one adds nothing near ASKED
    assert _grown(after, before, "unillm:generation_tokens_total", **LLAMA) < ASKED / 2
    # the engine stopped too: its cache holds the prompt and the tokens it got to, not ASKED
    used = metric(after, "unillm:kv_cache_usage_perc", **LLAMA) * CONTEXT
    assert used < ASKED / 2, used
    return after


@needs_llama_cpp
@pytest.mark.parametrize("route", list(_LONG))
def test_a_client_gone_mid_stream_stops_the_generation(
    server: Server, oai: openai.OpenAI, route: str
) -> None:
    before = metrics(server.url)
    events = 0
    client = httpx.Client(base_url=server.url, timeout=30)
    with client, client.stream("POST", route, json=_long(route, stream=True)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 4:
                break  # leaving the block mid-body closes the connection
    _aborted(server, before)
    r2 = oai.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True})
    assert r2.usage is not None and r2.usage.completion_tokens == 8


@needs_llama_cpp
@pytest.mark.parametrize("route", list(_LONG))
def test_a_client_gone_before_a_whole_answer_stops_the_generation(
    server: Server, oai: openai.OpenAI, route: str
) -> None:
    before = metrics(server.url)
    with pytest.raises(httpx.ReadTimeout):  # httpx closes the connection on giving up
        httpx.post(server.url + route, json=_long(route, stream=False), timeout=httpx.Timeout(30, read=0.2))
    after = _aborted(server, before)
    assert wait_until(
        lambda: _grown(metrics(server.url), before, "unillm:requests_total", route=route, status="499"),
        10, "the request to be counted",
    ) == 1  # fmt: skip
    assert _grown(after, before, "unillm:requests_total", route=route, status="200") == 0
    r2 = oai.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True})
    assert r2.usage is not None and r2.usage.completion_tokens == 8


@needs_llama_cpp
def test_a_client_gone_while_queued_leaves_the_queue(guarded: Server) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    before = metrics(guarded.url, auth)
    route = "/v1/completions"
    client = httpx.Client(base_url=guarded.url, headers=auth, timeout=30)
    with client, client.stream("POST", route, json=_long(route, stream=True)) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # kept: dropping it unread would close the connection
        next(lines)  # the first has its slot (llama.cpp runs one at a time) and runs on unread
        for stream in (False, True):  # the next one waits its turn, and its client gives up waiting
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(guarded.url + route, json=_long(route, stream=stream), headers=auth,
                           timeout=httpx.Timeout(30, read=0.2))  # fmt: skip

            def left() -> Any:
                m = metrics(guarded.url, auth)
                return m if metric(m, "unillm:num_requests_waiting", **LLAMA) == 0 else None

            m = wait_until(left, 10, "the queue to empty")
            assert metric(m, "unillm:num_requests_running", **LLAMA) == 1, "the first ended early"

    def ended() -> Any:
        m = metrics(guarded.url, auth)
        return m if metric(m, "unillm:num_requests_running", **LLAMA) == 0 else None

    after = wait_until(ended, 10, "the first request to end")
    assert _grown(after, before, "unillm:requests_total", route=route, status="499") == 2
    finished = sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == "unillm:request_success_total")
    assert finished == 1  # the first; the two that gave up never reached the engine
    ok = httpx.post(guarded.v1 + "/completions", headers=auth, timeout=30,
                    json={"model": ALIAS, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})  # fmt: skip
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


@needs_llama_cpp
def test_a_full_queue_answers_429_with_retry_after(guarded: Server) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    client = openai.OpenAI(base_url=guarded.v1, api_key=KEY, max_retries=0, timeout=120)
    before = metrics(guarded.url, auth)
    n, asked = 6, 1500
    start = threading.Barrier(n)

    def one(_: int) -> Any:
        start.wait()
        try:
            chunks = client.completions.create(
                model=ALIAS, prompt=PROMPT, max_tokens=asked, stream=True, extra_body={"ignore_eos": True},
                stream_options={"include_usage": True},
            )  # fmt: skip
            return list(chunks)
        except openai.RateLimitError as exc:
            return exc

    with ThreadPoolExecutor(n) as pool:
        outcomes = list(pool.map(one, range(n)))
    refused = [o for o in outcomes if isinstance(o, openai.RateLimitError)]
    served = [o for o in outcomes if not isinstance(o, openai.RateLimitError)]
    # llama.cpp runs one at a time and one may wait: at least those two finish, the rest are refused
    assert refused and len(served) >= 2, outcomes
    for exc in refused:
        assert exc.status_code == 429 and int(exc.response.headers["retry-after"]) >= 1
        assert exc.response.json()["error"]["type"] == "rate_limit_error"
        _clean(exc.response.text)
    for chunks in served:
        assert chunks[-1].usage.completion_tokens == asked

    def counted() -> Any:
        m = metrics(guarded.url, auth)
        grew = _grown(m, before, "unillm:requests_total", route="/v1/completions", status="200")
        return m if grew == len(served) else None

    after = wait_until(counted, 10, "the served requests to be counted")
    limited = _grown(after, before, "unillm:requests_total", route="/v1/completions", status="429")
    assert limited == len(refused)
    assert metric(after, "unillm:num_requests_waiting", **LLAMA) == 0
    r = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == 4


# ---- /metrics ----


@needs_llama_cpp
def test_metrics_count_exactly_what_the_clients_saw(server: Server, oai: openai.OpenAI) -> None:
    before = metrics(server.url)
    seen: list[tuple[int, int]] = []
    r1 = oai.chat.completions.create(model=ALIAS, messages=MESSAGES, temperature=0, max_tokens=12)
    r2 = oai.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=9, seed=3)
    *_, r3 = oai.chat.completions.create(model=ALIAS, messages=MESSAGES, max_tokens=7, seed=5, stream=True,
                                         stream_options={"include_usage": True})  # fmt: skip
    for r in (r1, r2, r3):
        assert r.usage is not None
        seen.append((r.usage.prompt_tokens, r.usage.completion_tokens))
    ant = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    msg = ant.messages.create(model=ALIAS, messages=MESSAGES, max_tokens=5)
    seen.append((msg.usage.input_tokens, msg.usage.output_tokens))
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="no-such-model", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=CONTEXT + 1)

    expected = {("/v1/chat/completions", "200"): 2, ("/v1/completions", "200"): 1, ("/v1/messages", "200"): 1,
                ("/v1/chat/completions", "404"): 1, ("/v1/completions", "400"): 1}  # fmt: skip

    def grown(m: Any, name: str, **labels: str) -> float:
        return _grown(m, before, name, **labels)

    def counted() -> Any:
        m = metrics(server.url)
        got = {k: grown(m, "unillm:requests_total", route=k[0], status=k[1]) for k in expected}
        return m if got == expected else None

    after = wait_until(counted, 10, f"requests_total to grow by {expected}")
    assert grown(after, "unillm:prompt_tokens_total", **LLAMA) == sum(p for p, _ in seen)
    assert grown(after, "unillm:generation_tokens_total", **LLAMA) == sum(c for _, c in seen)
    finished = sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == "unillm:request_success_total")
    assert finished == 4  # the refused two never reached the engine
    for hist in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert grown(after, f"unillm:{hist}_seconds_count", **LLAMA) == 4, hist
    # every per-model sample names the alias and the backend that served it
    per_model = [dict(k[1]) for k in after if k[0].startswith(("unillm:generation", "unillm:num_requests"))]
    assert per_model and all(lb == LLAMA for lb in per_model)
    assert metric(after, "unillm:num_requests_running", **LLAMA) == 0
    assert metric(after, "unillm:num_requests_waiting", **LLAMA) == 0
    assert metric(after, "unillm:model_loaded", **LLAMA) == 1
    assert 0 < metric(after, "unillm:kv_cache_usage_perc", **LLAMA) <= 1
    queries = metric(after, "unillm:prefix_cache_queries_total", **LLAMA)
    assert queries >= metric(after, "unillm:prefix_cache_hits_total", **LLAMA) >= 0 and queries > 0


def test_concurrent_requests_sharing_a_prefix_are_batched_and_counted(
    server: Server, oai: openai.OpenAI
) -> None:
    """The server loads llama.cpp batching (8 sequences unless the table says otherwise): requests
    sent together run together, and one that shares a prefix with another is served from its
    cells, which the usage and /metrics both count."""
    listed = oai.models.list().data[0].model_extra or {}
    assert listed["backend"] == "llama.cpp" and listed["batching"] is True
    shared = "You are a careful assistant who answers in one short sentence. " * 4
    before = metrics(server.url)
    first = oai.completions.create(model=ALIAS, prompt=shared + "First question?", max_tokens=4, **GREEDY)
    results: list[Any] = [None] * 4

    def ask(i: int) -> None:
        results[i] = oai.completions.create(
            model=ALIAS, prompt=shared + f"Question {i}?", max_tokens=4, **GREEDY
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in results]
    # the shared text is most of each prompt (where it ends depends on how the question tokenizes)
    assert all(c >= 0.9 * first.usage.prompt_tokens for c in cached), (cached, first.usage.prompt_tokens)

    def counted() -> Any:
        m = metrics(server.url)
        return (
            m
            if _grown(m, before, "unillm:requests_total", route="/v1/completions", status="200") >= 5
            else None
        )

    after = wait_until(counted, 10, "the five requests to be counted")
    hits = _grown(after, before, "unillm:prefix_cache_hits_total", **LLAMA)
    assert hits == sum(cached) + (first.usage.prompt_tokens_details.cached_tokens or 0)


# ---- several models: a config file on two backends; TTL and LRU in-process ----


@needs_llama_cpp
def test_two_aliases_on_two_backends_from_a_config(tiny: TinyModel, tmp_path: Path) -> None:
    pytest.importorskip("mlx_lm")
    config = tmp_path / "server.toml"
    config.write_text(
        "max_queue = 4\n\n"
        f'[models.gguf]\nmodel = {json.dumps(str(tiny.gguf_path))}\nbackend = "llama.cpp"\n\n'
        f'[models.hf]\nmodel = {json.dumps(str(tiny.hf_dir))}\nbackend = "mlx"\n'
    )
    s = start_server(["--config", str(config)], timeout_s=240)
    try:
        listed = httpx.get(s.v1 + "/models", timeout=10).json()["data"]
        assert {m["id"]: (m["backend"], m["loaded"]) for m in listed} == {
            "gguf": ("llama.cpp", True), "hf": ("mlx", True),
        }  # fmt: skip
        client = openai.OpenAI(base_url=s.v1, api_key="unused", max_retries=0, timeout=120)
        usage = {}
        for alias in ("gguf", "hf"):
            r = client.chat.completions.create(model=alias, messages=MESSAGES, temperature=0, max_tokens=6)
            assert r.model == alias and r.usage is not None and r.choices[0].message.content is not None
            usage[alias] = r.usage.completion_tokens
        m = metrics(s.url)
        generated = "unillm:generation_tokens_total"
        assert metric(m, generated, model_name="gguf", backend="llama.cpp") == usage["gguf"]
        assert metric(m, generated, model_name="hf", backend="mlx") == usage["hf"]
        assert metric(m, generated, model_name="hf", backend="llama.cpp") == 0
    finally:
        s.stop()


def _lazy_app(tiny_gguf: Path, aliases: tuple[str, ...], **settings: Any) -> tuple[Pool, Any]:
    specs = tuple(model_spec(a, {"model": str(tiny_gguf), "backend": "llama.cpp"}) for a in aliases)
    cfg = ServerConfig(models=specs, lazy=True, access_log=False, **settings)
    pool = Pool(cfg)
    return pool, create_app(cfg, pool=pool)


async def _complete(c: httpx.AsyncClient, alias: str) -> httpx.Response:
    return await c.post("/v1/completions", json={"model": alias, "prompt": PROMPT, "max_tokens": 3})


async def _loaded(c: httpx.AsyncClient) -> dict[str, bool]:
    return {m["id"]: m["loaded"] for m in (await c.get("/v1/models")).json()["data"]}


@needs_llama_cpp
def test_an_idle_model_unloads_after_its_ttl_and_reloads_on_demand(tiny_gguf: Path) -> None:
    async def main() -> None:
        pool, asgi = _lazy_app(tiny_gguf, ("a",), ttl_s=30)
        slot = pool.slots["a"]
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://u") as c:
                assert await _loaded(c) == {"a": False} and slot.loads == 0  # lazy: not before a request
                assert (await _complete(c, "a")).status_code == 200
                assert slot.loaded and slot.loads == 1
                assert await pool.reap_idle(now=time.monotonic() + 29) == []  # not idle long enough
                assert slot.loaded
                assert await pool.reap_idle(now=time.monotonic() + 31) == ["a"]
                assert not slot.loaded and await _loaded(c) == {"a": False}
                m = parse_metrics((await c.get("/metrics")).text)
                assert metric(m, "unillm:model_loaded", model_name="a", backend="llama.cpp") == 0
                r = await _complete(c, "a")
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
                assert slot.loaded and slot.loads == 2 and await _loaded(c) == {"a": True}
                m = parse_metrics((await c.get("/metrics")).text)
                assert metric(m, "unillm:model_loaded", model_name="a", backend="llama.cpp") == 1
        finally:
            await pool.close()
        assert not slot.loaded

    asyncio.run(main())


@needs_llama_cpp
def test_max_loaded_unloads_the_least_recently_used(tiny_gguf: Path) -> None:
    async def main() -> None:
        pool, asgi = _lazy_app(tiny_gguf, ("a", "b"), max_loaded=1)
        a, b = pool.slots["a"], pool.slots["b"]
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://u") as c:
                assert (await _complete(c, "a")).status_code == 200
                assert await _loaded(c) == {"a": True, "b": False}
                assert (await _complete(c, "b")).status_code == 200
                assert await _loaded(c) == {"a": False, "b": True}
                assert (await _complete(c, "a")).status_code == 200
                assert await _loaded(c) == {"a": True, "b": False}
                assert (a.loads, b.loads) == (2, 1)
                # a model in use is never unloaded for another: that one waits its turn (429)
                assert a.admission is not None
                async with a.admission.slot("a"):
                    r = await _complete(c, "b")
                    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
                    assert "max_loaded" in r.json()["error"]["message"]
                assert a.loaded and not b.loaded
                assert (await _complete(c, "b")).status_code == 200
                assert (a.loaded, b.loaded, b.loads) == (False, True, 2)
        finally:
            await pool.close()

    asyncio.run(main())


@needs_llama_cpp
def test_max_loaded_holds_when_two_models_are_asked_for_at_once(tiny_gguf: Path) -> None:
    async def main() -> None:
        pool, asgi = _lazy_app(tiny_gguf, ("a", "b"), max_loaded=1)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://u") as c:
                first, second = await asyncio.gather(_complete(c, "a"), _complete(c, "b"))
                # "a" loads first; "b" may not unload it under its request, so it is told to retry
                assert (first.status_code, second.status_code) == (200, 429), (first.text, second.text)
                assert int(second.headers["retry-after"]) >= 1
                assert await _loaded(c) == {"a": True, "b": False}
                assert (await _complete(c, "b")).status_code == 200  # "a" is idle now: it goes
                assert await _loaded(c) == {"a": False, "b": True}
        finally:
            await pool.close()

    asyncio.run(main())


# ---- configuration mistakes ----

runner = CliRunner()


@needs_llama_cpp
def test_serve_says_what_it_loads_when_its_output_is_no_terminal(server: Server) -> None:
    """The server's stderr is a pipe here: a line as each model starts loading and one when it is
    loaded, before the line that says where it listens."""
    text = "".join(server.lines)
    loading = text.index(f"unillm serve: loading {ALIAS!r}")
    loaded = text.index(f"unillm serve: {ALIAS!r} loaded in ")
    assert "with llama.cpp" in text[loading:loaded] and loaded < text.index("unillm serve: listening on")


def test_serve_without_a_model_exits_2() -> None:
    out = runner.invoke(app, ["serve"])
    assert out.exit_code == 2 and "give MODEL, or --config" in out.output


def test_serve_binds_its_port_before_it_loads(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy port fails at once, before any model is loaded (no load is started: the loader is
    never called), with a usage error that says to pick another port."""
    import socket

    import unillm.cli._serve as serve

    loads: list[Any] = []
    monkeypatch.setattr(serve, "_load", loads.append)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        out = runner.invoke(app, ["serve", str(tiny_gguf), "--port", str(port)])
    assert out.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in out.output, out.output
    assert "pick another --port" in out.output and loads == []


def test_serve_refuses_a_bad_alias_and_engine_flags_with_a_config(tiny_gguf: Path, tmp_path: Path) -> None:
    for alias in ("../up", "a/b", ".hidden", "x" * 129, "", " "):
        out = runner.invoke(app, ["serve", str(tiny_gguf), "--alias", alias])
        assert out.exit_code == 2 and "ConfigError" in out.output, (alias, out.output)
    config = tmp_path / "server.toml"
    config.write_text(f'[models.m]\nmodel = "{tiny_gguf.name}"\n')
    out = runner.invoke(app, ["serve", "--config", str(config), "--alias", "x"])
    assert out.exit_code == 2 and "go with MODEL" in out.output


def test_config_mistakes_are_config_errors(tmp_path: Path) -> None:
    spec = model_spec("chat", {"model": "m.gguf"})
    with pytest.raises(ConfigError, match="names two models"):
        ServerConfig(models=(spec, spec))
    with pytest.raises(ConfigError, match="no models"):
        ServerConfig(models=())
    config = tmp_path / "server.toml"
    config.write_text('port = 0\n[models.chat]\nmodel = "m.gguf"\n[models.other.options]\nn_threads = 2\n')
    with pytest.raises(ConfigError, match="needs `model`"):
        read_server_config(config)
    config.write_text('[models.chat]\nmodel = "m.gguf"\nmax_queue = 3\n')
    read = read_server_config(config, max_tokens=64)
    assert read.models[0].engine.model == str(tmp_path / "m.gguf")  # relative to the file
    config.write_text('[models.chat]\nmodel = "Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M"\n')
    assert (
        read_server_config(config).models[0].engine.model == "Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M"
    )  # a name
    config.write_text('[models.chat]\nmodel = "m.gguf"\nmax_queue = 3\n')
    assert (read.models[0].max_queue, read.max_tokens, read.max_queue) == (3, 64, 64)
    with pytest.raises(ConfigError, match="names two models"):  # the file's alias and a flag's
        read_server_config(config, models=[spec])
    config.write_text('[models."a/b"]\nmodel = "m.gguf"\n')
    with pytest.raises(ConfigError, match="not a model alias"):
        read_server_config(config)
    config.write_text('models = "m.gguf"\n')
    with pytest.raises(ConfigError, match="must be tables"):
        read_server_config(config)


@needs_llama_cpp
def test_suffix_is_fill_in_the_middle_on_a_model_with_its_tokens(tmp_path: Path) -> None:
    """A model whose vocabulary has fill-in-the-middle tokens gets ``suffix`` as OpenAI's FIM:
    the prompt written <|fim_prefix|>before<|fim_suffix|>after<|fim_middle|>, the answer the
    middle alone; the engine given that prompt itself answers the same. (A model of its own: the
    tiny model's FIM variant, its last three filler tokens named; the shared one has none, and its
    refusal is tested with the other refusals.)"""
    from unillm.server._completions import fim_tokens
    from unillm.testing import build_tiny_model

    fim = build_tiny_model(tmp_path / "fim", fim=True)
    before, after = "def add(a, b):\n    ", "\n    return c\n"

    async def main() -> None:
        pool, asgi = _lazy_app(fim.gguf_path, ("fim",))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://u") as c:
                ask = {"model": "fim", "prompt": before, "suffix": after, "max_tokens": 6, "temperature": 0}
                r = await c.post("/v1/completions", json=ask)
                assert r.status_code == 200, r.text
                _, engine = await pool.engine("fim")
                assert fim_tokens(engine) == ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
                written = f"<|fim_prefix|>{before}<|fim_suffix|>{after}<|fim_middle|>"
                ids = engine.tokenize(written)
                assert ids.count(509) == ids.count(510) == ids.count(511) == 1  # one token each
                direct = engine.generate(written, temperature=0, max_tokens=6)
                assert r.json()["choices"][0]["text"] == direct.text
                assert r.json()["usage"]["prompt_tokens"] == len(ids)
        finally:
            await pool.close()

    asyncio.run(main())
