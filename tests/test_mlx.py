"""The MLX backend against the real mlx-lm (mlx's CPU build on Linux), on the tiny HF model."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from unillm import (
    BackendUnavailable,
    ConfigError,
    ContextLengthExceeded,
    ModelFormatError,
    ModelNotFound,
    SamplingParams,
    UnillmWarning,
    Workload,
    auto_engine,
    inspect_model,
    load_hardware,
    plan,
)
from unillm.backend import Cost, EngineConfig, Facts
from unillm.engines.mlx._model import import_mlx_lm
from unillm.testing import TinyModel, check_engine

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="mlx-lm is not installed")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
LAPTOP = Path(__file__).parent / "profiles" / "laptop-8gb-cpu.json"
PROMPT = "The quick brown fox"
PROMPTS = [
    PROMPT,
    "Once upon a time",
    "0 1 2 3 4 5 6 7 8 9",
    "Why is the sky blue? Because air scatters blue light more than red light.",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "ünïcödé 🙂 and bytes",
]


@pytest.fixture(scope="module", params=[8, 1], ids=["batched", "single"])
def mlx(tiny: TinyModel, request: pytest.FixtureRequest) -> Any:
    """The MLX engine in both modes: continuous batching (BatchGenerator) and one at a time."""
    from unillm.engines.mlx import MLXEngine

    opts = {"seed": 1234, "batch_size": request.param}
    with MLXEngine(model=str(tiny.hf_dir), context_length=512, options=opts) as engine:
        assert engine.capabilities.batching == (request.param > 1)
        # what the selector sees for these options is what the loaded engine does
        assert engine.capabilities == MLXEngine.capabilities_for(engine.options)
        yield engine


def raw_greedy(tiny: TinyModel, prompt: str, n: int) -> list[int]:
    """mlx-lm used directly, as a user would without unillm (imported without lowering this
    process's open-file limit, which later tests' processes inherit)."""
    mlx_lm = import_mlx_lm()
    model, tokenizer = _raw_model(tiny)
    out = []
    for resp in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=n):
        if resp.finish_reason == "stop" and resp.token in tokenizer.eos_token_ids:
            break
        out.append(resp.token)
    return out


_RAW: dict[str, Any] = {}


def _raw_model(tiny: TinyModel) -> Any:
    if "m" not in _RAW:
        _RAW["m"] = import_mlx_lm().load(str(tiny.hf_dir))
    return _RAW["m"]


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_greedy_is_token_identical_to_mlx_lm(mlx: Any, tiny: TinyModel, prompt: str) -> None:
    assert list(mlx.generate(prompt, GREEDY).token_ids) == raw_greedy(tiny, prompt, GREEDY.max_tokens)


def test_parity_with_llama_cpp_on_the_same_weights(mlx: Any, llama: Any) -> None:
    """The GGUF holds the same f32 weights: greedy tokens must agree across engines."""
    differing = []
    for prompt in PROMPTS:
        a = mlx.generate(prompt, GREEDY).token_ids
        b = llama.generate(prompt, GREEDY).token_ids
        if a != b:
            differing.append((prompt, a, b))
    # f32 on both sides and logits spread by units: no prompt may differ (threshold 0 of 6).
    assert differing == [], f"{len(differing)} of {len(PROMPTS)} prompts differ: {differing}"


def test_token_id_prompts_and_tokenizer(mlx: Any) -> None:
    ids = mlx.tokenize(PROMPT)
    assert mlx.detokenize(ids) == PROMPT
    assert mlx.generate(ids, GREEDY).token_ids == mlx.generate(PROMPT, GREEDY).token_ids


def test_seeded_sampling_is_reproducible(mlx: Any) -> None:
    p = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, max_tokens=24)
    a = mlx.generate(PROMPT, p, seed=7).token_ids
    assert a == mlx.generate(PROMPT, p, seed=7).token_ids
    assert a != mlx.generate(PROMPT, p, seed=8).token_ids
    assert a != mlx.generate(PROMPT, GREEDY).token_ids


def test_penalties_and_logit_bias(mlx: Any) -> None:
    base = mlx.generate(PROMPT, GREEDY).token_ids
    assert mlx.generate(PROMPT, GREEDY, repetition_penalty=1.5, frequency_penalty=1.0).token_ids != base
    assert set(mlx.generate(PROMPT, GREEDY, logit_bias={17: 100.0}).token_ids) == {17}


def test_stop_strings_stop_ids_eos_and_length(mlx: Any) -> None:
    full = mlx.generate(PROMPT, GREEDY)
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    cut = mlx.generate(PROMPT, GREEDY, stop=[stop])
    assert (cut.text, cut.finish_reason) == (full.text[: full.text.find(stop)], "stop")
    assert mlx.generate(PROMPT, GREEDY, max_tokens=5).finish_reason == "length"
    eos = next(iter(mlx._tokenizer.eos_token_ids))
    ended = mlx.generate(PROMPT, GREEDY, logit_bias={eos: 100.0})
    assert (ended.finish_reason, ended.token_ids) == ("stop", ())
    ignored = mlx.generate(PROMPT, GREEDY, logit_bias={eos: 100.0}, ignore_eos=True, max_tokens=3)
    assert ignored.token_ids == (eos, eos, eos) and ignored.finish_reason == "length"
    stopped = mlx.generate(PROMPT, GREEDY, stop_token_ids=[full.token_ids[3]])
    assert stopped.token_ids == full.token_ids[: full.token_ids.index(full.token_ids[3])]


def test_logprobs_and_timings(mlx: Any) -> None:
    done = mlx.generate(PROMPT, GREEDY, logprobs=0)
    assert done.logprobs is not None and len(done.logprobs) == len(done.token_ids)
    assert all(lp <= 0.0 for lp in done.logprobs)
    t = done.timings
    # one at a time, mlx-lm times the request; in a shared batch only unillm's clock can
    assert t.source == ("wall" if mlx.capabilities.batching else "engine")
    assert t.decode_s > 0 and t.decode_tokens_per_s
    assert t.peak_memory_bytes and t.peak_memory_bytes > 0


def test_chat_uses_the_tokenizer_template(mlx: Any, llama: Any) -> None:
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    assert mlx.render_chat(messages) == llama.render_chat(messages)
    reply = mlx.chat(messages, GREEDY)
    assert reply.token_ids == llama.chat(messages, GREEDY).token_ids
    assert "".join(c.text for c in mlx.stream_chat(messages, GREEDY)) == reply.text


def test_kv_stats_and_prefix_reuse(mlx: Any) -> None:
    mlx.reset()
    assert mlx.kv_stats().used_tokens == 0
    ids = mlx.tokenize("Once upon a time, there was a small model that wanted to tell stories.")
    first = mlx.generate(ids, GREEDY, max_tokens=4)
    assert first.usage.cached_prompt_tokens == 0
    stats = mlx.kv_stats()
    assert stats.used_tokens == len(ids) + 4
    assert stats.bytes_per_token == 2 * 2 * 1 * 64 * 4  # K and V, 2 layers, 1 KV head, f32
    assert stats.used_bytes and stats.used_bytes >= stats.used_tokens * stats.bytes_per_token
    again = mlx.generate(ids, GREEDY, max_tokens=4)
    assert again.usage.cached_prompt_tokens == len(ids) - 1 and again.token_ids == first.token_ids
    turn = mlx.generate([*ids, *first.token_ids[:3]], GREEDY, max_tokens=4)
    assert turn.usage.cached_prompt_tokens == len(ids) + 2
    other = mlx.generate("Something else entirely", GREEDY, max_tokens=2)
    assert other.usage.cached_prompt_tokens == 0
    assert mlx.kv_stats().prefix_cache_hits >= 2


def test_reused_prefix_gives_the_same_tokens(mlx: Any) -> None:
    """A prompt evaluated on top of a reused prefix gives what a fresh evaluation gives."""
    prompts = [p + " and then" for p in PROMPTS[:3]]
    fresh = []
    for p in prompts:
        mlx.reset()
        fresh.append(mlx.generate(p, GREEDY).token_ids)
    reused = []
    for p in prompts:
        mlx.generate(p[: len(p) // 2], GREEDY, max_tokens=1)  # leave a prefix in the cache
        done = mlx.generate(p, GREEDY)
        assert done.usage.cached_prompt_tokens
        reused.append(done.token_ids)
    assert reused == fresh


def test_concurrent_async_callers_get_independent_outputs(mlx: Any) -> None:
    prompts = [f"Story number {i}: once upon a time" for i in range(6)]
    sequential = [mlx.generate(p, GREEDY).token_ids for p in prompts]

    async def main() -> list[tuple[int, ...]]:
        done = await asyncio.gather(*(mlx.agenerate(p, GREEDY) for p in prompts))
        return [d.token_ids for d in done]

    assert asyncio.run(main()) == sequential


def test_concurrent_callers_share_one_batch(mlx: Any) -> None:
    if not mlx.capabilities.batching:
        pytest.skip("one request at a time in this mode")
    seen_active: list[int] = []

    async def one(i: int) -> tuple[int, ...]:
        ids: list[int] = []
        async for chunk in mlx.astream(f"Request {i} says", GREEDY, max_tokens=48, ignore_eos=True):
            seen_active.append(mlx._batcher.active)
            ids.extend(chunk.token_ids)
        return tuple(ids)

    async def main() -> list[tuple[int, ...]]:
        return list(await asyncio.gather(*(one(i) for i in range(4))))

    together = asyncio.run(main())
    assert max(seen_active) > 1  # several sequences were decoded in the same steps
    alone = [
        mlx.generate(f"Request {i} says", GREEDY, max_tokens=48, ignore_eos=True).token_ids for i in range(4)
    ]
    assert together == alone


def test_prefill_batch_size_default_and_bounds(tiny: TinyModel) -> None:
    """On the CPU build, prompts prefill one at a time unless asked; more than batch_size is refused."""
    import mlx.core as mx

    from unillm.engines.mlx import MLXEngine

    with MLXEngine(model=str(tiny.hf_dir), context_length=256, options={"batch_size": 4}) as e:
        on_cpu = mx.default_device().type == mx.DeviceType.cpu
        assert e._batcher._gen.prefill_batch_size == (1 if on_cpu else 4)
    with pytest.raises(ConfigError, match="prefill_batch_size=8 exceeds batch_size=4"):
        MLXEngine(model=str(tiny.hf_dir), options={"batch_size": 4, "prefill_batch_size": 8})


def test_prompts_prefilled_together_give_the_tokens_they_give_alone(
    tiny: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prefill_batch_size > 1: prompts of different lengths sent together are prefilled as one
    (padded) batch, and each still gets the tokens it gets alone."""
    import_mlx_lm()
    from mlx_lm.generate import PromptProcessingBatch

    from unillm.engines.mlx import MLXEngine

    widths: list[int] = []  # prompts in each prefill step
    step = PromptProcessingBatch.prompt

    def prompt(self: Any, tokens: list[list[int]]) -> Any:
        widths.append(len(tokens))
        return step(self, tokens)

    monkeypatch.setattr(PromptProcessingBatch, "prompt", prompt)

    prompts = [f"Request {i} says{' and more' * i}" for i in range(4)]
    opts = {"batch_size": 4, "prefill_batch_size": 4}
    with MLXEngine(model=str(tiny.hf_dir), context_length=256, options=opts) as e:
        assert e._batcher._gen.prefill_batch_size == 4

        async def main() -> list[tuple[int, ...]]:
            done = await asyncio.gather(*(e.agenerate(p, GREEDY, ignore_eos=True) for p in prompts))
            return [d.token_ids for d in done]

        together = asyncio.run(main())
        assert max(widths) > 1  # some prompts were prefilled in one step
        alone = [e.generate(p, GREEDY, ignore_eos=True).token_ids for p in prompts]
    assert together == alone
    assert all(len(t) == GREEDY.max_tokens for t in together)


