"""The ExLlamaV2 backend on CPU, against a fake of the exllamav2 API (tests/fake_exllamav2).

exllamav2 needs CUDA, so these tests put a fake of its API on ``sys.path`` (same names, call shapes,
assertions and result dicts as exllamav2 0.3.x, a toy model instead of a GPU; its README says what
it simulates) and tell the backend to assume a GPU. The real thing runs in scripts/gpu_check.sh.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from unillm import (
    BackendUnavailable,
    ConfigError,
    ContextLengthExceeded,
    ModelFormatError,
    ModelNotFound,
    OutOfMemory,
    SamplingParams,
    UnillmWarning,
    Workload,
    auto_engine,
    inspect_model,
    load_hardware,
    plan,
)
from unillm._hardware import _quick
from unillm.backend import Cost, EngineConfig, Facts, hf_chat_template, kv_dtype
from unillm.engines.exllamav2 import ASSUME_GPU_ENV, ExLlamaV2Engine
from unillm.testing import TinyModel, check_engine
from unillm.testing._tiny import CHAT_TEMPLATE

ROOT = Path(__file__).resolve().parent.parent
FAKE = Path(__file__).resolve().parent / "fake_exllamav2"
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
LAPTOP = Path(__file__).resolve().parent / "profiles" / "laptop-8gb-cpu.json"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module", autouse=True)
def exl() -> Iterator[ModuleType]:
    """The fake exllamav2, importable for this module's tests only, and a GPU assumed."""
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(FAKE))
    mp.setenv(ASSUME_GPU_ENV, "1")
    import exllamav2

    assert Path(exllamav2.__file__).is_relative_to(FAKE)
    yield exllamav2
    mp.undo()
    for name in [m for m in sys.modules if m == "exllamav2" or m.startswith("exllamav2.")]:
        del sys.modules[name]


@pytest.fixture
def fake(exl: ModuleType) -> Iterator[Any]:
    """The fake's knobs (GPU memory, step time), restored after the test.

    Its GPU memory is freed when a cache is collected, as torch's is, and exllamav2 used directly
    (raw_greedy) leaves its cache in a reference cycle: what earlier tests left is collected first,
    so a collection during the test cannot move the reading it compares against (--random-order
    found this: the close test read 512 KiB less after close than before).
    """
    from exllamav2 import _fake

    gc.collect()
    memory, step = list(_fake.GPU_MEMORY), _fake.STEP_SECONDS
    yield _fake
    _fake.GPU_MEMORY[:] = memory
    _fake.STEP_SECONDS = step


@pytest.fixture(scope="module")
def engine(tiny: TinyModel) -> Iterator[ExLlamaV2Engine]:
    with ExLlamaV2Engine(model=str(tiny.hf_dir), context_length=512, options={"seed": 1234}) as e:
        # what the selector sees for these options is what the loaded engine does
        assert e.capabilities == ExLlamaV2Engine.capabilities_for(e.options)
        assert e.capabilities.batching and e._generator.paged
        yield e


def load(tiny: TinyModel, **options: Any) -> ExLlamaV2Engine:
    return ExLlamaV2Engine(model=str(tiny.hf_dir), context_length=512, options=options).load()


def raw_greedy(tiny: TinyModel, prompt: str, n: int, *, paged: bool = True) -> list[int]:
    """exllamav2 used directly, as a user would without unillm: a job on a dynamic generator."""
    from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
    from exllamav2.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler

    config = ExLlamaV2Config(str(tiny.hf_dir))
    config.max_seq_len = 512
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, max_seq_len=512, lazy=True)
    model.load_autosplit(cache)
    tokenizer = ExLlamaV2Tokenizer(config)
    generator = ExLlamaV2DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer, paged=paged)
    job = ExLlamaV2DynamicJob(
        input_ids=tokenizer.encode(prompt, encode_special_tokens=True),
        max_new_tokens=n,
        gen_settings=ExLlamaV2Sampler.Settings.greedy(),
        stop_conditions=[tokenizer.eos_token_id],
    )
    generator.enqueue(job)
    out: list[int] = []
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if r["stage"] == "streaming" and "token_ids" in r:
                out.extend(r["token_ids"][0].tolist())
    model.unload()
    return out


def wait_until(condition: Callable[[], bool]) -> None:
    for _ in range(1000):  # a guard against hanging, not a timing assertion
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError("condition never became true")


# ---- availability ----


