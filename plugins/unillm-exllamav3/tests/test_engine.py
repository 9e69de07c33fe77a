"""The ExLlamaV3 plugin against the fake exllamav3 (tests/fake_exllamav3; its README says what it
simulates): the contract, generation, batching, cancellation, errors and the engine's life."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from unillm_exllamav3.engine import ASSUME_GPU_ENV, ExLlamaV3Engine

from unillm import (
    BackendUnavailable,
    ConfigError,
    ContextLengthExceeded,
    EngineClosed,
    GenerationError,
    ModelFormatError,
    ModelNotFound,
    OutOfMemory,
    SamplingParams,
)
from unillm.testing import TinyModel, check_closed, check_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def engine(exl3_dir: Path, exl: Any) -> Iterator[ExLlamaV3Engine]:
    mp = pytest.MonkeyPatch()
    mp.setenv(ASSUME_GPU_ENV, "1")
    with ExLlamaV3Engine(model=str(exl3_dir), context_length=512, options={"seed": 1234}) as e:
        assert e.capabilities == ExLlamaV3Engine.capabilities_for(e.options)
        yield e
    mp.undo()


def load(path: Path, **options: Any) -> ExLlamaV3Engine:
    return ExLlamaV3Engine(model=str(path), context_length=512, options=options).load()


def direct_greedy(path: Path, prompt: str, n: int) -> list[int]:
    """exllamav3 used directly, as its examples do: config, model, cache, tokenizer, generator, a
    job (1.6.5's Job streams exactly max_new_tokens)."""
    from exllamav3 import ArgmaxSampler, Cache, Config, Generator, Job, Model, Tokenizer

    config = Config.from_directory(str(path))
    model = Model.from_config(config)
    cache = Cache(model, max_num_tokens=512)
    model.load(progressbar=False)
    tokenizer = Tokenizer.from_config(config)
    generator = Generator(model=model, cache=cache, tokenizer=tokenizer)
    job = Job(
        input_ids=tokenizer.encode(prompt, encode_special_tokens=True),
        max_new_tokens=n,
        sampler=ArgmaxSampler(),
        stop_conditions=config.eos_token_id_list,
    )
    generator.enqueue(job)
    out: list[int] = []
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if r["stage"] == "streaming" and "token_ids" in r:
                out.extend(r["token_ids"][0].tolist())
    model.unload()
    return out


def test_the_fake_counts_and_asserts_as_exllamav3_1_6_5(exl3_dir: Path) -> None:
    from exllamav3 import ArgmaxSampler, Cache, Config, Generator, Job, Model, Tokenizer

    config = Config.from_directory(str(exl3_dir))
    model = Model.from_config(config)
    late = Model.from_config(config)
    cache = Cache(model, max_num_tokens=512)
    model.load(progressbar=False)
    tokenizer = Tokenizer.from_config(config)
    generator = Generator(model=model, cache=cache, tokenizer=tokenizer)
    ids = tokenizer.encode(PROMPT, encode_special_tokens=True)

    def run(n: int | None) -> int:
        generator.enqueue(Job(input_ids=ids, max_new_tokens=n, sampler=ArgmaxSampler()))
        count = 0
        while generator.num_remaining_jobs():
            count += sum(r["token_ids"].shape[-1] for r in generator.iterate() if "token_ids" in r)
        return count

    assert {n: run(n) for n in (1, 2, 8)} == {1: 1, 2: 2, 8: 8}
    assert run(None) == 512 - ids.shape[-1] - 1  # no limit: what the cache holds
    with pytest.raises(AssertionError, match="max_new_tokens must be >= 1"):
        Job(input_ids=ids, max_new_tokens=0)
    late.load(progressbar=False)
    after = Generator(model=late, cache=Cache(late, max_num_tokens=256), tokenizer=tokenizer)
    with pytest.raises(AssertionError, match=r"BEFORE calling model\.load"):
        after.iterate()  # a cache created after the load is never allocated
    Generator(model=model, cache=cache, tokenizer=tokenizer)
    with pytest.raises(RuntimeError, match="no longer owns its Cache"):
        generator.iterate()
    late.unload()
    model.unload()


def wait_until(condition: Callable[[], bool]) -> None:
    for _ in range(1000):  # a guard against hanging, not a timing assertion
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError("condition never became true")


# ---- the contract ----


def test_the_conformance_checks_pass(engine: ExLlamaV3Engine) -> None:
    passed = check_engine(engine)
    assert "kv-stats" in passed and "tokenizer-round-trip" in passed


def test_a_closed_and_a_never_loaded_engine_refuse_every_call(exl3_dir: Path) -> None:
    e = load(exl3_dir)
    e.close()
    assert "generate" in check_closed(e)
    assert "stream" in check_closed(ExLlamaV3Engine(model=str(exl3_dir)))


def test_greedy_tokens_equal_exllamav3_called_directly(engine: ExLlamaV3Engine, exl3_dir: Path) -> None:
    ours = engine.generate(PROMPT, GREEDY, ignore_eos=True)
    theirs = direct_greedy(exl3_dir, PROMPT, GREEDY.max_tokens)
    assert list(ours.token_ids) == theirs[: len(ours.token_ids)]
    assert len(ours.token_ids) == len(theirs) or ours.finish_reason == "stop"


def test_max_tokens_ends_the_job_inside_exllamav3(engine: ExLlamaV3Engine) -> None:
    gen = engine._generator  # the fake's record of every finished job
    for n in (1, 2, 7):
        out = engine.generate(PROMPT, GREEDY, max_tokens=n, ignore_eos=True)
        assert len(out.token_ids) == n and out.finish_reason == "length"
        assert out.usage.completion_tokens == n
        assert gen.fake_finished[-1]["eos_reason"] == "max_new_tokens"
        assert gen.fake_finished[-1]["new_tokens"] == n


def test_a_stop_string_across_tokens_ends_the_text_before_it(engine: ExLlamaV3Engine) -> None:
    chunks = [c.text for c in engine.stream(PROMPT, GREEDY, ignore_eos=True)]
    # a stop string made of the end of one chunk and the start of the next
    i = next(i for i in range(1, len(chunks)) if len(chunks[i - 1]) >= 2 and chunks[i])
    stop = chunks[i - 1][-2:] + chunks[i][:1]
    before = "".join(chunks)[: "".join(chunks).index(stop)]
    out = engine.generate(PROMPT, GREEDY, ignore_eos=True, stop=[stop])
    assert out.text == before and out.finish_reason == "stop"
    assert engine._generator.fake_finished[-1]["eos_reason"] == "stop_string"


def test_a_stop_token_id_ends_the_completion_before_it(engine: ExLlamaV3Engine) -> None:
    ids = engine.generate(PROMPT, GREEDY, ignore_eos=True).token_ids
    stop = ids[3]
    first = ids.index(stop)
    out = engine.generate(PROMPT, GREEDY, ignore_eos=True, stop_token_ids=[stop])
    assert out.token_ids == ids[:first] and out.finish_reason == "stop"
    assert out.text == engine.detokenize(ids[:first])


def test_the_models_eos_ends_generation(engine: ExLlamaV3Engine) -> None:
    assert engine.eos_token_ids  # read by exllamav3 from config.json, tokenizer and generation config
    eos = min(engine.eos_token_ids)
    out = engine.generate([*engine.tokenize(PROMPT), eos], GREEDY, logit_bias={eos: 100.0})
    assert out.token_ids == () and out.finish_reason == "stop"


def test_sampling_is_seeded_and_sampling_params_reach_the_sampler(engine: ExLlamaV3Engine) -> None:
    hot = SamplingParams(temperature=1.5, max_tokens=16, seed=7, ignore_eos=True)
    a, b = engine.generate(PROMPT, hot), engine.generate(PROMPT, hot)
    assert a.token_ids == b.token_ids
    assert engine.generate(PROMPT, hot, seed=8).token_ids != a.token_ids
    narrow = engine.generate(PROMPT, hot, top_k=1)
    assert narrow.token_ids == engine.generate(PROMPT, GREEDY, max_tokens=16, ignore_eos=True).token_ids
    biased = engine.generate(PROMPT, GREEDY, max_tokens=4, logit_bias={42: 1e4}, ignore_eos=True)
    assert biased.token_ids == (42, 42, 42, 42)
    penalised = engine.generate(PROMPT, GREEDY, max_tokens=4, logit_bias={42: 50.0}, repetition_penalty=1e9)
    assert penalised.token_ids.count(42) <= 1


def test_min_tokens_holds_back_the_stop_tokens(engine: ExLlamaV3Engine) -> None:
    eos = min(engine.eos_token_ids)
    out = engine.generate(PROMPT, GREEDY, max_tokens=6, min_tokens=3, logit_bias={eos: 100.0})
    assert len(out.token_ids) == 3 and out.finish_reason == "stop"


def test_chat_renders_the_models_template(engine: ExLlamaV3Engine) -> None:
    msgs = [{"role": "user", "content": "Hello"}]
    prompt = engine.render_chat(msgs)
    assert "Hello" in prompt and prompt != "Hello"
    out = engine.chat(msgs, GREEDY)
    assert out.text == engine.generate(prompt, GREEDY).text
    assert "".join(c.text for c in engine.stream_chat(msgs, GREEDY)) == out.text


def test_usage_timings_and_prefix_reuse(engine: ExLlamaV3Engine) -> None:
    prompt = " the" * 300
    first = engine.generate(prompt, GREEDY, max_tokens=4)
    again = engine.generate(prompt, GREEDY, max_tokens=4)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens == len(engine.tokenize(prompt))
    assert (again.usage.cached_prompt_tokens or 0) >= 256  # a whole page found again
    assert again.timings.source == "engine"
    stats = engine.kv_stats()
    assert stats.prefix_cache_hits and stats.prefix_cache_queries and stats.prefix_cache_hits >= 256


def test_kv_stats_count_pages_in_use_while_a_request_runs(engine: ExLlamaV3Engine, fake: Any) -> None:
    idle = engine.kv_stats()
    assert idle.capacity_tokens is not None and idle.bytes_per_token is not None
    assert idle.capacity_tokens == engine._cache.max_num_tokens and idle.block_size == 256
    assert idle.total_blocks == idle.capacity_tokens // 256
    assert idle.bytes_per_token == 2 * 2 * 1 * 64 * 2  # K and V x layers x kv heads x head dim x f16
    assert idle.capacity_bytes == idle.bytes_per_token * idle.capacity_tokens
    assert idle.used_tokens == 0 and idle.used_blocks == 0
    fake.STEP_SECONDS = 0.005
    stream = engine.stream(PROMPT, GREEDY, max_tokens=50, ignore_eos=True)
    for _ in range(5):
        next(stream)
    busy = engine.kv_stats()
    assert busy.used_tokens and busy.used_tokens >= len(engine.tokenize(PROMPT))
    assert busy.used_blocks and busy.used_bytes == busy.used_tokens * idle.bytes_per_token
    stream.close()  # type: ignore[attr-defined]
    wait_until(lambda: engine.kv_stats().used_tokens == 0)


def test_reset_forgets_cached_prefixes(engine: ExLlamaV3Engine) -> None:
    prompt = " a" * 300
    engine.generate(prompt, GREEDY, max_tokens=2)
    engine.reset()
    assert not engine.generate(prompt, GREEDY, max_tokens=2).usage.cached_prompt_tokens


# ---- batching and cancellation ----


def test_concurrent_streams_share_forward_passes(engine: ExLlamaV3Engine, fake: Any) -> None:
    prompts = [f"Request {i} says" for i in range(4)]
    alone = [engine.generate(p, GREEDY, ignore_eos=True).token_ids for p in prompts]
    fake.STEP_SECONDS = 0.005
    gen = engine._generator
    before = len(gen.fake_batch_sizes)
    out: dict[int, tuple[int, ...]] = {}

    def one(i: int) -> None:
        out[i] = engine.generate(prompts[i], GREEDY, ignore_eos=True).token_ids

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i] for i in range(4)] == alone  # batching changes nothing in the tokens
    assert max(gen.fake_batch_sizes[before:]) > 1  # their steps were interleaved in shared passes


