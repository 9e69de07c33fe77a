"""Speculative decoding (the ``draft_model`` load option) on real engines and the ExLlamaV2 fake.

The tiny model drafts for itself: greedy tokens must be exactly those decoding without a draft
gives, and since the draft is the target, it should be right nearly every time (accepted close to
drafted; a tie the batched verification pass breaks differently may reject one now and then).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from unillm import Completion, ConfigError, ModelNotFound, SamplingParams, UnsupportedParameter
from unillm.testing import TinyModel
from unillm.testing._tiny import TinySpec, build_tiny_model

from .conftest import needs_llama_cpp

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
PROMPTS = ("The quick brown fox", "Once upon a time", "1 2 3 4 5", "there was a small model")
FAKE = Path(__file__).resolve().parent / "fake_exllamav2"
needs_mlx = pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="mlx-lm is not installed")


@pytest.fixture(scope="module")
def other_vocab(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """A tiny model whose vocabulary differs from the tiny model's (640 tokens, not 512)."""
    spec = TinySpec(
        hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=128, vocab_size=640
    )
    return build_tiny_model(tmp_path_factory.mktemp("vocab640"), spec)


def check_same_greedy(plain: Any, drafted: Any, k: int | None) -> list[Completion]:
    """Every prompt's greedy tokens with the draft equal those without; the counts are sane."""
    outs = []
    for prompt in PROMPTS:
        want, got = plain.generate(prompt, GREEDY), drafted.generate(prompt, GREEDY)
        assert got.token_ids == want.token_ids, prompt
        assert len(got.token_ids) == 48 and got.finish_reason == "length"
        assert want.usage.draft_tokens is None and want.usage.accepted_draft_tokens is None
        u = got.usage
        assert u.draft_tokens is not None and u.accepted_draft_tokens is not None
        assert 0 < u.accepted_draft_tokens <= u.draft_tokens
        # self-drafting: the draft agrees with the target at (nearly) every position
        assert u.accepted_draft_tokens >= 0.9 * u.draft_tokens, u
        if k is not None:  # at most k drafts per target pass, and each pass emits at least one
            assert u.draft_tokens <= k * 48
        outs.append(got)
    return outs


# ---- llama.cpp ----


@needs_llama_cpp
@pytest.mark.parametrize("k", [None, 3])
def test_llamacpp_self_draft_gives_the_same_greedy_tokens(tiny: TinyModel, llama: Any, k: int | None) -> None:
    from unillm.engines.llamacpp import LlamaCppEngine

    opts: dict[str, Any] = {"n_threads": 2, "draft_model": str(tiny.gguf_path)}
    if k is not None:
        opts["num_draft_tokens"] = k
    with LlamaCppEngine(model=str(tiny.gguf_path), context_length=512, options=opts) as e:
        assert e.capabilities.speculative
        outs = check_same_greedy(llama, e, k)
        # 48 tokens, the first from the prompt's pass: 47 left, each target pass emitting its
        # drafts (k, default 8, never more than could still be emitted) and one token of its own
        left, drafted = 47, 0
        while left:
            step = min(k or 8, left - 1)
            drafted, left = drafted + step, left - step - 1
        assert outs[0].usage.draft_tokens == drafted
        # a repeated prompt reuses the KV cache, drafts included
        again = e.generate(PROMPTS[-1], GREEDY)
        assert again.token_ids == outs[-1].token_ids and (again.usage.cached_prompt_tokens or 0) > 0
        with pytest.raises(UnsupportedParameter, match="logprobs"):
            e.generate(PROMPTS[0], SamplingParams(max_tokens=4, logprobs=0))
        sampled = e.generate(PROMPTS[1], SamplingParams(temperature=0.8, seed=7, max_tokens=16))
        assert len(sampled.token_ids) <= 16