def test_breaking_a_stream_leaves_the_engine_usable(mlx: Any) -> None:
    full = mlx.generate(PROMPT, GREEDY)
    stream = mlx.stream(PROMPT, GREEDY)
    got = [next(stream) for _ in range(3)]
    stream.close()
    assert [c.token_ids[0] for c in got] == list(full.token_ids[:3])
    assert mlx.generate(PROMPT, GREEDY).token_ids == full.token_ids


def test_conformance(mlx: Any) -> None:
    assert len(check_engine(mlx, PROMPT)) >= 7


def test_context_too_long(mlx: Any) -> None:
    with pytest.raises(ContextLengthExceeded, match="512"):
        mlx.stream("word " * 600, GREEDY)


# ---- errors with real bad directories ----


def copy_hf(tiny: TinyModel, dest: Path) -> Path:
    shutil.copytree(tiny.hf_dir, dest)
    return dest


def test_not_an_hf_directory(tmp_path: Path, tiny: TinyModel) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFormatError, match=r"no config\.json"):
        auto_engine(tmp_path / "empty", backend="mlx")
    with pytest.raises(ModelFormatError, match=r"backend='llama\.cpp'"), pytest.warns(UnillmWarning):
        auto_engine(tiny.gguf_path, backend="mlx")
    with pytest.raises(ModelNotFound):
        auto_engine(tmp_path / "absent", backend="mlx")
    with pytest.raises(ModelNotFound):
        auto_engine("nobody/not-in-the-cache", backend="mlx")