def test_concurrent_async_streams_batch_too(engine: ExLlamaV3Engine, fake: Any) -> None:
    fake.STEP_SECONDS = 0.005
    gen = engine._generator
    before = len(gen.fake_batch_sizes)

    async def run() -> list[str]:
        return [
            c.text for c in await asyncio.gather(*(engine.agenerate(f"{i} and", GREEDY) for i in range(3)))
        ]

    texts = asyncio.run(run())
    assert all(texts) and max(gen.fake_batch_sizes[before:]) > 1


def test_closing_a_stream_cancels_its_job(engine: ExLlamaV3Engine, fake: Any) -> None:
    fake.STEP_SECONDS = 0.005
    gen = engine._generator
    finished = len(gen.fake_finished)
    stream = engine.stream(PROMPT, GREEDY, max_tokens=200, ignore_eos=True)
    next(stream)
    next(stream)
    assert gen.num_remaining_jobs() == 1
    stream.close()  # type: ignore[attr-defined]
    wait_until(lambda: engine._runner.call(gen.num_remaining_jobs) == 0)
    assert len(gen.fake_finished) == finished  # cancelled, not run to its end
    assert engine.kv_stats().used_tokens == 0  # its pages are free
    assert engine.generate(PROMPT, GREEDY, max_tokens=3).usage.completion_tokens == 3


