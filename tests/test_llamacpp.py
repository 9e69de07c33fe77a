"""The llama.cpp backend against the real llama-cpp-python, on the tiny GGUF."""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
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
    auto_engine,
)
from unillm.testing import TinyModel, check_engine
from unillm.testing._tiny import CHAT_TEMPLATE, write_variant_gguf

from .conftest import needs_llama_cpp

pytestmark = needs_llama_cpp

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module", params=[1, 8], ids=["one-at-a-time", "batching"])
def llama(request: pytest.FixtureRequest, tiny_gguf: Path) -> Iterator[Any]:
    """The module's engine, once on the one-sequence path and once batching (``parallel=8``):
    every test that takes it holds on both."""
    from unillm.engines.llamacpp import LlamaCppEngine

    options = {"n_threads": 2, "seed": 1234, "parallel": request.param}
    with LlamaCppEngine(model=str(tiny_gguf), context_length=512, options=options) as engine:
        yield engine


@pytest.fixture(scope="module")
def raw(tiny_gguf: Path) -> Any:
    """llama-cpp-python used directly, as a user would without unillm."""
    from llama_cpp import Llama

    llm = Llama(str(tiny_gguf), n_ctx=512, n_threads=2, verbose=False)
    yield llm
    llm.close()


def raw_greedy(llm: Any, prompt: str, n: int) -> list[int]:
    import llama_cpp

    tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    out: list[int] = []
    for tok in llm.generate(tokens, temp=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok) or len(out) == n:
            break
        out.append(tok)
    return out


@pytest.mark.parametrize("prompt", [PROMPT, "Once upon a time", "0 1 2 3 4 5 6 7 8 9"])
def test_greedy_is_token_identical_to_llama_cpp_python(llama: Any, raw: Any, prompt: str) -> None:
    ours = llama.generate(prompt, GREEDY)
    assert list(ours.token_ids) == raw_greedy(raw, prompt, GREEDY.max_tokens)
    assert len(ours.token_ids) == GREEDY.max_tokens


def test_token_id_prompts(llama: Any) -> None:
    ids = llama.tokenize(PROMPT)
    assert llama.generate(ids, GREEDY).token_ids == llama.generate(PROMPT, GREEDY).token_ids


def test_seeded_sampling_is_reproducible(llama: Any) -> None:
    p = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, max_tokens=24)
    a = llama.generate(PROMPT, p, seed=7).token_ids
    b = llama.generate(PROMPT, p, seed=7).token_ids
    c = llama.generate(PROMPT, p, seed=8).token_ids
    assert a == b
    assert a != c
    assert a != llama.generate(PROMPT, GREEDY).token_ids  # it really sampled


def test_penalties_and_logit_bias_change_the_output(llama: Any) -> None:
    base = llama.generate(PROMPT, GREEDY).token_ids
    assert llama.generate(PROMPT, GREEDY, repetition_penalty=1.5, frequency_penalty=1.0).token_ids != base
    banned = base[0]
    biased = llama.generate(PROMPT, GREEDY, logit_bias={banned: -100.0}).token_ids
    assert biased[0] != banned
    forced = llama.generate(PROMPT, GREEDY, logit_bias={17: 100.0}).token_ids
    assert set(forced) == {17}