def test_unsupported_model_type(tmp_path: Path, tiny: TinyModel) -> None:
    d = copy_hf(tiny, tmp_path / "alien")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "alienformer"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match="alienformer"):
        auto_engine(d, backend="mlx")


def test_missing_tokenizer(tmp_path: Path, tiny: TinyModel) -> None:
    d = copy_hf(tiny, tmp_path / "notok")
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelFormatError, match="no tokenizer"):
        auto_engine(d, backend="mlx")


def test_missing_weights(tmp_path: Path, tiny: TinyModel) -> None:
    d = copy_hf(tiny, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="incomplete"):
        auto_engine(d, backend="mlx")


def test_mlx_not_installed(tiny: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlx_lm", None)
    with pytest.raises(BackendUnavailable, match=r"unillm\[mlx\]"):
        auto_engine(tiny.hf_dir, backend="mlx")


def test_a_context_past_the_trained_one_is_reduced_to_it_and_said(tiny: TinyModel) -> None:
    """The rule llama.cpp follows, in the same words (unillm._contract._context.context_for):
    mlx-lm's positions end at the trained context, so a longer one is reduced to it, said."""
    from unillm.engines.mlx import MLXEngine

    match = "mlx: context_length 100000 was asked for, 4096 is used: .* trained for 4096 tokens"
    engine = MLXEngine(model=str(tiny.hf_dir), context_length=100_000, options={"batch_size": 1})
    with pytest.warns(UnillmWarning, match=match), engine as e:
        assert e.context_length == 4096


def test_auto_engine_picks_mlx_for_an_hf_directory(tiny: TinyModel) -> None:
    with auto_engine(tiny.hf_dir, context_length=128) as e:
        assert e.name == "mlx"
        assert e.selection is not None and "does not read safetensors" in e.selection.explain()


# ---- what the backend tells the selector, and what it is told ----


def test_capabilities_follow_the_options() -> None:
    from unillm.engines.mlx import MLXEngine

    assert MLXEngine.capabilities_for(MLXEngine.Options(batch_size=4)).batching is True
    assert MLXEngine.capabilities_for(MLXEngine.Options(batch_size=1)).batching is False
    assert MLXEngine.capabilities_for(MLXEngine.Options()).batching is True  # batch_size 8


@pytest.mark.parametrize(
    ("options", "planned"),
    [({}, "f32"), ({"batch_size": 1}, "f32"), ({"batch_size": 1, "kv_bits": 8}, "q8"),
     ({"batch_size": 1, "kv_bits": 4}, "q4")],
)  # fmt: skip
def test_kv_bytes_per_token_is_the_planners(tiny: TinyModel, options: dict[str, Any], planned: str) -> None:
    """One KV formula: the engine's bytes per token are the plan's for the same model and KV dtype
    (the tiny model is f32; mlx-lm's 8- and 4-bit caches cost the table's q8 and q4 bytes)."""
    from unillm.engines.mlx import MLXEngine

    info = inspect_model(tiny.hf_dir)
    expected = plan(info, load_hardware(LAPTOP), Workload(kv_cache_dtype=planned)).kv_bytes_per_token  # type: ignore[arg-type]
    with MLXEngine(model=str(tiny.hf_dir), context_length=256, options=options) as e:
        stats = e.kv_stats()
        assert stats.bytes_per_token == expected
        assert stats.dtype == (f"{options['kv_bits']}-bit" if "kv_bits" in options else None)


def test_kv_bits_while_batching_is_not_applied_and_says_so(tiny: TinyModel) -> None:
    from unillm.engines.mlx import MLXEngine

    e = MLXEngine(model=str(tiny.hf_dir), context_length=256, options={"kv_bits": 8})
    with pytest.warns(UnillmWarning, match="BatchGenerator does not quantize"), e:
        stats = e.kv_stats()
        assert (stats.dtype, stats.bytes_per_token) == (None, 2 * 2 * 1 * 64 * 4)  # f32, not q8


def test_the_load_reads_the_facts_it_is_given(tiny: TinyModel) -> None:
    """The model's shape comes from ``engine.facts`` (what auto_engine read), not a second read."""
    from dataclasses import replace

    from unillm.engines.mlx import MLXEngine

    info = inspect_model(tiny.hf_dir)
    e = MLXEngine(model=str(tiny.hf_dir), options={"batch_size": 1})
    e.facts = Facts(str(tiny.hf_dir), model=replace(info, context_length=300), hardware=None)
    with e:
        assert e._n_ctx == 300
        with pytest.raises(ContextLengthExceeded, match="300"):
            e.stream("word " * 320, GREEDY)


def test_the_model_directory_of_a_multi_format_root_and_a_repo_id(tiny: TinyModel) -> None:
    from unillm.engines.mlx import MLXEngine

    with MLXEngine(model=str(tiny.root), context_length=128, options={"batch_size": 1}) as e:
        assert e._info.path == str(tiny.hf_dir) and e._info.format == "safetensors"


def test_fallback_steps() -> None:
    from unillm.engines.mlx import MLXEngine

    facts = Facts("m", model=None, hardware=None)

    def labels(**options: Any) -> list[str]:
        cfg = EngineConfig(model="m", context_length=4096, options=options)
        return [f.label for f in MLXEngine.fallbacks(cfg, facts)]

    base = ["context_length=2048", "context_length=1024"]
    assert labels(batch_size=1) == [*base, "kv_bits=8"]
    assert labels(batch_size=1, kv_bits=4) == base  # already quantized
    assert labels() == base  # batching: BatchGenerator would not quantize the cache
    (step,) = [f for f in MLXEngine.fallbacks(EngineConfig(model="m", options={"batch_size": 1}), facts)]
    assert (step.cost, step.options, step.kv_cache_dtype) == (Cost.QUALITY, {"kv_bits": 8}, "q8")


def test_probe_build_reports_the_installed_mlx() -> None:
    from unillm.engines.mlx import MLXEngine, _build

    hw = load_hardware(LAPTOP)
    findings: list[str] = []
    build = MLXEngine.probe_build(hw, findings)
    assert build is not None and build == _build.build(hw, [])


_LIMITS = """
import resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # something a lowering would show
before = resource.getrlimit(resource.RLIMIT_NOFILE)
if sys.argv[1] == "unillm":
    from unillm.engines.mlx._model import import_mlx_lm

    import_mlx_lm()
import mlx_lm.generate
print(list(before), list(resource.getrlimit(resource.RLIMIT_NOFILE)))
"""


def test_loading_mlx_leaves_the_processs_open_file_limit_as_it_was() -> None:
    """mlx-lm's utils set RLIMIT_NOFILE to (2048, 4096) when imported, lowering a higher limit for
    the rest of the process and every process it starts; unillm imports it so that a limit is only
    raised. In subprocesses: the import changes the process for good."""
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] <= 4096:
        pytest.skip("this machine's hard limit is not above mlx-lm's 4096: nothing to lower")

    def limits(how: str) -> tuple[list[int], list[int]]:
        argv = [sys.executable, "-c", _LIMITS, how]
        done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        before, after = done.stdout.strip().split("] [")
        return json.loads(before + "]"), json.loads("[" + after)

    before, after = limits("plain")
    assert after == [2048, 4096] != before  # mlx-lm's import lowers it (the reason for the guard)
    before, after = limits("unillm")
    assert after == before