def test_cancelling_an_async_task_cancels_its_job(engine: ExLlamaV3Engine, fake: Any) -> None:
    fake.STEP_SECONDS = 0.005
    gen = engine._generator

    async def run() -> None:
        async def consume() -> None:
            async for _ in engine.astream(PROMPT, GREEDY, max_tokens=200, ignore_eos=True):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    wait_until(lambda: engine._runner.call(gen.num_remaining_jobs) == 0)


# ---- errors ----


def test_a_prompt_beyond_the_context_is_refused_at_the_call(engine: ExLlamaV3Engine) -> None:
    with pytest.raises(ContextLengthExceeded, match="context window of 512"):
        engine.stream(" the" * 600, GREEDY)
    with pytest.raises(ContextLengthExceeded):
        engine.generate(PROMPT, GREEDY, max_tokens=510)


def test_every_sampling_parameter_is_honoured_so_none_is_refused() -> None:
    from unillm.backend import SamplingParams as Params

    # the unsupported-parameter policy has nothing to refuse here; a new field fails this test
    # (top_logprobs: logprobs above 0, declared on its own; lora, an adapter per request, it has not)
    every = (set(Params.model_fields) - {"lora"}) | {"top_logprobs"}
    assert every == set(ExLlamaV3Engine.capabilities.sampling)


SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "blue"]},
        "ok": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 6},
    },
    "required": ["color", "ok", "name"],
    "additionalProperties": False,
}


def test_response_format_is_enforced_by_exllamav3s_llguidance_filter(engine: ExLlamaV3Engine) -> None:
    from pydantic import BaseModel, ConfigDict, Field

    for seed in range(4):  # sampled at temperature 1: only the filter keeps it in the schema
        out = engine.generate(PROMPT, temperature=1.0, seed=seed, max_tokens=100, response_format=SCHEMA)
        value = out.parsed()
        assert value["color"] in ("red", "blue") and len(value["name"]) <= 6, out.text
        assert out.finish_reason == "stop" and " " not in out.text.split('"name"')[0]  # compact JSON
        assert engine._generator.fake_finished[-1]["eos_reason"] == "end_filter"

    class Pet(BaseModel):
        model_config = ConfigDict(extra="forbid")  # else the schema lets extra keys run on
        kind: str = Field(pattern="^(cat|dog)$")
        legs: bool

    pet = engine.generate(PROMPT, temperature=1.0, seed=3, max_tokens=100, response_format=Pet).parsed()
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog")
    assert engine.generate(PROMPT, GREEDY, response_format={"type": "json_object"}).parsed() == {}
    with pytest.raises(ConfigError, match="ignore_eos cannot be combined"):
        engine.generate(PROMPT, GREEDY, response_format=SCHEMA, ignore_eos=True)


def test_a_schema_llguidance_cannot_enforce_is_refused_at_the_call(engine: ExLlamaV3Engine) -> None:
    bad = {"type": "string", "pattern": "(?=x)y"}  # look-ahead: no regular language
    with pytest.raises(ConfigError, match="cannot enforce this response_format"):
        engine.stream(PROMPT, GREEDY, response_format=bad)
    assert engine.generate(PROMPT, GREEDY, max_tokens=2).usage.completion_tokens == 2


