"""The engine on the tiny model, converted by ONNX Runtime GenAI's builder: the contract, streams,
stop strings, max_tokens, chat, sampling, the tokenizer and the KV cache."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest
from unillm_onnxruntime_genai.engine import OnnxGenAIEngine

from unillm import SamplingParams
from unillm.testing import check_closed, check_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
PROMPT = "The quick brown fox"
EOS = 2  # the tiny model's end-of-sequence id (genai_config.json)


def test_it_passes_the_conformance_checks(engine: OnnxGenAIEngine) -> None:
    passed = check_engine(engine)
    assert passed == [
        "generate-equals-stream", "final-chunk", "max-tokens", "stop-strings", "break-and-resume",
        "async-mirror", "kv-stats", "tokenizer-round-trip",
    ]  # fmt: skip


def test_a_closed_or_never_loaded_engine_refuses_every_call(onnx_dir: Path) -> None:
    never = OnnxGenAIEngine({"model": str(onnx_dir)})
    assert "generate" in check_closed(never)
    e = OnnxGenAIEngine({"model": str(onnx_dir)}).load()
    assert e.generate(PROMPT, GREEDY).usage.completion_tokens == 24
    e.close()
    e.close()  # twice: nothing happens
    assert "stream" in check_closed(e)
    # and it loads again
    assert e.load().generate(PROMPT, GREEDY).usage.completion_tokens == 24
    e.close()


def test_usage_and_timings(engine: OnnxGenAIEngine) -> None:
    out = engine.generate(PROMPT, GREEDY)
    assert out.usage.prompt_tokens == len(engine.tokenize(PROMPT)) == 8
    assert out.usage.completion_tokens == len(out.token_ids) == 24
    assert out.usage.cached_prompt_tokens == 0  # no prefix cache: every prompt token is evaluated
    t = out.timings
    assert t.source == "wall" and 0 < t.ttft_s <= t.total_s
    assert t.decode_tokens_per_s is not None and t.decode_tokens_per_s > 0


def test_a_stream_cut_midway_leaves_the_engine_usable_and_its_cache_freed(engine: OnnxGenAIEngine) -> None:
    full = engine.generate(PROMPT, GREEDY)
    stream = engine.stream(PROMPT, GREEDY)
    got = [next(stream) for _ in range(3)]
    # the request's generator holds the prompt and the tokens made so far
    assert engine.kv_stats().used_tokens == 8 + 3
    stream.close()  # type: ignore[attr-defined]
    assert engine.kv_stats().used_tokens == 0
    assert tuple(i for c in got for i in c.token_ids) == full.token_ids[:3]
    assert engine.generate(PROMPT, GREEDY).token_ids == full.token_ids


def test_a_stop_string_across_two_chunks(engine: OnnxGenAIEngine) -> None:
    chunks = list(engine.stream(PROMPT, GREEDY))
    full = "".join(c.text for c in chunks)
    at = 0
    for a, b in itertools.pairwise(chunks):
        at += len(a.text)
        stop = a.text[-1:] + b.text[:1]
        if len(stop) == 2 and full.find(stop) == at - 1:
            break
    else:
        pytest.fail(f"no two neighbouring chunks to cut across in {full!r}")
    streamed = list(engine.stream(PROMPT, GREEDY, stop=stop))
    text = "".join(c.text for c in streamed)
    assert text == full[: at - 1]
    assert streamed[-1].finish_reason == "stop" and streamed[-1].stop_sequence == stop
    assert engine.generate(PROMPT, GREEDY, stop=[stop, "never there"]).text == full[: at - 1]


@pytest.mark.parametrize("n", [1, 2, 7])
def test_max_tokens(engine: OnnxGenAIEngine, n: int) -> None:
    out = engine.generate(PROMPT, GREEDY, max_tokens=n)
    assert (len(out.token_ids), out.usage.completion_tokens, out.finish_reason) == (n, n, "length")


def test_the_completion_ends_at_the_models_eos_unless_told_to_ignore_it(engine: OnnxGenAIEngine) -> None:
    eos_first = {"logit_bias": {EOS: 100.0}}
    assert engine.eos_token_ids == {EOS}
    out = engine.generate(PROMPT, GREEDY, **eos_first)
    assert (out.token_ids, out.finish_reason, out.usage.completion_tokens) == ((), "stop", 0)
    # ORT GenAI cannot go past its EOS: ignore_eos keeps the end token from being sampled at all
    on = engine.generate(PROMPT, GREEDY, ignore_eos=True, **eos_first)
    assert on.finish_reason == "length" and len(on.token_ids) == 24 and EOS not in on.token_ids


def test_stop_token_ids(engine: OnnxGenAIEngine) -> None:
    full = engine.generate(PROMPT, GREEDY)
    third = full.token_ids[2]
    first = full.token_ids.index(third)
    out = engine.generate(PROMPT, GREEDY, stop_token_ids=[third])
    assert out.token_ids == full.token_ids[:first] and out.finish_reason == "stop"


def test_chat_renders_the_models_chatml_template(engine: OnnxGenAIEngine) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    prompt = engine.render_chat(messages)
    want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
    assert prompt == want + "<|im_start|>assistant\n"
    ids = engine.tokenize(prompt)
    assert ids[0] == engine.tokenize("<|im_start|>")[0] and len(engine.tokenize("<|im_start|>")) == 1
    reply = engine.chat(messages, GREEDY)
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.token_ids == engine.generate(prompt, GREEDY).token_ids
    streamed = "".join(c.text for c in engine.stream_chat(messages, GREEDY))
    assert streamed == reply.text
    assert asyncio.run(engine.achat(messages, GREEDY)).text == reply.text


def test_a_template_in_the_config_wins(onnx_dir: Path) -> None:
    with OnnxGenAIEngine(
        {"model": str(onnx_dir), "chat_template": "Q: {{ messages[0]['content'] }}\nA:"}
    ) as e:
        assert e.render_chat([{"role": "user", "content": "why"}]) == "Q: why\nA:"


def test_token_prompts_and_the_tokenizer(engine: OnnxGenAIEngine) -> None:
    ids = engine.tokenize(PROMPT)
    assert engine.generate(ids, GREEDY).token_ids == engine.generate(PROMPT, GREEDY).token_ids
    for text in [
        "Быстрая коричневая лиса",
        "敏捷的棕色狐狸",
        "🙂 tab\tend",
        "<|im_start|>user\nhi<|im_end|>",
    ]:
        assert engine.detokenize(engine.tokenize(text)) == text
    # a sampled completion holds bytes that are not UTF-8 on their own; the text keeps them as
    # U+FFFD and goes on (ORT GenAI's own decode() stops at the first one)
    out = engine.generate(PROMPT, GREEDY)
    assert engine.detokenize(out.token_ids) == out.text
    assert "\ufffd" in out.text and len(out.text) > 20


def test_sampling(engine: OnnxGenAIEngine) -> None:
    warm = SamplingParams(temperature=0.9, max_tokens=16, seed=7)
    a, b = engine.generate(PROMPT, warm), engine.generate(PROMPT, warm)
    assert a.token_ids == b.token_ids  # a seed repeats
    others = {engine.generate(PROMPT, warm, seed=s).token_ids for s in range(8)}
    assert len(others) > 1
    assert (
        engine.generate(PROMPT, warm, top_k=1).token_ids
        == engine.generate(PROMPT, GREEDY, max_tokens=16).token_ids
    )
    # the builder writes top_k=50 into genai_config.json: unset top_k must not mean 50 here
    assert all(len(engine.generate(PROMPT, warm, top_p=0.5, seed=s).token_ids) == 16 for s in range(3))


def test_logprobs_and_logit_bias(engine: OnnxGenAIEngine) -> None:
    out = engine.generate(PROMPT, GREEDY, logprobs=1)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    assert all(lp <= 0 for lp in out.logprobs)
    first = out.token_ids[0]
    pushed = engine.generate(PROMPT, GREEDY, max_tokens=1, logit_bias={first: -1e4}, logprobs=1)
    assert pushed.token_ids[0] != first
    assert (
        pushed.logprobs is not None and pushed.logprobs[0] <= out.logprobs[0]
    )  # of the model, before the bias


def test_kv_stats_say_what_onnxruntime_genai_can_tell(engine: OnnxGenAIEngine) -> None:
    engine.generate(PROMPT, GREEDY, max_tokens=1)
    kv = engine.kv_stats()
    assert kv.capacity_tokens == 4096 and kv.used_tokens == 0
    # 2 (K, V) x 2 layers x 1 KV head x 64 x 4 bytes (the fp32 build's cache)
    assert kv.bytes_per_token == 2 * 2 * 1 * 64 * 4 and kv.dtype == "f32"
    assert kv.capacity_bytes == 4096 * 1024
    assert kv.prefix_cache_queries is None and kv.prefix_cache_hits is None  # it has no prefix cache
    assert kv.block_size is None and kv.total_blocks is None


def test_without_a_byte_table_text_comes_from_onnxruntime_genais_stream(onnx_dir: Path) -> None:
    # the path of tokenizers that are not byte-level BPE (SentencePiece): ORT GenAI's own stream
    with OnnxGenAIEngine({"model": str(onnx_dir)}) as e:
        table = e._bytes
        ids = e.tokenize(" fox")
        assert table is not None and b"".join(table[i] for i in ids) == b" fox"
        e._bytes = None
        for text in ["The quick brown fox", "Быстрая коричневая лиса", "敏捷的棕色狐狸"]:
            assert e.detokenize(e.tokenize(text)) == text
        out = e.generate(PROMPT, GREEDY)
        assert out.text == "".join(c.text for c in e.stream(PROMPT, GREEDY))
        assert len(out.token_ids) == 24