def test_no_gpu_is_unavailable_with_the_reason_and_the_alternatives(
    tiny: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ASSUME_GPU_ENV, "0")
    avail = ExLlamaV2Engine.available()
    assert not avail.available
    assert "NVIDIA (CUDA) or AMD (ROCm) GPU" in avail.reason
    assert "llama.cpp" in avail.reason and "MLX" in avail.reason
    assert avail.install_hint == "pip install 'unillm[exllamav2]'"
    with pytest.raises(BackendUnavailable, match=r"unillm\[exllamav2\]"):
        auto_engine(tiny.hf_dir, backend="exllamav2")
    with pytest.raises(BackendUnavailable, match="GPU"):
        ExLlamaV2Engine(model=str(tiny.hf_dir)).load()


def test_the_gpu_probe_decides_when_not_told(monkeypatch: pytest.MonkeyPatch) -> None:

    monkeypatch.delenv(ASSUME_GPU_ENV)
    monkeypatch.setattr(_quick, "gpu_probe", lambda: False)
    assert not ExLlamaV2Engine.available().available
    monkeypatch.setattr(_quick, "gpu_probe", lambda: True)
    assert ExLlamaV2Engine.available().available


def test_not_installed_and_failing_import(tiny: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "exllamav2" else real(n, *a))
    avail = ExLlamaV2Engine.available()
    assert (avail.available, avail.reason) == (False, "exllamav2 is not installed")
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: object() if n == "exllamav2" else real(n, *a)
    )
    monkeypatch.setitem(sys.modules, "exllamav2", None)  # `import exllamav2` raises ImportError
    with pytest.raises(BackendUnavailable, match="failed to import"):
        ExLlamaV2Engine(model=str(tiny.hf_dir)).load()


def test_registered_after_mlx_and_cheap_to_ask() -> None:
    import unillm

    names = list(unillm.backends())
    assert names.index("exllamav2") == names.index("mlx") + 1
    code = "import unillm, sys; unillm.backends()['exllamav2'].availability(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- load options reach exllamav2 ----


@pytest.mark.parametrize(
    ("cache_type", "cls", "bpt"),
    [
        ("fp16", "ExLlamaV2Cache", 512),
        ("q8", "ExLlamaV2Cache_Q8", 272),
        ("q6", "ExLlamaV2Cache_Q6", 208),
        ("q4", "ExLlamaV2Cache_Q4", 144),
    ],
)
def test_cache_type_and_size(tiny: TinyModel, cache_type: str, cls: str, bpt: int) -> None:
    with load(tiny, cache_type=cache_type, max_batch_size=4) as e:
        cache = e._cache
        assert type(cache).__name__ == cls
        assert cache.max_seq_len == 512 * 4 and cache.batch_size == 1
        stats = e.kv_stats()
        # 2 layers x 1 KV head x 64 dims, at the cache's element size plus its scales
        assert (stats.bytes_per_token, stats.dtype) == (bpt, cache_type)
        assert stats.capacity_bytes == bpt * cache.max_seq_len
        # what exllamav2 allocated: that, plus a quantized cache's FP16 buffer on its one GPU
        buffer = 4 * 64 * cache.max_seq_len if cache_type != "fp16" else 0
        assert sum(cache.footprint()) == stats.capacity_bytes + buffer
        assert e.generate(PROMPT, GREEDY).usage.completion_tokens == 24


def test_autosplit_by_default_and_an_explicit_gpu_split(tiny: TinyModel, fake: Any) -> None:
    with load(tiny) as e:
        model = e._models[0]
        assert model.fake_load_calls == [("load_autosplit", None)]
        assert e._cache.max_seq_len == 512 * 8  # max_seq_len x max_batch_size by default
    weights = sum(p.stat().st_size for p in tiny.hf_dir.glob("*.safetensors"))
    fake.GPU_MEMORY[:] = [2**30, 2**30]
    first = 0.6 * weights / 1024**3  # GB: room for the embedding and layer 0 (a quarter each)
    with load(tiny, gpu_split=[first, 1.0], cache_size=1000) as e:
        model = e._models[0]
        assert model.fake_load_calls == [("load", [first, 1.0])]
        assert set(model.cache_map.values()) == {"cuda:0", "cuda:1"}  # the layers span both GPUs
        assert e._cache.max_seq_len == 1024  # rounded up to whole 256-token pages
        assert list(e.generate(PROMPT, GREEDY).token_ids) == raw_greedy(tiny, PROMPT, 24)