def test_logprobs_are_the_models_own(engine: ExLlamaV3Engine) -> None:
    import numpy as np

    out = engine.generate(PROMPT, GREEDY, max_tokens=8, ignore_eos=True, logprobs=1)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 8
    model = engine._models[0]  # the fake's table: log-softmax of the logits before the sampler
    seq = engine.tokenize(PROMPT)
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        row = np.asarray(model.fake_logits(seq), dtype=np.float64)
        want = row[token] - (row.max() + np.log(np.exp(row - row.max()).sum()))
        assert lp == pytest.approx(want, abs=1e-4) and lp <= 0.0
        seq.append(token)
    stop = out.token_ids[5]
    cut = engine.generate(PROMPT, GREEDY, max_tokens=8, ignore_eos=True, logprobs=1, stop_token_ids=[stop])
    assert cut.logprobs == pytest.approx(out.logprobs[: len(cut.token_ids)], abs=1e-6)
    assert engine.generate(PROMPT, GREEDY, max_tokens=4).logprobs is None
    top = engine.generate(PROMPT, GREEDY, max_tokens=8, ignore_eos=True, logprobs=3)
    assert top.logprobs == pytest.approx(out.logprobs, abs=1e-5) and top.top_logprobs is not None
    seq = engine.tokenize(PROMPT)
    for token, alternatives in zip(top.token_ids, top.top_logprobs, strict=True):
        row = np.asarray(model.fake_logits(seq), dtype=np.float64)
        lsm = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
        want = sorted(range(len(lsm)), key=lambda t: (-lsm[t], t))[:3]
        assert [t for t, _ in alternatives] == want
        assert [v for _, v in alternatives] == pytest.approx([lsm[t] for t in want], abs=1e-4)
        seq.append(token)


def test_a_job_exllamav3_fails_alone_fails_only_its_own_stream(engine: ExLlamaV3Engine, fake: Any) -> None:
    # exllamav3 1.6 contains a failed prompt evaluation to its job: an "error" result, not a raise
    fake.STEP_SECONDS = 0.005
    other = engine.stream(PROMPT, GREEDY, max_tokens=40, ignore_eos=True)
    next(other)  # generating: the next prompt is evaluated beside it
    fake.FAIL_NEXT_PREFILL = "CUDA out of memory. Tried to allocate 8.00 GiB"
    with pytest.raises(OutOfMemory, match="while generating"):
        engine.generate("A prompt that fails", GREEDY)
    assert len([c for c in other]) > 0  # the other request ran to its end
    fake.FAIL_NEXT_PREFILL = "an illegal memory access"
    with pytest.raises(GenerationError, match="illegal memory access"):
        engine.generate(PROMPT, GREEDY)
    assert engine.kv_stats().used_tokens == 0  # the failed jobs' pages are free
    assert engine.generate(PROMPT, GREEDY, max_tokens=2).usage.completion_tokens == 2


