"""Embeddings on the real engines (llama.cpp, MLX) over the tiny embedding models: the same weights
give the same vectors on each, batched or one at a time; pooling, normalization, dimensions,
limits and truncation; what an engine loaded for another task says; the model's pooling read from
its files and the selector loading for it (vLLM's are in tests/test_vllm_embed.py)."""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from unillm import (
    ConfigError,
    ContextLengthExceeded,
    EngineClosed,
    UnillmWarning,
    inspect_model,
    load_engine,
)
from unillm.testing import TinyModel, tiny_embedding_model

HAS_MLX = importlib.util.find_spec("mlx_lm") is not None
HAS_LLAMA = importlib.util.find_spec("llama_cpp") is not None

#: texts of 1 to ~150 tokens, in words none of the tests chose for the tokenizer
TEXTS = [
    "a",
    "Hello, world!",
    "Why is the sky blue? Because air scatters blue light more than red light.",
    "Once upon a time, there was a small model that wanted to tell stories. " * 6,
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 2026",
    "ünïcödé ✓ 中文 🙂",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    root = tmp_path_factory.mktemp("embed")
    return {p: tiny_embedding_model(p, cache_dir=root) for p in ("last", "mean")}


def _open(backend: str, path: Path, **config: Any) -> Any:
    if backend == "llama.cpp" and not HAS_LLAMA:
        pytest.skip("llama-cpp-python is not installed")
    if backend == "mlx" and not HAS_MLX:
        pytest.skip("mlx-lm is not installed")
    return load_engine({"model": str(path), "backend": backend, "context_length": 256, **config})


@pytest.fixture(scope="module")
def engines(models: dict[str, TinyModel]) -> Iterator[dict[tuple[str, str], Any]]:
    """llama.cpp and MLX, each on the last- and the mean-pooling model (four loads: 0.2 s each)."""
    opened: dict[tuple[str, str], Any] = {}
    try:
        for pooling, m in models.items():
            opened["llama.cpp", pooling] = _open("llama.cpp", m.gguf_path)
            opened["mlx", pooling] = _open("mlx", m.hf_dir)
        yield opened
    finally:
        for e in opened.values():
            e.close()


def _cos(a: Any, b: Any) -> Any:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_the_model_says_its_pooling_and_so_its_task(models: dict[str, TinyModel], tiny: TinyModel) -> None:
    for pooling, m in models.items():
        for path in (m.gguf_path, m.hf_dir):
            info = inspect_model(str(path))
            assert (info.pooling, info.task) == (pooling, "embed")
    for path in (tiny.gguf_path, tiny.hf_dir):  # the same weights, no pooling declared
        info = inspect_model(str(path))
        assert (info.pooling, info.task) == (None, "generate")


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_same_weights_same_vectors_on_llamacpp_and_mlx(engines: dict[Any, Any], pooling: str) -> None:
    a = engines["llama.cpp", pooling]
    b = engines["mlx", pooling]
    assert (a.task, a.pooling, b.task, b.pooling) == ("embed", pooling, "embed", pooling)
    ea, eb = a.embed(TEXTS), b.embed(TEXTS)
    assert ea.array().shape == eb.array().shape == (len(TEXTS), 128)
    assert _cos(ea.array(), eb.array()).min() >= 0.999
    assert ea.usage.prompt_tokens == eb.usage.prompt_tokens == sum(len(a.tokenize(t)) for t in TEXTS)
    # and the pooling is what it says: last differs from mean on the same weights
    other = engines["llama.cpp", "mean" if pooling == "last" else "last"].embed(TEXTS[3])
    assert _cos(ea.array()[3], other.array()[0]) < 0.99


@pytest.mark.parametrize("backend", ["llama.cpp", "mlx"])
def test_a_batch_gives_the_vectors_of_one_text_at_a_time(engines: dict[Any, Any], backend: str) -> None:
    e = engines[backend, "mean"]
    batch = e.embed(TEXTS).array()
    one = np.stack([e.embed(t).array()[0] for t in TEXTS])
    assert np.abs(batch - one).max() < 1e-5
    ids = [e.tokenize(t) for t in TEXTS]  # token ids in: the same vectors
    assert np.abs(e.embed(ids).array() - batch).max() < 1e-6


@pytest.mark.parametrize("backend", ["llama.cpp", "mlx"])
def test_normalize_and_dimensions(engines: dict[Any, Any], backend: str) -> None:
    e = engines[backend, "last"]
    raw = e.embed(TEXTS, normalize=False)
    assert not raw.normalized
    norms = np.linalg.norm(raw.array(), axis=1)
    assert norms.min() > 0 and np.abs(norms - 1).max() > 0.01  # the engine's own scale, kept
    unit = e.embed(TEXTS)
    assert np.allclose(np.linalg.norm(unit.array(), axis=1), 1, atol=1e-5)
    assert np.allclose(unit.array(), raw.array() / norms[:, None], atol=1e-5)
    cut = e.embed(TEXTS, dimensions=32)  # Matryoshka: the leading 32, renormalized
    assert cut.dimensions == 32 and cut.array().shape == (len(TEXTS), 32)
    head = raw.array()[:, :32]
    assert np.allclose(cut.array(), head / np.linalg.norm(head, axis=1, keepdims=True), atol=1e-5)
    assert isinstance(cut.vectors[0][0], float) and len(cut[1]) == 32
    with pytest.raises(ConfigError, match="more than the model's 128"):
        e.embed("a", dimensions=129)


def test_pooling_per_call_on_mlx_and_fixed_at_load_on_llamacpp(engines: dict[Any, Any]) -> None:
    # MLX pools the hidden states itself: mean asked of the last-pooling model is the mean model's
    asked = engines["mlx", "last"].embed(TEXTS, pooling="mean").array()
    assert np.abs(asked - engines["mlx", "mean"].embed(TEXTS).array()).max() < 1e-5
    # llama.cpp's context pools the way it was made: asked otherwise, it says how to load
    with pytest.raises(ConfigError, match=r"pooling='mean'"):
        engines["llama.cpp", "last"].embed("a", pooling="mean")
    with pytest.raises(ConfigError, match="pooling is one of"):
        engines["mlx", "last"].embed("a", pooling="max")


@pytest.mark.parametrize("backend", ["llama.cpp", "mlx"])
def test_long_inputs_are_refused_or_truncated_when_asked(engines: dict[Any, Any], backend: str) -> None:
    e = engines[backend, "last"]
    long = "the quick brown fox jumps over the lazy dog " * 80
    n = len(e.tokenize(long))
    assert n > e.embed_limit == 256
    with pytest.raises(ContextLengthExceeded, match=rf"input 1 has {n} tokens.*truncate=True"):
        e.embed(["a", long])
    got = e.embed(["a", long], truncate=True)
    assert got.truncated == (1,) and got.usage.prompt_tokens == 1 + 256
    head = e.embed([e.tokenize(long)[:256]]).array()[0]
    assert np.abs(got.array()[1] - head).max() < 1e-6


@pytest.mark.parametrize(
    ("texts", "match"),
    [
        ("", "input 0 is an empty string"),
        ([], "no input"),
        (["a", ""], "input 1 is an empty string"),
        ([[]], "empty token list"),
        ([[1, 99999]], "outside the vocabulary"),
        ([["a"]], "token ids must be ints"),
        (b"bytes", "takes a str or a list"),
        (["\ud800"], "lone surrogate"),
        (None, "takes a str or a list"),
    ],
)
def test_bad_input_is_a_config_error(engines: dict[Any, Any], texts: Any, match: str) -> None:
    for backend in ("llama.cpp", "mlx"):
        with pytest.raises(ConfigError, match=match):
            engines[backend, "last"].embed(texts)


def test_bad_options_are_config_errors(engines: dict[Any, Any]) -> None:
    e = engines["llama.cpp", "last"]
    for kwargs, match in [
        ({"dimensions": 0}, "dimensions is a positive int"),
        ({"dimensions": True}, "dimensions is a positive int"),
        ({"normalize": "yes"}, "normalize is True or False"),
        ({"truncate": 1}, "truncate is True or False"),
    ]:
        with pytest.raises(ConfigError, match=match):
            e.embed("a", **kwargs)


def test_each_task_has_its_load_and_says_how(engines: dict[Any, Any], models: dict[str, TinyModel]) -> None:
    e = engines["llama.cpp", "last"]
    with pytest.raises(ConfigError, match="loaded for embed; load the model with task='generate'"):
        e.generate("hi", max_tokens=2)
    with pytest.raises(ConfigError, match="not a reranker"):
        e.rerank("q", ["a", "b"])
    # the same GGUF loaded for generation: generates, and says how to embed
    with _open("llama.cpp", models["last"].gguf_path, task="generate") as g:
        assert g.task == "generate"
        assert g.generate("hi", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(ConfigError, match="load the model with task='embed'"):
            g.embed("hi")
    with (
        pytest.warns(UnillmWarning, match="runs no rerankers"),
        pytest.raises(ConfigError, match=r"does not run rerankers on llama\.cpp"),
    ):
        _open("llama.cpp", models["last"].gguf_path, task="rerank")


def test_a_generative_model_embeds_when_asked(tiny: TinyModel) -> None:
    """A generative GGUF loaded with task='embed' pools by the default, last."""
    if not HAS_LLAMA:
        pytest.skip("llama-cpp-python is not installed")
    with load_engine({"model": str(tiny.gguf_path), "task": "embed", "context_length": 128}) as e:
        assert (e.name, e.task, e.pooling) == ("llama.cpp", "embed", "last")
        assert e.embed(["a", "b"]).array().shape == (2, 128)


def test_two_threads_at_once_get_their_own_vectors(engines: dict[Any, Any]) -> None:
    e = engines["llama.cpp", "mean"]
    want = e.embed(TEXTS).array()
    got: dict[int, Any] = {}

    def run(i: int) -> None:
        for _ in range(5):
            got[i] = e.embed(TEXTS[i % 2 :: 2]).array()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert np.abs(got[0] - want[0::2]).max() < 1e-5
    assert np.abs(got[1] - want[1::2]).max() < 1e-5


def test_aembed_is_embed(engines: dict[Any, Any]) -> None:
    e = engines["mlx", "last"]
    got = asyncio.run(e.aembed(TEXTS, dimensions=64))
    assert np.abs(got.array() - e.embed(TEXTS, dimensions=64).array()).max() < 1e-6


def test_a_closed_engine_says_so(models: dict[str, TinyModel]) -> None:
    e = _open("llama.cpp", models["last"].gguf_path)
    e.close()
    with pytest.raises(EngineClosed):
        e.embed("a")


def test_the_selector_loads_an_embedding_model_for_embed(models: dict[str, TinyModel]) -> None:
    from unillm import auto_engine

    if not HAS_LLAMA:
        pytest.skip("llama-cpp-python is not installed")
    with auto_engine(str(models["mean"].gguf_path), context_length=128) as e:
        assert (e.task, e.pooling) == ("embed", "mean")
        assert e.embed("a").dimensions == 128


def test_check_parity_compares_vectors(engines: dict[Any, Any]) -> None:
    from unillm.testing import check_parity

    report = check_parity([engines["llama.cpp", "mean"], engines["mlx", "mean"]], TEXTS)
    report.assert_parity()
    assert len(report.prompts) == len(TEXTS)
    assert min(p.cosines["mlx"] for p in report.prompts) >= 0.999
    with pytest.raises(ValueError, match="pool differently"):
        check_parity([engines["llama.cpp", "mean"], engines["mlx", "last"]], TEXTS)
    # vectors that differ are reported, not passed: last against mean pooling, forced alike
    forced = engines["mlx", "last"]
    with pytest.raises(AssertionError, match="cosine"):
        check_parity({"mean": engines["mlx", "mean"], "last": _Pooled(forced, "mean")}, TEXTS).assert_parity()


class _Pooled:
    """An engine that says it pools one way and pools its own: what parity must catch."""

    def __init__(self, engine: Any, says: str) -> None:
        self._e, self.pooling, self.task, self.name = engine, says, "embed", "liar"

    def embed(self, texts: Any) -> Any:
        return self._e.embed(texts)

    def tokenize(self, text: str) -> list[int]:
        return self._e.tokenize(text)  # type: ignore[no-any-return]