def test_sequence_length_chunk_size_and_batch_reach_the_generator(tiny: TinyModel) -> None:
    with ExLlamaV2Engine(
        model=str(tiny.hf_dir), options={"max_seq_len": 300, "max_chunk_size": 256, "max_batch_size": 3}
    ) as e:
        gen, config = e._generator, e._config
        assert config.max_seq_len == gen.max_seq_len == 300
        assert config.max_input_len == gen.max_chunk_size == 256
        assert gen.max_batch_size == 3 and gen.paged and e.capabilities.batching
        assert config.arch_compat_calls == 1
        long_prompt = " the" * 270  # 270 tokens: two prefill chunks
        assert e.generate(long_prompt, GREEDY, max_tokens=8).usage.prompt_tokens > 256
    with ExLlamaV2Engine(model=str(tiny.hf_dir)) as e:
        assert e._config.max_seq_len == 4096  # min(the trained 4096, the default 4096)
    with pytest.raises(ConfigError, match="disagree"):
        ExLlamaV2Engine(model=str(tiny.hf_dir), context_length=512, options={"max_seq_len": 300}).load()
    with pytest.raises(ConfigError, match="multiple of 256"):
        ExLlamaV2Engine(model=str(tiny.hf_dir), options={"max_chunk_size": 300})
    with pytest.raises(ConfigError, match="max_chunk_size >= 2048"):
        load(tiny, max_batch_size=256, max_chunk_size=256)


def test_capabilities_follow_the_options_and_flash_attn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Paged mode (batching) when asked, or, unset, when a flash-attn exllamav2 pages with is
    installed: found without importing it (the fake's stand-in beside the fake exllamav2)."""
    import importlib.util

    caps = ExLlamaV2Engine.capabilities_for
    assert caps(ExLlamaV2Engine.Options()).batching is True
    assert caps(ExLlamaV2Engine.Options(paged=True)).batching is True
    assert caps(ExLlamaV2Engine.Options(paged=False)).batching is False
    assert "flash_attn" not in sys.modules  # looked up, never imported
    monkeypatch.setenv("EXLLAMA_NO_FLASH_ATTN", "1")  # exllamav2's switch
    assert caps(ExLlamaV2Engine.Options()).batching is False
    monkeypatch.delenv("EXLLAMA_NO_FLASH_ATTN")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "flash_attn" else real(n, *a))
    assert caps(ExLlamaV2Engine.Options()).batching is False


def hide_flash_attn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine without flash-attn: not installed, and exllamav2 found none."""
    import importlib.util

    from exllamav2 import attn

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "flash_attn" else real(n, *a))
    monkeypatch.setattr(attn, "has_flash_attn_with_paged", False)


def test_unpaged_without_flash_attn(tiny: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    hide_flash_attn(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no surprise: the options said unpaged
        e = load(tiny)
    with e:
        assert not e._generator.paged and e._generator.max_batch_size == 1
        assert not e.capabilities.batching  # one request at a time, serialized by the base class
        assert e.capabilities == ExLlamaV2Engine.capabilities_for(e.options)
        assert list(e.generate(PROMPT, GREEDY).token_ids) == raw_greedy(tiny, PROMPT, 24, paged=False)
        assert e.kv_stats().block_size is None
    with pytest.raises(ConfigError, match="flash-attn"):
        load(tiny, paged=True)


def test_flash_attn_exllamav2_cannot_page_with(tiny: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """flash-attn is installed (so the options declared paged mode) but exllamav2 cannot page with
    it: the load says so and the engine's capabilities say what it does."""
    from exllamav2 import attn

    monkeypatch.setattr(attn, "has_flash_attn_with_paged", False)
    assert ExLlamaV2Engine.capabilities_for(ExLlamaV2Engine.Options()).batching
    with pytest.warns(UnillmWarning, match="cannot use its paged attention"):
        e = load(tiny)
    with e:
        assert not e._generator.paged and not e.capabilities.batching
        assert len(e.generate(PROMPT, GREEDY).token_ids) == 24
    with pytest.raises(ConfigError, match="flash-attn"):
        load(tiny, paged=True)