def test_an_exllamav3_whose_job_counts_one_short_still_gives_max_tokens(
    exl3_dir: Path, exl: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # exllamav3 1.4.1's Job kept max_new_tokens - 1 (and stopped num_draft_tokens early): the
    # plugin reads that from a Job at load and asks for that many more
    class ShortJob(exl.Job):  # type: ignore[name-defined,misc]
        def __init__(self, *args: Any, max_new_tokens: int | None = None, **kwargs: Any) -> None:
            super().__init__(*args, max_new_tokens=max_new_tokens, **kwargs)
            self.max_new_tokens = (max_new_tokens or 2) - 1 or 1

    monkeypatch.setattr(exl, "Job", ShortJob)
    with load(exl3_dir) as e:
        for n in (1, 2, 7):
            out = e.generate(PROMPT, GREEDY, max_tokens=n, ignore_eos=True)
            assert len(out.token_ids) == n and out.finish_reason == "length"
            assert e._generator.fake_finished[-1]["eos_reason"] == "max_new_tokens"


def test_a_failing_step_is_a_generation_error_and_the_engine_carries_on(
    engine: ExLlamaV3Engine, fake: Any
) -> None:
    fake.FAIL_NEXT_STEP = "CUDA error: an illegal memory access was encountered"
    with pytest.raises(GenerationError, match="illegal memory access"):
        engine.generate(PROMPT, GREEDY)
    fake.FAIL_NEXT_STEP = "CUDA out of memory. Tried to allocate 2.00 GiB"
    with pytest.raises(OutOfMemory):
        engine.generate(PROMPT, GREEDY)
    assert engine.generate(PROMPT, GREEDY, max_tokens=2).usage.completion_tokens == 2


def test_bad_paths_are_typed_errors(tiny: TinyModel, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound):
        load(tmp_path / "missing")
    with pytest.raises(ModelFormatError, match="is a file"):
        load(tiny.gguf_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFormatError, match=r"without config\.json"):
        load(tmp_path / "empty")


def test_weights_that_do_not_fit_are_out_of_memory(exl3_dir: Path, fake: Any) -> None:
    fake.GPU_MEMORY[0] -= fake.free_bytes(0) - 2**20  # 1 MiB left on the GPU
    with pytest.raises(OutOfMemory, match="does not fit in GPU memory"):
        load(exl3_dir)
    assert fake.free_bytes(0) == 2**20  # nothing left allocated


def test_no_gpu_is_unavailable_with_the_reason(exl3_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ASSUME_GPU_ENV, "0")
    avail = ExLlamaV3Engine.available()
    assert not avail.available and "NVIDIA (CUDA) GPU" in avail.reason and "llama.cpp" in avail.reason
    assert avail.install_hint == "pip install unillm-exllamav3 exllamav3"
    with pytest.raises(BackendUnavailable, match="NVIDIA"):
        load(exl3_dir)


def test_options_are_validated(exl3_dir: Path) -> None:
    with pytest.raises(ConfigError, match="cache_type"):
        ExLlamaV3Engine(model=str(exl3_dir), options={"cache_type": "q3"})
    with pytest.raises(ConfigError, match="valid exllamav3 options"):
        ExLlamaV3Engine(model=str(exl3_dir), options={"gpu_split": [20]})
    with pytest.raises(ConfigError, match="disagree"):
        ExLlamaV3Engine(model=str(exl3_dir), context_length=512, options={"max_seq_len": 256}).load()


# ---- the engine's life ----


def test_close_twice_is_harmless(exl3_dir: Path, fake: Any) -> None:
    free = fake.free_bytes(0)
    e = load(exl3_dir)
    assert fake.free_bytes(0) < free
    e.close()
    e.close()
    assert fake.free_bytes(0) == free  # weights and cache given back
    with pytest.raises(EngineClosed):
        e.generate(PROMPT)


def test_close_while_streaming_ends_the_stream(exl3_dir: Path, fake: Any) -> None:
    fake.STEP_SECONDS = 0.005
    e = load(exl3_dir)
    stream = e.stream(PROMPT, GREEDY, max_tokens=400, ignore_eos=True)
    next(stream)
    closer = threading.Thread(target=e.close)
    closer.start()
    with pytest.raises(EngineClosed):
        for _ in stream:
            pass
    closer.join(timeout=30)
    assert not closer.is_alive()


def test_a_draft_model_gives_the_same_greedy_tokens(engine: ExLlamaV3Engine, exl3_dir: Path) -> None:
    want = engine.generate(PROMPT, GREEDY, ignore_eos=True).token_ids
    with load(exl3_dir, draft_model=str(exl3_dir), num_draft_tokens=3) as e:
        out = e.generate(PROMPT, GREEDY, ignore_eos=True)
        assert out.token_ids == want and out.finish_reason == "length"
        assert e._generator.fake_finished[-1]["accepted_draft_tokens"] > 0


def test_load_options_reach_exllamav3(exl3_dir: Path, fake: Any) -> None:
    fake.GPU_MEMORY[:] = [24 * 2**30] * 2
    with load(exl3_dir, tensor_parallel=True, moe_tensor_split=True, tp_backend="nccl") as e:
        call = e._models[0].fake_load_calls[-1]
        assert call["tensor_p"] and call["tp_backend"] == "nccl"
        assert call["tp_options"] == {"moe_tensor_split": True}
        assert e._models[0].active_devices == [0, 1]
        assert e.generate(PROMPT, GREEDY, max_tokens=3).usage.completion_tokens == 3
    with load(exl3_dir, use_per_device=[0, 20], cache_type="q4", max_batch_size=2, cache_size=1024) as e:
        assert e._models[0].fake_load_calls[-1]["use_per_device"] == [0, 20]
        assert e._models[0].active_devices == [1]
        stats = e.kv_stats()
        assert stats.capacity_tokens == 1024 and stats.dtype == "q4"
        assert stats.bytes_per_token and stats.bytes_per_token < 512  # Q4 K and V, scales included
        assert e.capabilities.batching
    with load(exl3_dir, max_batch_size=1) as e:
        assert not e.capabilities.batching