@needs_llama_cpp
def test_llamacpp_draft_with_a_grammar_keeps_the_format(tiny: TinyModel, llama: Any) -> None:
    """The draft drafts without the grammar; the grammar-constrained target verifies, so the
    output is the constrained one, only the drafts are mostly rejected."""
    from unillm.engines.llamacpp import LlamaCppEngine

    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    params = SamplingParams(temperature=0.0, max_tokens=40, response_format=fmt)
    opts = {"n_threads": 2, "draft_model": str(tiny.gguf_path)}
    with LlamaCppEngine(model=str(tiny.gguf_path), context_length=512, options=opts) as e:
        for prompt in PROMPTS[:2]:
            want, got = llama.generate(prompt, params), e.generate(prompt, params)
            assert got.token_ids == want.token_ids and isinstance(got.parsed()["a"], int)
            u = got.usage
            assert u.draft_tokens and 0 <= (u.accepted_draft_tokens or 0) <= u.draft_tokens


@needs_llama_cpp
def test_llamacpp_prompt_lookup_gives_the_same_greedy_tokens(tiny: TinyModel, llama: Any) -> None:
    from unillm.engines.llamacpp import LlamaCppEngine

    opts = {"n_threads": 2, "draft_model": "prompt-lookup"}
    with LlamaCppEngine(model=str(tiny.gguf_path), context_length=512, options=opts) as e:
        for prompt in PROMPTS:
            want, got = llama.generate(prompt, GREEDY), e.generate(prompt, GREEDY)  # type: ignore[attr-defined]
            assert got.token_ids == want.token_ids
            u = got.usage
            assert u.draft_tokens is not None and 0 <= (u.accepted_draft_tokens or 0) <= u.draft_tokens


@needs_llama_cpp
def test_llamacpp_refuses_bad_drafts(tiny: TinyModel, other_vocab: TinyModel, tmp_path: Path) -> None:
    from unillm.engines.llamacpp import LlamaCppEngine

    def load(**opts: Any) -> None:
        LlamaCppEngine(model=str(tiny.gguf_path), context_length=512, options=opts).load().close()

    with pytest.raises(ConfigError, match=r"draft_model .* does not exist"):
        load(draft_model=str(tmp_path / "nowhere.gguf"))
    with pytest.raises(ConfigError, match=r"draft_model .* is not a .gguf file"):
        load(draft_model=str(tiny.hf_dir))
    with pytest.raises(ConfigError, match=r"another vocabulary .*640 tokens, the model has 512"):
        load(draft_model=str(other_vocab.gguf_path))
    with pytest.raises(ConfigError, match="num_draft_tokens is set without draft_model"):
        load(num_draft_tokens=4)
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        load(draft_model=str(tiny.gguf_path), num_draft_tokens=0)


# ---- MLX ----


@needs_mlx
def test_mlx_self_draft_gives_the_same_greedy_tokens(tiny: TinyModel) -> None:
    from unillm.engines.mlx import MLXEngine

    d = str(tiny.hf_dir)
    with (
        MLXEngine(model=d, context_length=512, options={"batch_size": 1}) as plain,
        MLXEngine(model=d, context_length=512, options={"draft_model": d, "num_draft_tokens": 3}) as e,
    ):
        # a draft runs one request at a time: batch_size left unset becomes 1
        assert e.options.batch_size == 1 and not e.capabilities.batching and e.capabilities.speculative
        outs = check_same_greedy(plain, e, 3)
        # mlx-lm drafts 3 per round, each round ends with one target token: 12 rounds of 4
        assert outs[0].usage.draft_tokens == 36
        again = e.generate(PROMPTS[-1], GREEDY)  # the prompt cache (both models' parts) is reused
        assert again.token_ids == outs[-1].token_ids and (again.usage.cached_prompt_tokens or 0) > 0
        with pytest.raises(UnsupportedParameter, match="response_format"):
            e.generate(PROMPTS[0], SamplingParams(max_tokens=4, response_format={"type": "json_object"}))


@needs_mlx
def test_mlx_refuses_bad_drafts(tiny: TinyModel, other_vocab: TinyModel, tmp_path: Path) -> None:
    from unillm.engines.mlx import MLXEngine

    def load(**opts: Any) -> None:
        MLXEngine(model=str(tiny.hf_dir), context_length=512, options=opts).load().close()

    with pytest.raises(ConfigError, match=r"draft_model .* does not exist"):
        load(draft_model=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=r"draft_model .* holds no config.json"):
        load(draft_model=str(tmp_path))
    with pytest.raises(ConfigError, match="another vocabulary"):
        load(draft_model=str(other_vocab.hf_dir))
    with pytest.raises(ConfigError, match="one request at a time"):
        load(draft_model=str(tiny.hf_dir), batch_size=4)
    with pytest.raises(ConfigError, match="rotating"):
        load(draft_model=str(tiny.hf_dir), max_kv_size=256)
    with pytest.raises(ConfigError, match="num_draft_tokens is set without draft_model"):
        load(num_draft_tokens=2)