def test_draft_model_for_speculative_decoding(tiny: TinyModel, engine: ExLlamaV2Engine) -> None:
    with load(tiny, draft_model=str(tiny.hf_dir)) as e:
        gen = e._generator
        assert gen.draft_model is e._models[1] and gen.num_draft_tokens == 4
        done = e.generate(PROMPT, GREEDY)
        assert done.token_ids == engine.generate(PROMPT, GREEDY).token_ids
        assert (len(done.token_ids), done.finish_reason) == (24, "length")
        assert gen.fake_finished[-1]["accepted_draft_tokens"] > 0
    with pytest.raises(ModelNotFound):
        load(tiny, draft_model="/nowhere/draft")


# ---- generation ----


def test_greedy_is_deterministic_and_equals_exllamav2_used_directly(
    engine: ExLlamaV2Engine, tiny: TinyModel
) -> None:
    for prompt in (PROMPT, "Once upon a time", "0 1 2 3 4 5 6 7 8 9"):
        done = engine.generate(prompt, GREEDY)
        assert list(done.token_ids) == raw_greedy(tiny, prompt, 24)
        assert done.token_ids == engine.generate(prompt, GREEDY).token_ids
        assert done.text == engine.detokenize(done.token_ids)


def test_token_id_prompts_and_the_tokenizer(engine: ExLlamaV2Engine) -> None:
    ids = engine.tokenize(PROMPT)
    assert engine.detokenize(ids) == PROMPT
    assert engine.generate(ids, GREEDY).token_ids == engine.generate(PROMPT, GREEDY).token_ids
    assert engine.tokenize("<|im_start|>user")[0] == 1  # special tokens are parsed
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        engine.generate([5, 9999], GREEDY)


def test_seeded_sampling_is_reproducible(engine: ExLlamaV2Engine) -> None:
    p = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, max_tokens=24)
    a = engine.generate(PROMPT, p, seed=7).token_ids
    assert a == engine.generate(PROMPT, p, seed=7).token_ids
    assert a != engine.generate(PROMPT, p, seed=8).token_ids
    assert a != engine.generate(PROMPT, GREEDY).token_ids
    # an unseeded request takes the engine's default seed (1234)
    assert engine.generate(PROMPT, p).token_ids == engine.generate(PROMPT, p, seed=1234).token_ids
    settings = engine._generator.fake_finished[-1]["job"].gen_settings
    assert (settings.temperature, settings.top_k, settings.top_p, settings.min_p) == (1.0, 50, 0.9, 0.01)
    assert settings.token_repetition_penalty == 1.0  # not exllamav2's default of 1.025


def test_top_k_one_is_greedy_and_penalties_change_the_output(engine: ExLlamaV2Engine) -> None:
    base = engine.generate(PROMPT, GREEDY, max_tokens=64).token_ids  # the toy model repeats itself
    assert engine.generate(PROMPT, max_tokens=64, temperature=1.0, top_k=1).token_ids == base
    penalized = engine.generate(PROMPT, GREEDY, max_tokens=64, repetition_penalty=1.5, frequency_penalty=1.0)
    assert penalized.token_ids != base
    settings = engine._generator.fake_finished[-1]["job"].gen_settings
    assert (settings.token_repetition_penalty, settings.token_frequency_penalty) == (1.5, 1.0)


def test_max_tokens_finishes_with_length(engine: ExLlamaV2Engine) -> None:
    done = engine.generate(PROMPT, GREEDY, max_tokens=5)
    assert (len(done.token_ids), done.finish_reason) == (5, "length")
    assert engine._generator.fake_finished[-1]["eos_reason"] == "max_new_tokens"


def test_stop_strings_end_the_job_inside_exllamav2(engine: ExLlamaV2Engine) -> None:
    full = engine.generate(PROMPT, GREEDY)
    pieces = [engine.detokenize([t]) for t in full.token_ids]
    # a stop string across the boundary of the 6th and 7th tokens
    cut_at = len("".join(pieces[:6]))
    stop = full.text[cut_at - 1 : cut_at + 1]
    cut = engine.generate(PROMPT, GREEDY, stop=[stop])
    assert (cut.text, cut.finish_reason) == (full.text[: full.text.find(stop)], "stop")
    last = engine._generator.fake_finished[-1]
    assert (last["eos_reason"], last["eos_triggering_string"]) == ("stop_string", stop)
    assert last["new_tokens"] < 24  # the job stopped there, not at max_tokens
    assert stop in last["job"].stop_strings
    streamed = "".join(c.text for c in engine.stream(PROMPT, GREEDY, stop=[stop]))
    assert streamed == cut.text


