"""What needs no model: the hook, the options, reading each server family's /metrics, and the
retry policy against a scripted HTTP server on loopback (429/503 answers a real server gives
under load, which the model servers here cannot be made to give on demand)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest
import unillm_openai_http
from unillm_openai_http._errors import PromptTooLong, ServerBusy, ServerFailed, ServerRefused
from unillm_openai_http._http import parse_event
from unillm_openai_http._metrics import kv_from_metrics
from unillm_openai_http._servers import match
from unillm_openai_http.engine import OpenAIHTTPEngine

from unillm import ConfigError, KVStats, Registry, UnsupportedParameter

VLLM = """# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 120.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 48.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="64",engine="0"} 1.0
"""
# what vLLM 0.32's CPU build exports (trimmed): the capacity is a label of its own, and each counter
# has a _created sample beside its _total
VLLM_032 = """vllm:kv_cache_usage_perc{engine="0",model_name="/m"} 0.00390625
vllm:prefix_cache_queries_total{engine="0",model_name="/m"} 638.0
vllm:prefix_cache_queries_created{engine="0",model_name="/m"} 1.796156607988e+09
vllm:prefix_cache_hits_total{engine="0",model_name="/m"} 256.0
vllm:prefix_cache_hits_created{engine="0",model_name="/m"} 1.796156607988e+09
vllm:external_prefix_cache_queries_total{engine="0",model_name="/m"} 0.0
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="0",\
kv_cache_memory_bytes="67108864",kv_cache_size_tokens="65536",num_cpu_blocks="None",num_gpu_blocks="512"} 1.0
"""
SGLANG = """sglang:num_used_tokens{model_name="m"} 300.0
sglang:max_total_num_tokens{model_name="m"} 1200.0
sglang:page_size{model_name="m"} 1.0
"""
LLAMA_SERVER = "llamacpp:kv_cache_usage_ratio 0.5\nllamacpp:kv_cache_tokens 256\n"
UNILLM = """unillm:kv_cache_usage_perc{backend="llama.cpp",model_name="a"} 0.5
unillm:kv_cache_usage_perc{backend="llama.cpp",model_name="b"} 0.1
unillm:prefix_cache_queries_total{backend="llama.cpp",model_name="a"} 10.0
unillm:prefix_cache_hits_total{backend="llama.cpp",model_name="a"} 4.0
unillm:prefix_cache_queries_total{backend="llama.cpp",model_name="b"} 7.0
unillm:prefix_cache_hits_total{backend="llama.cpp",model_name="b"} 0.0
"""


@pytest.mark.parametrize(
    ("text", "model", "want"),
    [
        (
            VLLM,
            "m",
            KVStats(
                capacity_tokens=1024, used_tokens=256, block_size=16, total_blocks=64, used_blocks=16,
                prefix_cache_queries=120, prefix_cache_hits=48,
            ),
        ),
        (
            VLLM_032,
            "/m",
            KVStats(
                capacity_tokens=65536, used_tokens=256, block_size=128, total_blocks=512, used_blocks=2,
                bytes_per_token=1024, capacity_bytes=64 << 20, used_bytes=256 << 10,
                prefix_cache_queries=638, prefix_cache_hits=256,
            ),
        ),
        (SGLANG, "m", KVStats(capacity_tokens=1200, used_tokens=300, block_size=1)),
        (LLAMA_SERVER, "x", KVStats(capacity_tokens=512, used_tokens=256)),
        (UNILLM, "b", KVStats(prefix_cache_queries=7, prefix_cache_hits=0)),  # its own model's only
        ("# nothing here\nprocess_cpu_seconds_total 1.5\n", "m", KVStats()),
    ],
    ids=["vllm", "vllm-0.32", "sglang", "llama-server", "unillm-serve", "none"],
)  # fmt: skip
def test_kv_stats_from_each_servers_metrics(text: str, model: str, want: KVStats) -> None:
    assert kv_from_metrics(text, model) == want


def test_sse_lines() -> None:
    url = "http://x"
    assert parse_event(": keepalive 3/8", url) is None and parse_event("", url) is None
    chat = parse_event('data: {"choices":[{"delta":{"role":"assistant","content":""}}]}', url)
    assert chat is not None and chat.text is None  # the role opening adds no token
    both = parse_event('data: {"choices":[{"delta":{"role":"assistant","content":"hi"}}]}', url)
    assert both is not None and both.text == "hi"  # mlx_lm sends the role with every delta
    usage = parse_event('data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}', url)
    assert usage is not None and usage.usage == {"prompt_tokens": 3, "completion_tokens": 2}
    with pytest.raises(ServerFailed, match="not JSON"):
        parse_event("data: {broken", url)
    # vLLM's closing event can carry the last token's id with no text (held back, or a stop token)
    last = parse_event('data: {"choices":[{"text":"","token_ids":[7],"finish_reason":"stop"}]}', url)
    assert last is not None and (last.text, last.token_ids, last.finish_reason) == ("", (7,), "stop")
    refused = parse_event('data: {"error": {"message": "out-of-vocab", "code": 400}}', url)
    assert refused is not None and (refused.error, refused.error_code) == ("out-of-vocab", 400)


def test_registers_through_its_hook_and_validates_its_options() -> None:
    registry = Registry(builtins=False, entry_points=False)
    registry.register_plugin(unillm_openai_http, name="openai-http")
    assert registry.failures == []
    assert registry.get("openai-http") is OpenAIHTTPEngine
    with pytest.raises(ConfigError, match="base_uri"):
        OpenAIHTTPEngine({"model": "m", "options": {"base_uri": "http://x"}})
    with pytest.raises(ConfigError, match="retries"):
        OpenAIHTTPEngine({"model": "m", "options": {"retries": -1}})


@pytest.mark.parametrize(
    ("model", "served", "want"),
    [
        ("tiny", ["tiny"], "tiny"),
        ("/models/tiny.gguf", ["tiny"], "tiny"),  # a local path, served under its stem
        ("tiny.gguf", ["/srv/models/tiny.gguf"], "/srv/models/tiny.gguf"),  # the server lists a path
        ("/data/hf/", ["/data/hf"], "/data/hf"),
        ("Qwen2", ["Qwen2.5-7B"], None),  # a dot in a name is not a suffix
        ("other", ["tiny"], None),
    ],
)
def test_which_served_model_a_config_names(model: str, served: list[str], want: str | None) -> None:
    assert match(model, served) == want


class _Scripted(BaseHTTPRequestHandler):
    """Answers each request with the next of ``script``: (status, headers, body)."""

    script: ClassVar[list[tuple[int, dict[str, str], bytes]]] = []
    seen: ClassVar[list[str]] = []
    bodies: ClassVar[list[Any]] = []
    release: ClassVar[threading.Event]

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        type(self).bodies.append(json.loads(self.rfile.read(length)) if length else None)
        type(self).seen.append(self.path)
        step = type(self).script.pop(0)
        if step is STALL:
            type(self).release.wait(30)  # a server that accepted the request and says nothing
            return
        status, headers, body = step
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def scripted() -> Iterator[tuple[str, type[_Scripted]]]:
    handler: type[_Scripted] = type(
        "Handler", (_Scripted,), {"script": [], "seen": [], "bodies": [], "release": threading.Event()}
    )
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    handler.release.set()
    httpd.shutdown()
    httpd.server_close()


def _json(obj: Any) -> bytes:
    return json.dumps(obj).encode()


Answer = tuple[int, dict[str, str], bytes]
MODELS: Answer = (
    200,
    {"Content-Type": "application/json"},
    _json({"data": [{"id": "m", "owned_by": "vllm"}]}),
)
BUSY: Answer = (503, {"Retry-After": "0"}, _json({"error": {"message": "loading"}}))
STALL: Answer = (0, {}, b"")
FULL: Answer = (429, {}, _json({"error": {"message": "queue full"}}))


def _sse(*events: Any) -> tuple[int, dict[str, str], bytes]:
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return 200, {"Content-Type": "text/event-stream"}, body.encode()


def test_429_and_503_are_retried_before_the_answer_starts(scripted: tuple[str, type[_Scripted]]) -> None:
    url, handler = scripted
    answer = _sse(
        {"choices": [{"text": "a", "token_ids": [5]}]},
        {"choices": [{"text": "b", "token_ids": [6], "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}},
    )
    handler.script = [MODELS, BUSY, FULL, answer]
    options = {"base_url": url, "retries": 2, "retry_backoff_s": 0.0}
    with OpenAIHTTPEngine({"model": "m", "options": options}) as e:
        done = e.generate("hi", max_tokens=2)
        assert (done.text, done.token_ids, done.finish_reason) == ("ab", (5, 6), "length")
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (4, 2)
        assert handler.seen == ["/v1/models", "/v1/completions", "/v1/completions", "/v1/completions"]
        handler.script = [BUSY, BUSY, FULL]
        with pytest.raises(ServerBusy) as info:
            e.generate("hi")
        assert info.value.status == 429 and "3 attempt(s)" in str(info.value)


def test_an_error_inside_a_started_stream_is_not_replayed(scripted: tuple[str, type[_Scripted]]) -> None:
    url, handler = scripted
    broken = _sse({"choices": [{"text": "a"}]}, {"error": {"message": "engine died"}})
    handler.script = [MODELS, broken, _sse({"choices": [{"text": "never"}]})]
    engine = OpenAIHTTPEngine({"model": "m", "options": {"base_url": url, "retries": 5}})
    with engine as e, pytest.raises(ServerFailed, match="engine died"):
        e.generate("hi")
    assert handler.seen == ["/v1/models", "/v1/completions"]  # once, and never again


def test_a_read_timeout_is_a_server_failure_and_not_retried(scripted: tuple[str, type[_Scripted]]) -> None:
    url, handler = scripted
    handler.script = [MODELS, STALL, MODELS]
    options = {"base_url": url, "retries": 3, "read_timeout_s": 0.3}
    with OpenAIHTTPEngine({"model": "m", "options": options}) as e:
        with pytest.raises(ServerFailed, match="ReadTimeout"):
            e.generate("hi")
        assert handler.seen == ["/v1/models", "/v1/completions"]  # the server may be generating it


def test_vllms_token_ids_are_asked_for_and_kept_where_no_text_comes(
    scripted: tuple[str, type[_Scripted]],
) -> None:
    url, handler = scripted
    # what vLLM streams with return_token_ids: the first token's text held back (part of a
    # character), a chat delta with no content, and the last id on the closing event
    answer = _sse(
        {"choices": [{"text": "", "token_ids": [5], "prompt_token_ids": [1, 2]}]},
        {"choices": [{"text": "\u00e9", "token_ids": [6]}]},
        {"choices": [{"text": "", "token_ids": [7], "finish_reason": "stop", "stop_reason": 7}]},
        {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}},
    )
    chat = _sse(
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {}, "token_ids": [5]}]},
        {"choices": [{"delta": {"content": "ok"}, "token_ids": [6], "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}},
    )
    handler.script = [MODELS, answer, chat]
    with OpenAIHTTPEngine({"model": "m", "options": {"base_url": url}}) as e:
        assert e.capabilities.token_ids  # vLLM: ids are streamed
        done = e.generate("hi", stop_token_ids=[7])
        assert (done.text, done.token_ids, done.finish_reason) == ("\u00e9", (5, 6, 7), "stop")
        assert done.stop_sequence is None and done.usage.completion_tokens == 3
        said = e.chat([{"role": "user", "content": "hi"}], max_tokens=2)
        assert (said.text, said.token_ids) == ("ok", (5, 6))
    assert [b.get("return_token_ids") for b in handler.bodies[1:]] == [True, True]


def test_an_error_event_with_a_client_code_is_a_refusal(scripted: tuple[str, type[_Scripted]]) -> None:
    url, handler = scripted
    # vLLM answers 200 and then refuses out-of-vocabulary ids in the stream, with code 400
    vocab = _sse({"error": {"message": "token_id(s) [99999] in logit_bias are out-of-vocab", "code": 400}})
    long = _sse({"error": {"message": "This model's maximum context length is 512 tokens", "code": 400}})
    handler.script = [MODELS, vocab, long, _sse({"error": {"message": "engine dead", "code": 500}})]
    with OpenAIHTTPEngine({"model": "m", "options": {"base_url": url, "retries": 0}}) as e:
        with pytest.raises(ServerRefused) as refused:
            e.generate("hi", logit_bias={1: 1.0})
        assert refused.value.status == 400 and "out-of-vocab" in str(refused.value)
        with pytest.raises(PromptTooLong):
            e.generate("hi")
        with pytest.raises(ServerFailed) as failed:
            e.generate("hi")
        assert failed.value.status == 500


def test_tools_are_refused_for_a_servers_own_chat(scripted: tuple[str, type[_Scripted]]) -> None:
    url, handler = scripted
    handler.script = [MODELS]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with OpenAIHTTPEngine({"model": "m", "options": {"base_url": url}}) as e:
        with pytest.raises(UnsupportedParameter, match="chat_template"):
            e.chat([{"role": "user", "content": "hi"}], tools=[tool])
        with pytest.raises(UnsupportedParameter, match="tool_choice"):
            list(e.stream_chat([{"role": "user", "content": "hi"}], tool_choice="required"))
    assert handler.seen == ["/v1/models"]  # nothing was sent


def test_vllm_usage_is_over_its_blocks_less_the_null_block() -> None:
    # vLLM's BlockPool.get_usage is used / (num_gpu_blocks - 1): 4 blocks of 512 read 4/511
    scrape = VLLM_032.replace("0.00390625", repr(4 / 511))
    stats = kv_from_metrics(scrape, "/m")
    assert (stats.used_blocks, stats.used_tokens, stats.used_bytes) == (4, 512, 512 << 10)