# ---- ExLlamaV2 (the fake) ----


@pytest.fixture
def exl() -> Iterator[None]:
    """The fake exllamav2 importable, a GPU assumed; gone again after the test."""
    from unillm.engines.exllamav2 import ASSUME_GPU_ENV

    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(FAKE))
    mp.setenv(ASSUME_GPU_ENV, "1")
    yield
    mp.undo()
    for name in [m for m in sys.modules if m == "exllamav2" or m.startswith("exllamav2.")]:
        del sys.modules[name]


def test_exllamav2_self_draft_gives_the_same_greedy_tokens(
    exl: None, tiny: TinyModel, other_vocab: TinyModel
) -> None:
    from unillm.engines.exllamav2 import ExLlamaV2Engine

    d = str(tiny.hf_dir)
    with (
        ExLlamaV2Engine(model=d, context_length=512) as plain,
        ExLlamaV2Engine(model=d, context_length=512, options={"draft_model": d, "num_draft_tokens": 3}) as e,
    ):
        assert e._generator.num_draft_tokens == 3 and e.capabilities.speculative
        check_same_greedy(plain, e, 3)

    def load(**opts: Any) -> None:
        ExLlamaV2Engine(model=d, context_length=512, options=opts).load().close()

    with pytest.raises(ModelNotFound):
        load(draft_model="/nowhere/draft")
    with pytest.raises(ConfigError, match="vocabulary"):
        load(draft_model=str(other_vocab.hf_dir))
    with pytest.raises(ConfigError, match="num_draft_tokens is set without draft_model"):
        load(num_draft_tokens=3)
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        load(draft_model=d, num_draft_tokens=9)


def test_the_backends_matrix_shows_speculative_decoding() -> None:
    from unillm._choose._registry import default_registry

    caps = {name: info.cls.capabilities.speculative for name, info in default_registry().backends().items()}
    assert caps["llama.cpp"] and caps["mlx"] and caps["exllamav2"]


# ---- vLLM (CPU build): two engine starts, a few minutes ----


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_self_draft_gives_the_same_greedy_tokens(tiny: TinyModel, other_vocab: TinyModel) -> None:
    from unillm.engines.vllm import VLLMEngine

    d = str(tiny.hf_dir)
    base = {"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20, "max_num_seqs": 4, "seed": 0}

    def engine(**opts: Any) -> Any:
        return VLLMEngine(model=d, context_length=256, options={**base, **opts})

    # refused before vLLM starts
    for opts, match in [
        ({"draft_model": "/nowhere/draft"}, "does not exist"),
        ({"draft_model": str(other_vocab.hf_dir)}, "another vocabulary"),
        ({"num_draft_tokens": 3}, "without draft_model"),
        ({"draft_model": d, "speculative_config": {"method": "ngram"}}, "both set"),
    ]:
        with pytest.raises(ConfigError, match=match):
            engine(**opts).load()
    with engine() as plain:
        want = [plain.generate(p, GREEDY).token_ids for p in PROMPTS]
    with engine(draft_model=d, num_draft_tokens=3) as e:
        assert e.capabilities.speculative
        for prompt, ids in zip(PROMPTS, want, strict=True):
            got = e.generate(prompt, GREEDY)
            assert got.token_ids == ids, prompt
            # vLLM counts drafts per engine step, over all running requests: not reported per request
            assert got.usage.draft_tokens is None and got.usage.accepted_draft_tokens is None


def test_the_openai_usage_carries_the_draft_counts_when_set() -> None:
    from unillm import Usage
    from unillm.server._openai_wire import usage_json

    assert usage_json(Usage(5, 48, 0, 41, 40))["completion_tokens_details"] == {  # type: ignore[index]
        "draft_tokens": 41,
        "accepted_draft_tokens": 40,
    }
    assert "completion_tokens_details" not in (usage_json(Usage(5, 48, 0)) or {})