def test_stop_token_ids_and_eos(engine: ExLlamaV2Engine) -> None:
    full = engine.generate(PROMPT, GREEDY)
    stop_id = full.token_ids[5]
    stopped = engine.generate(PROMPT, GREEDY, stop_token_ids=[stop_id])
    want = full.token_ids[: full.token_ids.index(stop_id)]
    assert (stopped.token_ids, stopped.finish_reason) == (want, "stop")
    assert stopped.text == engine.detokenize(want)
    last = engine._generator.fake_finished[-1]
    assert (last["eos_reason"], last["eos_triggering_token_id"]) == ("stop_token", stop_id)
    eos = engine._tokenizer.eos_token_id
    assert eos in last["job"].stop_tokens  # EOS always ends a job...
    engine.generate(PROMPT, GREEDY, ignore_eos=True)
    assert eos not in engine._generator.fake_finished[-1]["job"].stop_tokens  # ...unless ignored


def test_text_held_for_a_partial_stop_string_survives_a_stop_token(engine: ExLlamaV2Engine) -> None:
    """exllamav2 holds text that may begin a stop string; when a stop token ends the job instead,
    it reports that text under ``held``. It is part of the completion."""
    full = engine.generate(PROMPT, GREEDY)
    ids = full.token_ids
    k = next(i for i in range(3, 24) if engine.detokenize([ids[i - 1]]).strip() and ids[i] not in ids[:i])
    piece = engine.detokenize([full.token_ids[k - 1]])
    done = engine.generate(PROMPT, GREEDY, stop=[piece + "\x00never"], stop_token_ids=[full.token_ids[k]])
    last = engine._generator.fake_finished[-1]
    assert last["eos_reason"] == "stop_token" and "held" in last
    assert done.token_ids == full.token_ids[:k]
    assert (done.text, done.finish_reason) == (engine.detokenize(full.token_ids[:k]), "stop")


def test_usage_and_timings_come_from_the_result_dict(engine: ExLlamaV2Engine, fake: Any) -> None:
    fake.STEP_SECONDS = 0.001
    done = engine.generate(PROMPT, GREEDY)
    last = engine._generator.fake_finished[-1]
    assert done.usage.prompt_tokens == last["prompt_tokens"] == len(engine.tokenize(PROMPT))
    assert done.usage.completion_tokens == last["new_tokens"] == 24
    assert done.usage.cached_prompt_tokens == last["cached_tokens"]
    t = done.timings
    assert t.source == "engine"
    assert (t.prefill_s, t.decode_s) == (last["time_prefill"], last["time_generate"])
    assert t.decode_s > 0 and t.decode_tokens_per_s == pytest.approx(23 / t.decode_s)


def test_prefix_pages_are_reused_and_counted(engine: ExLlamaV2Engine) -> None:
    engine.reset()
    before = engine.kv_stats()
    prompt = " the" * 300  # 300 tokens: more than one 256-token page
    assert len(engine.tokenize(prompt)) == 300
    first = engine.generate(prompt, GREEDY)
    assert first.usage.cached_prompt_tokens == 0
    again = engine.generate(prompt, GREEDY)
    assert again.usage.cached_prompt_tokens == 256 and again.token_ids == first.token_ids
    stats = engine.kv_stats()
    # prompt tokens looked up (two prompts of 300) and those served from the cache (one page)
    assert stats.prefix_cache_queries == before.prefix_cache_queries + 600
    assert stats.prefix_cache_hits == before.prefix_cache_hits + 256
    engine.reset()
    assert engine.generate(prompt, GREEDY).usage.cached_prompt_tokens == 0


def test_chat_renders_the_hf_template(engine: ExLlamaV2Engine, tiny: TinyModel) -> None:
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    rendered = engine.render_chat(messages)
    assert rendered == "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n"
    assert engine._chat_template() == CHAT_TEMPLATE
    assert engine.tokenize(rendered).count(1) == 2  # <|im_start|> as its special token, twice
    reply = engine.chat(messages, GREEDY)
    assert reply.token_ids == engine.generate(rendered, GREEDY).token_ids
    assert "".join(c.text for c in engine.stream_chat(messages, GREEDY)) == reply.text