def test_stop_string_across_token_boundaries(llama: Any) -> None:
    chunks = list(llama.stream(PROMPT, GREEDY))
    pieces = [c.text for c in chunks if c.text]
    full = "".join(pieces)
    # a stop string made of the end of one token and the start of the next
    k = next(i for i in range(2, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    want = full[: full.find(stop)]
    cut = list(llama.stream(PROMPT, GREEDY, stop=[stop]))
    assert "".join(c.text for c in cut) == want
    assert all(stop not in c.text for c in cut)
    assert cut[-1].finish_reason == "stop"


def test_max_tokens_eos_and_stop_token_ids(llama: Any) -> None:
    assert llama.generate(PROMPT, GREEDY, max_tokens=5).finish_reason == "length"
    eos = llama._llm.token_eos()
    ended = llama.generate(PROMPT, GREEDY, logit_bias={eos: 100.0})
    assert (ended.finish_reason, ended.token_ids, ended.text) == ("stop", (), "")
    ignored = llama.generate(PROMPT, GREEDY, logit_bias={eos: 100.0}, ignore_eos=True, max_tokens=3)
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 3
    base = llama.generate(PROMPT, GREEDY).token_ids
    stopped = llama.generate(PROMPT, GREEDY, stop_token_ids=[base[3]])
    assert stopped.finish_reason == "stop" and stopped.token_ids == base[: base.index(base[3])]


def test_usage_and_engine_timings(llama: Any) -> None:
    llama.reset()
    done = llama.generate("The quick brown fox jumps over the lazy dog. " * 4, GREEDY)
    assert done.usage.prompt_tokens == len(
        llama.tokenize("The quick brown fox jumps over the lazy dog. " * 4)
    )
    assert done.usage.completion_tokens == 24 and done.usage.cached_prompt_tokens == 0
    t = done.timings
    # a batch's steps serve several requests at once: a request's own time is the wall clock's
    assert t.source == ("wall" if llama.capabilities.batching else "engine")
    assert t.prefill_s > 0 and t.decode_s > 0
    assert t.prefill_tokens_per_s and t.decode_tokens_per_s
    assert 0 < t.ttft_s <= t.total_s


def test_logprobs(llama: Any) -> None:
    done = llama.generate(PROMPT, GREEDY, logprobs=0)
    assert done.logprobs is not None and len(done.logprobs) == len(done.token_ids)
    assert all(lp <= 0.0 for lp in done.logprobs)


def test_chat_uses_the_gguf_template(llama: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    rendered = llama.render_chat(messages)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    reply = llama.chat(messages, GREEDY)
    assert reply.usage.prompt_tokens == len(llama.tokenize(rendered))
    assert reply.token_ids == llama.generate(rendered, GREEDY).token_ids
    streamed = "".join(c.text for c in llama.stream_chat(messages, GREEDY))
    assert streamed == reply.text


MALICIOUS = [
    "{{ cycler.__init__.__globals__.os.system('touch PWNED') }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% for m in messages %}{{ m.content.__class__.__base__.__subclasses__() }}{% endfor %}",
]


@pytest.mark.parametrize("template", MALICIOUS)
def test_a_malicious_template_in_a_gguf_is_refused(
    tmp_path: Path, template: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    path = write_variant_gguf(tmp_path / "evil.gguf", chat_template=template)
    with auto_engine(path, context_length=128) as engine:
        with pytest.raises(ModelFormatError, match="unsafe"):
            engine.chat([{"role": "user", "content": "hi"}], GREEDY)
        assert engine.generate(PROMPT, GREEDY).token_ids  # the engine itself is fine
    assert not (tmp_path / "PWNED").exists()


def test_no_template_is_a_clear_error(tmp_path: Path) -> None:
    path = write_variant_gguf(tmp_path / "plain.gguf", chat_template=None)

    with (
        auto_engine(path, context_length=128) as engine,
        pytest.raises(ConfigError, match="no chat template"),
    ):
        engine.chat([{"role": "user", "content": "hi"}])
    with auto_engine(path, context_length=128, chat_template=CHAT_TEMPLATE) as engine:
        assert engine.chat([{"role": "user", "content": "hi"}], GREEDY).usage.prompt_tokens > 0


def test_kv_stats_grow_with_the_prompt_and_drop_after_reset(llama: Any) -> None:
    llama.reset()
    empty = llama.kv_stats()
    cells = 512 * (8 if llama.capabilities.batching else 1)  # each sequence may fill the context
    assert empty.used_tokens == 0 and empty.capacity_tokens == cells
    spec = (2, 1, 64)  # layers, kv heads, head dim of the small tiny model
    assert empty.bytes_per_token == 2 * spec[0] * spec[1] * spec[2] * 2  # K and V, f16
    assert empty.capacity_bytes == empty.bytes_per_token * cells
    short = llama.generate("one two", GREEDY, max_tokens=1)
    used_short = llama.kv_stats().used_tokens
    assert used_short == short.usage.prompt_tokens
    long = llama.generate("one two three four five six seven eight nine ten", GREEDY, max_tokens=4)
    stats = llama.kv_stats()
    assert stats.used_tokens == long.usage.prompt_tokens + 3 > used_short
    assert stats.used_bytes == stats.used_tokens * stats.bytes_per_token
    llama.reset()
    assert llama.kv_stats().used_tokens == 0


def test_prefix_reuse_is_visible_in_usage(llama: Any) -> None:
    llama.reset()
    ids = llama.tokenize("Once upon a time, there was a small model that wanted to tell stories.")
    first = llama.generate(ids, GREEDY, max_tokens=4)
    assert first.usage.cached_prompt_tokens == 0
    before = llama.kv_stats()
    again = llama.generate(ids, GREEDY, max_tokens=4)
    assert again.usage.cached_prompt_tokens == len(ids) - 1  # the last token is re-evaluated
    assert again.token_ids == first.token_ids
    # the next turn extends the conversation: everything already evaluated is reused
    turn = llama.generate([*ids, *first.token_ids[:3]], GREEDY, max_tokens=4)
    assert turn.usage.cached_prompt_tokens == len(ids) + 2
    after = llama.kv_stats()
    # queries and hits count prompt tokens (vLLM's meaning): two prompts looked up, and the
    # tokens each took from the cache
    assert after.prefix_cache_queries == before.prefix_cache_queries + len(ids) + len(ids) + 3
    assert after.prefix_cache_hits == before.prefix_cache_hits + (len(ids) - 1) + (len(ids) + 2)


def test_eight_threads_match_sequential_runs(llama: Any) -> None:
    prompts = [f"Story number {i}: once upon a time" for i in range(8)]
    sequential = [llama.generate(p, GREEDY).token_ids for p in prompts]
    results: dict[int, tuple[int, ...]] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            results[i] = llama.generate(prompts[i], GREEDY).token_ids
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [results[i] for i in range(8)] == sequential


def test_async_tasks_are_serialized_too(llama: Any) -> None:
    import asyncio

    prompts = [f"Task {i} says" for i in range(4)]
    sequential = [llama.generate(p, GREEDY).token_ids for p in prompts]

    async def main() -> list[tuple[int, ...]]:
        done = await asyncio.gather(*(llama.agenerate(p, GREEDY) for p in prompts))
        return [d.token_ids for d in done]

    assert asyncio.run(main()) == sequential


def test_a_stream_broken_after_three_tokens_leaves_the_engine_usable(llama: Any) -> None:
    full = llama.generate(PROMPT, GREEDY)
    stream = llama.stream(PROMPT, GREEDY)
    got = [next(stream) for _ in range(3)]
    stream.close()
    assert [c.token_ids[0] for c in got] == list(full.token_ids[:3])
    assert llama.generate(PROMPT, GREEDY).token_ids == full.token_ids


def test_conformance(llama: Any) -> None:
    assert len(check_engine(llama, PROMPT)) >= 7


# ---- errors, each with a real bad file ----


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound):
        auto_engine(tmp_path / "absent.gguf")


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"<html>404 not found</html>" + bytes(100))
    with pytest.raises(ModelFormatError, match="GGUF magic"):
        auto_engine(bad)
    with pytest.raises(ModelFormatError, match="not a GGUF"):
        auto_engine(bad, backend="llama.cpp")


def test_truncated_gguf(tiny_gguf: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:-1000])
    with pytest.raises(ModelFormatError, match="truncated"):
        auto_engine(cut)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = write_variant_gguf(tmp_path / "alien.gguf", arch="alienformer")
    with pytest.raises(ModelFormatError, match="alienformer"):
        auto_engine(path)


def test_prompt_longer_than_the_context_fails_before_any_eval(llama: Any) -> None:
    llama.reset()
    llama.generate("warm", GREEDY, max_tokens=1)
    used = llama.kv_stats().used_tokens
    with pytest.raises(ContextLengthExceeded, match="context window of 512") as err:
        llama.stream("word " * 600, GREEDY)
    assert err.value.prompt_tokens > 512
    assert llama.kv_stats().used_tokens == used


def test_generation_stops_at_a_full_context(tiny_gguf: Path) -> None:
    with auto_engine(tiny_gguf, context_length=32) as e:
        ids = e.tokenize("one two three four five six seven eight nine ten")
        done = e.generate(ids, GREEDY, max_tokens=1000, ignore_eos=True)
        assert done.finish_reason == "length"
        capacity = e.kv_stats().capacity_tokens
        assert capacity == 32  # what was asked for, though llama.cpp rounds its allocation up
        assert len(ids) + len(done.token_ids) == capacity


def _more_than_ram_tokens() -> int:
    import os

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 1 << max(26, (int(ram * 1.5) // 512).bit_length())  # 512 B/token: more than RAM


def test_allocation_failure_is_out_of_memory(tiny_gguf: Path) -> None:
    from unillm.engines.llamacpp import LlamaCppEngine

    huge = _more_than_ram_tokens()
    # refused from the plan before llama.cpp allocates anything, with the numbers and what fits
    # (past the trained context only where the model is said to extend it)
    with pytest.raises(OutOfMemory, match=r"RAM is free; use a context of at most \d+ tokens"):
        LlamaCppEngine(
            model=str(tiny_gguf), context_length=huge, options={"allow_longer_context": True}
        ).load()
    # past the check, llama.cpp's own allocation failure maps to OutOfMemory too
    with pytest.raises(OutOfMemory, match="smaller context"):
        LlamaCppEngine(
            model=str(tiny_gguf),
            context_length=huge,
            options={"skip_memory_check": True, "allow_longer_context": True},
        ).load()


def test_a_context_past_the_trained_one_is_reduced_to_it_and_said(tiny_gguf: Path) -> None:
    """One rule on every engine (unillm._contract._context.context_for): the engine loads with the
    trained context and a warning naming what was asked, what is used and why; a model said to
    extend its context (allow_longer_context) gets what was asked, without a warning."""
    from unillm.engines.llamacpp import LlamaCppEngine

    for asked in (8192, 10**9):
        with (
            pytest.warns(
                UnillmWarning,
                match=f"context_length {asked} was asked for, 4096 is used: .* trained for 4096",
            ),
            LlamaCppEngine(model=str(tiny_gguf), context_length=asked) as e,
        ):
            assert e.kv_stats().capacity_tokens == 4096 == e.context_length
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnillmWarning)
        with LlamaCppEngine(
            model=str(tiny_gguf), context_length=8192, options={"allow_longer_context": True}
        ) as e:
            assert e.kv_stats().capacity_tokens == 8192


def test_auto_engine_walks_down_to_a_context_that_fits(tiny_gguf: Path) -> None:
    """Past memory (the model said to extend its context, so the trained one is no cap), the
    fallback steps find a context that fits, and the reduced request is said in a warning."""
    huge = _more_than_ram_tokens()
    with pytest.warns(
        UnillmWarning,
        match=f"did not load with context_length={huge} .*out of memory.* it loaded with context_length=",
    ):
        e = auto_engine(tiny_gguf, context_length=huge, options={"allow_longer_context": True})
    with e:
        assert e.selection is not None
        assert "out of memory" in e.selection.steps[0] and "context_length=" in e.selection.steps[0]
        assert e.kv_stats().capacity_tokens < huge
        assert e.generate(PROMPT, GREEDY).usage.completion_tokens == GREEDY.max_tokens


def test_engine_not_installed(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # how Python spells "not installed"
    with pytest.raises(BackendUnavailable, match=r"pip install 'unillm\[llamacpp\]'") as err:
        auto_engine(tiny_gguf, backend="llama.cpp")
    assert "GGML_CUDA" in str(err.value)
    from unillm import NoSuitableBackend

    with pytest.raises(NoSuitableBackend, match="llama-cpp-python is not installed"):
        auto_engine(tiny_gguf)


def test_selection_explains_the_choice(tiny_gguf: Path) -> None:
    with auto_engine(tiny_gguf, context_length=64) as e:
        assert e.selection is not None
        text = e.selection.explain()
        assert "backend: llama.cpp (chosen by auto)" in text
        assert (
            "+ llama.cpp [builtin]: GGUF is llama.cpp's own format; reads gguf; uses one GPU at most" in text
        )
        assert "the ten questions:" in text


def test_options_reach_llama_cpp(tiny_gguf: Path) -> None:
    opts = {"n_threads": 1, "n_batch": 64, "kv_cache_type": "q8_0", "use_mmap": False}
    with auto_engine(tiny_gguf, context_length=256, options=opts) as e:
        llm = e._llm
        assert (llm.n_ctx(), llm.n_batch, llm.context_params.n_threads) == (256, 64, 1)
        assert llm.context_params.type_k == llm.context_params.type_v == 8  # GGML_TYPE_Q8_0
        stats = e.kv_stats()
        assert stats.dtype == "q8_0" and stats.bytes_per_token == round(2 * 1 * 128 * 34 / 32)
        assert e.generate(PROMPT, GREEDY).usage.completion_tokens == 24
        assert llm.model_params.split_mode == 0  # LLAMA_SPLIT_MODE_NONE: never across GPUs


def test_tiny_model_fixture_is_the_small_size(tiny: TinyModel) -> None:
    assert tiny.spec.num_layers == 2


def test_a_schema_keyword_no_engine_enforces_is_refused(llama: Any) -> None:
    from unillm import ConfigError

    # the compiler every engine shares refuses it (tests/test_structured.py has more)
    exclusive = {"type": "object", "properties": {"n": {"type": "array", "contains": {"type": "number"}}}}
    with pytest.raises(ConfigError, match="contains"):
        llama.generate(PROMPT, GREEDY, response_format=exclusive)


def test_cancelling_an_async_stream_stops_generation(llama: Any) -> None:
    import asyncio

    full = llama.generate(PROMPT, GREEDY)

    async def main() -> int:
        seen = 0

        async def consume() -> None:
            nonlocal seen
            async for _ in llama.astream(PROMPT, GREEDY, max_tokens=10_000, ignore_eos=True):
                seen += 1
                if seen == 3:
                    await asyncio.sleep(10)  # cancelled here

        task = asyncio.create_task(consume())
        while seen < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return seen

    assert asyncio.run(main()) == 3
    again = llama.generate(PROMPT, GREEDY)  # waits for the worker to stop, then runs normally
    assert again.token_ids == full.token_ids
    assert llama.kv_stats().used_tokens < 200


def test_a_closed_engine_passes_check_closed(tiny_gguf: Path) -> None:
    from unillm.engines.llamacpp import LlamaCppEngine
    from unillm.testing import check_closed

    e = LlamaCppEngine(model=str(tiny_gguf), context_length=256)
    check_closed(e)
    e.load()
    e.close()
    check_closed(e)


# ---- what the backend knows: its KV size, its fallback steps, its facts ----


@pytest.mark.parametrize("kv_cache_type", ["f16", "q8_0"])
def test_kv_bytes_per_token_is_the_planners(tiny_gguf: Path, kv_cache_type: str) -> None:
    from unillm import GPU, Hardware, Workload, plan
    from unillm.backend import kv_dtype
    from unillm.engines.llamacpp import LlamaCppEngine

    options = {"n_threads": 2, "kv_cache_type": kv_cache_type}
    with LlamaCppEngine(model=str(tiny_gguf), context_length=128, options=options) as e:
        hw = Hardware(
            os="linux", arch="x86_64", ram_total_bytes=64 << 30, gpus=(GPU(0, "nvidia", "GPU", 8 << 30),)
        )
        planned = plan(e.facts.model, hw, Workload(kv_cache_dtype=kv_dtype(kv_cache_type)))  # type: ignore[arg-type]
        stats = e.kv_stats()
        assert stats.bytes_per_token == planned.kv_bytes_per_token > 0
        assert stats.dtype == kv_cache_type


def _facts(*, layers: int | None = 24, gpus: int = 1, planned: int | None = None) -> Any:
    from unillm import GPU, Hardware, ModelInfo, Plan
    from unillm.backend import Facts

    model = ModelInfo("m.gguf", "gguf", layers=layers, kv_heads=8, head_dim=128, context_length=4096)
    hw = Hardware(
        os="linux", arch="x86_64", gpus=tuple(GPU(i, "nvidia", "GPU", 24 << 30) for i in range(gpus))
    )
    the_plan = Plan(0, 0, 0, 0, 0, fits=False, headroom_bytes=0, gpu_layers=planned)
    return Facts("m.gguf", model=model, hardware=hw, plan=the_plan)


def _steps(facts: Any, **config: Any) -> list[tuple[str, Any, dict[str, Any]]]:
    from unillm import EngineConfig
    from unillm.engines.llamacpp import LlamaCppEngine

    steps = LlamaCppEngine.fallbacks(EngineConfig(model="m.gguf", **config), facts)
    return [(s.label, s.cost, dict(s.options)) for s in steps]


def test_fallbacks_a_shorter_context_a_q8_cache_then_fewer_gpu_layers() -> None:
    from unillm import EngineConfig
    from unillm.backend import Cost
    from unillm.engines.llamacpp import LlamaCppEngine

    got = _steps(_facts(), context_length=4096)
    assert got == [
        ("context_length=2048", Cost.CAPABILITY, {}),
        ("context_length=1024", Cost.CAPABILITY, {}),
        ("kv_cache_type=q8_0", Cost.QUALITY, {"kv_cache_type": "q8_0"}),
        ("n_gpu_layers=12", Cost.SPEED, {"n_gpu_layers": 12}),
        ("n_gpu_layers=6", Cost.SPEED, {"n_gpu_layers": 6}),
        ("n_gpu_layers=3", Cost.SPEED, {"n_gpu_layers": 3}),
        ("n_gpu_layers=1", Cost.SPEED, {"n_gpu_layers": 1}),
    ]
    # auto_engine walks them cheapest first: the cache, the layers, then the context
    assert [c for _, c, _ in sorted(got, key=lambda s: s[1])][:2] == [Cost.QUALITY, Cost.SPEED]
    q8 = LlamaCppEngine.fallbacks(EngineConfig(model="m.gguf"), _facts())[0]
    assert (q8.label, q8.kv_cache_dtype, q8.context_length) == ("kv_cache_type=q8_0", "q8", None)


def test_fallbacks_start_the_gpu_layers_at_the_plans() -> None:
    got = [label for label, _, _ in _steps(_facts(planned=20))]
    assert got == ["kv_cache_type=q8_0", *(f"n_gpu_layers={n}" for n in (20, 10, 5, 2, 1))]
    # a plan that puts every layer on the GPU says nothing about fewer: half the layers
    assert [label for label, _, _ in _steps(_facts(planned=24))][1] == "n_gpu_layers=12"
    # no layer count and no plan: no GPU step
    assert [label for label, _, _ in _steps(_facts(layers=None))] == ["kv_cache_type=q8_0"]


def test_fallbacks_follow_what_the_user_set() -> None:
    explicit = _steps(_facts(planned=20), options={"n_gpu_layers": 16, "kv_cache_type": "q4_0"})
    assert [label for label, _, _ in explicit] == [f"n_gpu_layers={n}" for n in (8, 4, 2, 1)]
    # a backend's own table counts as what the user set, and "auto"/-1 mean all layers
    tabled = _steps(_facts(), backend_options={"llama.cpp": {"kv_cache_type": "q8_0", "n_gpu_layers": 1}})
    assert tabled == []
    assert _steps(_facts(), options={"n_gpu_layers": "auto"})[1][0] == "n_gpu_layers=12"
    assert _steps(_facts(), options={"n_gpu_layers": -1})[1][0] == "n_gpu_layers=12"
    assert _steps(_facts(), options={"n_gpu_layers": 0}) == [_steps(_facts())[0]]


def test_fallbacks_without_a_gpu_take_no_layers_off_it() -> None:
    assert [label for label, _, _ in _steps(_facts(gpus=0))] == ["kv_cache_type=q8_0"]
    from unillm.backend import Facts

    assert [label for label, _, _ in _steps(Facts("m.gguf", model=None, hardware=None, plan=None))] == [
        "kv_cache_type=q8_0"
    ]


def test_load_uses_the_facts_it_is_handed(tiny_gguf: Path) -> None:
    """auto_engine hands in what it read; the load reads neither the model nor the header again."""
    import dataclasses

    from unillm._inspect import inspect_model, read_gguf_header
    from unillm.backend import Facts
    from unillm.engines.llamacpp import LlamaCppEngine

    info = dataclasses.replace(inspect_model(tiny_gguf), context_length=256)  # a trained context of 256
    e = LlamaCppEngine(model=str(tiny_gguf), options={"n_threads": 2})
    e.facts = Facts(str(tiny_gguf), model=info, hardware=None, plan=None)
    e.facts.__dict__["gguf_header"] = read_gguf_header(tiny_gguf)
    with e:
        assert e.kv_stats().capacity_tokens == 256  # min(the facts' trained context, 4096)
    e2 = LlamaCppEngine(model=str(tiny_gguf), context_length=512, options={"n_threads": 2})
    e2.facts = Facts(str(tiny_gguf), model=info, hardware=None, plan=None)
    with (
        pytest.warns(UnillmWarning, match="512 was asked for, 256 is used"),
        e2,
    ):  # the facts' trained context
        assert e2.kv_stats().capacity_tokens == 256


def _lazy(header: Any) -> Any:
    """``header`` as a lazy read that stopped at the vocabulary leaves it: no token ids, no chat
    template, no tensor extent."""
    import dataclasses

    kept = {
        k: v for k, v in header.metadata.items() if not k.startswith("tokenizer.ggml.") and "chat" not in k
    }
    return dataclasses.replace(header, metadata=kept, unread=(0, None), data_end=None, tensor_bytes=None)


def test_a_lazy_header_gets_the_rest_from_what_llama_cpp_read(
    llama: Any, tiny_gguf: Path, tmp_path: Path
) -> None:
    from unillm._inspect import read_gguf_header
    from unillm.engines.llamacpp import LlamaCppEngine

    e = LlamaCppEngine(model=str(tiny_gguf), context_length=128, options={"n_threads": 2})
    e.facts.__dict__["gguf_header"] = _lazy(read_gguf_header(tiny_gguf))
    with e:
        assert e.eos_token_ids == llama.eos_token_ids and e.eos_token_ids
        assert e.render_chat([{"role": "user", "content": "hi"}]).startswith("<|im_start|>user")
    # the template the header did not hold is still checked at load
    broken = write_variant_gguf(tmp_path / "broken.gguf", chat_template="{% for m in messages %}")
    b = LlamaCppEngine(model=str(broken), context_length=128)
    b.facts.__dict__["gguf_header"] = _lazy(read_gguf_header(broken))
    with pytest.raises(ModelFormatError, match=r"broken\.gguf"):
        b.load()
    # a truncated file the header could not tell: llama.cpp's refusal, said the same way
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:-1000])
    c = LlamaCppEngine(model=str(cut), context_length=128)
    c.facts.__dict__["gguf_header"] = _lazy(read_gguf_header(cut))
    with pytest.raises(ModelFormatError, match="truncated"):
        c.load()


def test_a_model_directory_reads_its_gguf(tiny: TinyModel) -> None:
    from unillm.engines.llamacpp import LlamaCppEngine

    with LlamaCppEngine(model=str(tiny.root), context_length=128, options={"n_threads": 2}) as e:
        assert e.facts.model is not None and e.facts.model.format == "gguf"
        assert e.kv_stats().bytes_per_token == 2 * 2 * 1 * 64 * 2
        assert e.generate(PROMPT, GREEDY).usage.completion_tokens == GREEDY.max_tokens


def test_probe_build_reports_the_installed_llama_cpp() -> None:
    from unillm import Hardware
    from unillm.engines.llamacpp import LlamaCppEngine

    findings: list[str] = []
    build = LlamaCppEngine.probe_build(Hardware(os="linux", arch="x86_64"), findings)
    assert build is not None and build.name == "llama.cpp" and "cpu" in build.devices
