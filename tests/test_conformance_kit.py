"""The conformance kit (``unillm.testing.Conformance``) on every built-in backend that runs here:
llama.cpp on the tiny GGUF, MLX and vLLM on its HF directory, ExLlamaV2 against its fake, each
with another engine on the same weights as the parity reference; and the kit itself fails an
engine that breaks a rule (so passing it means something)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from unillm import KVStats
from unillm.testing import Conformance, MockEngine, TinyModel

HAS = {m: importlib.util.find_spec(m) is not None for m in ("llama_cpp", "mlx_lm", "vllm")}
FAKE_EXL2 = Path(__file__).resolve().parent / "fake_exllamav2"


def _llama(tiny: TinyModel) -> Any:
    from unillm.engines.llamacpp import LlamaCppEngine

    return LlamaCppEngine(model=str(tiny.gguf_path), context_length=512, options={"n_threads": 2})


@pytest.fixture(scope="module")
def reference(tiny: TinyModel) -> Iterator[Any]:
    if not HAS["llama_cpp"]:
        pytest.skip("llama-cpp-python is not installed")
    with _llama(tiny) as engine:
        yield engine


@pytest.fixture(scope="module")
def embed_model(embed_last: TinyModel) -> TinyModel:
    return embed_last


@pytest.fixture(scope="module")
def embed_reference(embed_model: TinyModel) -> Iterator[Any]:
    """llama.cpp loaded for embeddings on the tiny last-pooling GGUF (a 0.2 s load)."""
    if not HAS["llama_cpp"]:
        pytest.skip("llama-cpp-python is not installed")
    from unillm.engines.llamacpp import LlamaCppEngine

    with LlamaCppEngine(model=str(embed_model.gguf_path), context_length=256) as engine:
        yield engine


@pytest.mark.skipif(not HAS["llama_cpp"], reason="llama-cpp-python is not installed")
class TestLlamaCpp(Conformance):
    @pytest.fixture(scope="class")
    @classmethod
    def unillm_engine(cls, reference: Any) -> Any:
        return reference  # the reference is llama.cpp itself: parity against MLX below

    @pytest.fixture
    def unillm_embed_engine(self, embed_reference: Any) -> Any:
        return embed_reference

    @pytest.fixture
    def unillm_engine_factory(self, tiny: TinyModel) -> Callable[[], Any]:
        return lambda: _llama(tiny)


@pytest.mark.skipif(not HAS["mlx_lm"], reason="mlx-lm is not installed")
class TestMLX(Conformance):
    @pytest.fixture(scope="class")
    @classmethod
    def unillm_engine(cls, tiny: TinyModel) -> Iterator[Any]:
        from unillm.engines.mlx import MLXEngine

        with MLXEngine(model=str(tiny.hf_dir), context_length=512) as engine:
            yield engine

    @pytest.fixture
    def unillm_engine_factory(self, tiny: TinyModel) -> Callable[[], Any]:
        from unillm.engines.mlx import MLXEngine

        return lambda: MLXEngine(model=str(tiny.hf_dir), context_length=512)

    @pytest.fixture
    def unillm_reference(self, reference: Any) -> Any:
        return reference

    @pytest.fixture(scope="class")
    @classmethod
    def unillm_embed_engine(cls, embed_model: TinyModel) -> Iterator[Any]:
        from unillm.engines.mlx import MLXEngine

        with MLXEngine(model=str(embed_model.hf_dir), context_length=256) as engine:
            yield engine

    @pytest.fixture
    def unillm_embed_reference(self, embed_reference: Any) -> Any:
        return embed_reference


@pytest.mark.skipif(not HAS["vllm"], reason="vllm is not installed")
class TestVLLM(Conformance):
    # the session's shared vLLM engine (tests/conftest.py; a start costs 25-60 s here): no
    # factory, so the close checks skip here; tests/test_vllm.py closes its own engines while
    # streaming and twice
    @pytest.fixture(scope="class")
    @classmethod
    def unillm_engine(cls, vllm_engine: Any) -> Any:
        return vllm_engine

    @pytest.fixture
    def unillm_reference(self, reference: Any) -> Any:
        return reference

    @pytest.fixture
    def unillm_embed_engine(self, vllm_embed_engine: Any) -> Any:
        return vllm_embed_engine  # the session's (tests/conftest.py): vLLM embeds from its own start

    @pytest.fixture
    def unillm_embed_reference(self, embed_reference: Any) -> Any:
        return embed_reference


@pytest.fixture(scope="class")
def fake_exllamav2() -> Iterator[None]:
    from unillm.engines.exllamav2 import ASSUME_GPU_ENV

    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(FAKE_EXL2))
    mp.setenv(ASSUME_GPU_ENV, "1")
    yield
    mp.undo()
    for name in [m for m in sys.modules if m == "exllamav2" or m.startswith("exllamav2.")]:
        del sys.modules[name]


@pytest.mark.usefixtures("fake_exllamav2")
class TestExLlamaV2Fake(Conformance):
    @pytest.fixture(scope="class")
    @classmethod
    def unillm_engine(cls, tiny: TinyModel, fake_exllamav2: None) -> Iterator[Any]:
        from unillm.engines.exllamav2 import ExLlamaV2Engine

        with ExLlamaV2Engine(model=str(tiny.hf_dir), context_length=512) as engine:
            yield engine

    @pytest.fixture
    def unillm_engine_factory(self, tiny: TinyModel) -> Callable[[], Any]:
        from unillm.engines.exllamav2 import ExLlamaV2Engine

        return lambda: ExLlamaV2Engine(model=str(tiny.hf_dir), context_length=512)


class TestMockEngine(Conformance):
    test_a_missing_model_is_a_typed_error = None  # a mock reads no model files

    @pytest.fixture(scope="class")
    @classmethod
    def unillm_engine(cls) -> Iterator[Any]:
        with MockEngine(lambda p, s: f"echo {p} and more words here", context_length=64) as engine:
            yield engine

    @pytest.fixture
    def unillm_engine_factory(self) -> Callable[[], Any]:
        return lambda: MockEngine(lambda p, s: "an answer", context_length=64)


# ---- the kit fails engines that break the contract ----


class _ZeroCapacity(MockEngine):
    def kv_stats(self) -> KVStats:
        self._check_open()
        return KVStats(capacity_tokens=0, used_tokens=0)  # "unknown" written as 0


class _StreamDiffers(MockEngine):
    def generate(self, prompt: Any, params: Any = None, **overrides: Any) -> Any:
        out = super().generate(prompt, params, **overrides)
        return type(out)(**{**{f: getattr(out, f) for f in out.__slots__}, "text": out.text + "!"})


class _DeclaresEmbeddings(MockEngine):
    """Says it embeds, but its suite gives the kit no embedding engine to check."""

    capabilities = dataclasses.replace(MockEngine.capabilities, embeddings=True)


def _outcome(engine_cls: type[MockEngine], test: str) -> str:
    """Run one kit test on ``engine_cls`` in a throwaway pytest session: 'passed' or 'failed'."""
    import subprocess
    import textwrap

    source = textwrap.dedent(f"""
        import pytest
        from tests.test_conformance_kit import {engine_cls.__name__} as Cls
        from unillm.testing import Conformance

        class TestIt(Conformance):
            @pytest.fixture(scope="class")
            def unillm_engine(self):
                with Cls(lambda p, s: "one two three four five six seven", context_length=64) as e:
                    yield e
    """)
    root = Path(__file__).resolve().parent.parent
    probe = root / "tests" / f"_kit_probe_{engine_cls.__name__}.py"
    probe.write_text(source)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{probe}::TestIt::{test}"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        probe.unlink()
    if " passed" in proc.stdout and proc.returncode == 0:
        return "passed"
    if " failed" in proc.stdout:
        return "failed"
    if " skipped" in proc.stdout and proc.returncode == 0:
        return "skipped"
    return f"error: {proc.stdout[-2000:]}"


@pytest.mark.parametrize(
    ("engine_cls", "test"),
    [
        (_ZeroCapacity, "test_kv_stats_are_typed_and_unknown_is_none_not_zero"),
        (_StreamDiffers, "test_generate_equals_the_joined_stream"),
        (_DeclaresEmbeddings, "test_embed_batches_like_one_text_at_a_time"),
    ],
)
def test_the_kit_fails_an_engine_that_breaks_a_rule(engine_cls: type[MockEngine], test: str) -> None:
    assert _outcome(engine_cls, test) == "failed"
    # the same test passes on a conforming engine (one that declares no embeddings refuses embed)
    assert _outcome(MockEngine, test) == "passed"