def test_chat_template_sources(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert hf_chat_template(tmp_path, {"chat_template": named}) == "D"
    assert hf_chat_template(tmp_path, {"chat_template": named[:1]}) is None  # no default named
    assert hf_chat_template(tmp_path, {}) is None
    (tmp_path / "chat_template.jinja").write_text("J")
    assert hf_chat_template(tmp_path, {}) == "J"
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "S"}')
    assert hf_chat_template(tmp_path) == "S"  # the string in the config comes first


# ---- concurrency and cancellation ----


def test_concurrent_callers_become_jobs_of_one_batch(engine: ExLlamaV2Engine, fake: Any) -> None:
    fake.STEP_SECONDS = 0.002  # simulated GPU time per step, so that the callers meet
    prompts = [f"Request {i} says" for i in range(4)]
    alone = [engine.generate(p, GREEDY, max_tokens=32, ignore_eos=True).token_ids for p in prompts]
    gen = engine._generator
    start = len(gen.fake_batch_sizes)
    active: list[int] = []

    async def one(prompt: str) -> tuple[int, ...]:
        ids: list[int] = []
        async for chunk in engine.astream(prompt, GREEDY, max_tokens=32, ignore_eos=True):
            active.append(engine._runner.active)
            ids.extend(chunk.token_ids)
        return tuple(ids)

    async def main() -> list[tuple[int, ...]]:
        return list(await asyncio.gather(*(one(p) for p in prompts)))

    together = asyncio.run(main())
    assert max(gen.fake_batch_sizes[start:]) > 1  # several jobs in one forward pass
    assert max(active) > 1
    assert together == alone  # each caller got what it gets alone


def test_breaking_a_stream_cancels_its_job(engine: ExLlamaV2Engine, fake: Any) -> None:
    gen = engine._generator
    full = engine.generate(PROMPT, GREEDY)
    finished = len(gen.fake_finished)
    fake.STEP_SECONDS = 0.005  # 480 steps: the job would run for seconds
    stream = engine.stream(PROMPT, GREEDY, max_tokens=480, ignore_eos=True)
    got = [next(stream) for _ in range(3)]
    assert gen.num_remaining_jobs() == 1
    stream.close()  # type: ignore[attr-defined]
    wait_until(lambda: gen.num_remaining_jobs() == 0)
    assert len(gen.fake_finished) == finished  # cancelled, never ran to its end
    assert engine.kv_stats().used_tokens == 0  # its pages were released
    assert [c.token_ids[0] for c in got] == list(full.token_ids[:3])
    assert engine.generate(PROMPT, GREEDY).token_ids == full.token_ids


def test_cancelling_a_task_cancels_its_job(engine: ExLlamaV2Engine, fake: Any) -> None:
    fake.STEP_SECONDS = 0.002
    gen = engine._generator
    finished = len(gen.fake_finished)

    async def main() -> None:
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.astream(PROMPT, GREEDY, max_tokens=400, ignore_eos=True):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    wait_until(lambda: gen.num_remaining_jobs() == 0)
    assert len(gen.fake_finished) == finished


def test_kv_stats_while_running_and_after(engine: ExLlamaV2Engine, fake: Any) -> None:
    fake.STEP_SECONDS = 0.01  # the job runs 4 s on
    idle = engine.kv_stats()
    assert (idle.capacity_tokens, idle.block_size, idle.total_blocks) == (512 * 8, 256, 16)
    assert (idle.used_tokens, idle.used_blocks, idle.used_bytes) == (0, 0, 0)
    assert idle.bytes_per_token == 2 * 2 * 1 * 64 * 2  # K and V, 2 layers, 1 KV head, fp16
    stream = engine.stream(PROMPT, GREEDY, max_tokens=400, ignore_eos=True)
    for _ in range(5):
        next(stream)
    # the job runs on while the caller reads (results are queued); kv_stats is answered between
    # two of its steps (it once shared a lock with the worker, and could wait out the whole job)
    busy = engine.kv_stats()
    n = len(engine.tokenize(PROMPT))
    assert busy.used_blocks == 2  # pages for the prompt and all 400 new tokens, taken up front
    assert n + 4 <= busy.used_tokens < n + 400 and busy.used_bytes == busy.used_tokens * 512
    stream.close()  # type: ignore[attr-defined]
    wait_until(lambda: engine.kv_stats().used_blocks == 0)


def test_an_engine_failure_mid_generation_is_mapped_and_survived(
    engine: ExLlamaV2Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = engine._generator
    real = gen.iterate
    calls = {"n": 0}

    def failing() -> list[dict[str, Any]]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real()

    monkeypatch.setattr(gen, "iterate", failing)
    with pytest.raises(OutOfMemory, match="while generating"):
        engine.generate(PROMPT, GREEDY)
    assert gen.num_remaining_jobs() == 0
    monkeypatch.setattr(gen, "iterate", real)
    assert len(engine.generate(PROMPT, GREEDY).token_ids) == 24


def test_conformance(engine: ExLlamaV2Engine) -> None:
    assert check_engine(engine, PROMPT) == [
        "generate-equals-stream",
        "final-chunk",
        "max-tokens",
        "stop-strings",
        "break-and-resume",
        "async-mirror",
        "kv-stats",
        "tokenizer-round-trip",
    ]


# ---- errors ----


def test_context_too_long_fails_before_any_work(engine: ExLlamaV2Engine) -> None:
    serial = engine._generator.job_serial
    with pytest.raises(ContextLengthExceeded, match="512"):
        engine.stream(" the" * 600, GREEDY)
    with pytest.raises(ContextLengthExceeded, match="max_tokens=24") as err:
        engine.stream(" the" * 500, GREEDY)  # 500 tokens fit, 524 do not
    assert (err.value.prompt_tokens, err.value.context_length, err.value.max_tokens) == (500, 512, 24)
    assert engine._generator.job_serial == serial  # no job was made


def copy_hf(tiny: TinyModel, dest: Path) -> Path:
    shutil.copytree(tiny.hf_dir, dest)
    return dest


def test_not_a_model_directory(tmp_path: Path, tiny: TinyModel) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFormatError, match=r"config\.json"):
        ExLlamaV2Engine(model=str(tmp_path / "empty")).load()
    with pytest.raises(ModelFormatError, match=r"backend='llama\.cpp'"):
        ExLlamaV2Engine(model=str(tiny.gguf_path)).load()
    with pytest.raises(ModelNotFound):
        ExLlamaV2Engine(model=str(tmp_path / "absent")).load()
    d = copy_hf(tiny, tmp_path / "notok")
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelFormatError, match=r"tokenizer\.json"):
        ExLlamaV2Engine(model=str(d)).load()
    d = copy_hf(tiny, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="safetensors"):
        ExLlamaV2Engine(model=str(d)).load()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"quantization_config": {"quant_method": "awq"}}, "is awq"),
        ({"quantization": {"group_size": 64, "bits": 4}}, "is mlx"),
        ({"architectures": None}, "cannot read the model"),
        ({"hidden_size": None}, "Missing any of the following keys"),
    ],
)
def test_configs_exllamav2_cannot_read(
    tmp_path: Path, tiny: TinyModel, change: dict[str, Any], match: str
) -> None:
    d = copy_hf(tiny, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    with pytest.raises(ModelFormatError, match=match):
        ExLlamaV2Engine(model=str(d)).load()


def in_use(fake: Any) -> list[int]:
    return [fake._used.get(i, 0) for i in range(len(fake.GPU_MEMORY))]


def test_weights_that_do_not_fit(tiny: TinyModel, fake: Any) -> None:
    fake.GPU_MEMORY[:] = [2**30, 2**30]
    before = in_use(fake)  # the module's shared engine holds some
    fake.GPU_MEMORY[:] = [before[0] + 100_000, before[1] + 100_000]  # less than one module each
    with pytest.raises(OutOfMemory, match="weights") as err:
        load(tiny)
    assert "Insufficient VRAM" in str(err.value.__cause__)  # autosplit ran out of GPUs
    with pytest.raises(OutOfMemory, match="weights") as err:
        load(tiny, gpu_split=[1.0])
    assert type(err.value.__cause__).__name__ == "OutOfMemoryError"  # torch's class name
    assert in_use(fake) == before  # nothing left allocated


def test_a_cache_that_does_not_fit(tiny: TinyModel, fake: Any) -> None:
    weights = sum(p.stat().st_size for p in tiny.hf_dir.glob("*.safetensors"))
    before = in_use(fake)[:1]
    fake.GPU_MEMORY[:] = [before[0] + weights + 2**20]  # the weights and a 1 MiB cache (2048 tokens)
    with pytest.raises(OutOfMemory, match="cache_type='q8' or 'q4'") as err:
        load(tiny, gpu_split=[1.0], cache_size=65536)
    assert "out of memory" in str(err.value.__cause__)
    assert in_use(fake) == before  # the weights were unloaded again
    with load(tiny, gpu_split=[1.0], cache_size=1024) as e:
        assert len(e.generate(PROMPT, GREEDY).token_ids) == 24
    with pytest.raises(OutOfMemory, match="weights and cache"):  # autosplit places both together
        load(tiny, cache_size=65536)


def test_close_frees_the_gpu_and_stops_the_worker(tiny: TinyModel, fake: Any) -> None:
    before = in_use(fake)
    e = load(tiny)
    runner = e._runner
    assert in_use(fake) != before
    e.close()
    assert runner.stopped
    assert in_use(fake) == before


def test_auto_engine_with_the_backend_forced(tiny: TinyModel) -> None:
    with auto_engine(tiny.hf_dir, backend="exllamav2", context_length=256) as e:
        assert e.name == "exllamav2" and e.selection is not None
        assert len(e.generate(PROMPT, GREEDY).token_ids) == 24


def test_gpu_check_script_runs_against_the_fake(tiny: TinyModel) -> None:
    """scripts/gpu_check_exllamav2.py is written for a GPU; its logic is proven here on the fake."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(FAKE), str(ROOT)]),
        ASSUME_GPU_ENV: "1",
        "FAKE_EXLLAMAV2_STEP_SECONDS": "0.01",  # so the 8 concurrent requests meet in a batch, under load too
    }
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check_exllamav2.py"), str(tiny.hf_dir)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all checks passed" in out.stdout
    for check in ("greedy parity", "streaming", "concurrent jobs", "kv_stats", "structured output"):
        assert check in out.stdout


# ---- what the backend tells the selector, and what it is told ----


@pytest.mark.parametrize("cache_type", ["fp16", "q8", "q4"])
def test_kv_bytes_per_token_is_the_planners(tiny: TinyModel, cache_type: str) -> None:
    """One KV formula: the engine's bytes per token are the plan's for the same model and KV dtype."""
    info = inspect_model(tiny.hf_dir)
    wl = Workload(kv_cache_dtype=kv_dtype(cache_type))  # type: ignore[arg-type]
    expected = plan(info, load_hardware(LAPTOP), wl).kv_bytes_per_token
    with load(tiny, cache_type=cache_type, max_batch_size=2) as e:
        assert e.kv_stats().bytes_per_token == expected


def test_the_load_reads_the_facts_it_is_given(tiny: TinyModel) -> None:
    """The model's format comes from ``engine.facts`` (what auto_engine read), not a second read."""
    from dataclasses import replace

    info = inspect_model(tiny.hf_dir)
    e = ExLlamaV2Engine(model=str(tiny.hf_dir), context_length=512)
    e.facts = Facts(str(tiny.hf_dir), model=replace(info, format="awq"), hardware=None)
    with pytest.raises(ModelFormatError, match="is awq"):
        e.load()
    e.facts = Facts(str(tiny.hf_dir), model=None, hardware=None)  # unillm could not read it
    with pytest.raises(ModelFormatError, match="not a model unillm can read"):
        e.load()


def test_fallback_steps() -> None:
    facts = Facts("m", model=None, hardware=None)

    def steps(**options: Any) -> list[Any]:
        return list(ExLlamaV2Engine.fallbacks(EngineConfig(model="m", options=options), facts))

    assert [f.label for f in steps()] == ["cache_type=q8", "cache_type=q4"]
    assert [f.label for f in steps(cache_type="q8")] == ["cache_type=q4"]
    assert steps(cache_type="q4") == []
    q8, q4 = steps()
    assert (q8.cost, q8.options, q8.kv_cache_dtype) == (Cost.QUALITY, {"cache_type": "q8"}, "q8")
    assert (q4.cost, q4.options, q4.kv_cache_dtype) == (Cost.QUALITY, {"cache_type": "q4"}, "q4")
    with_context = ExLlamaV2Engine.fallbacks(EngineConfig(model="m", context_length=4096), facts)
    assert [f.label for f in with_context] == [
        "context_length=2048",
        "context_length=1024",
        "cache_type=q8",
        "cache_type=q4",
    ]


def test_probe_build_delegates_to_the_builds_probe() -> None:
    from unillm.engines.exllamav2 import _build

    hw = load_hardware(LAPTOP)
    findings: list[str] = []
    build = ExLlamaV2Engine.probe_build(hw, findings)
    expected: list[str] = []
    assert build == _build.build(hw, expected) and findings == expected
