"""Shared fixtures: the tiny models are built once per test session into a temp dir."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from unillm.testing import TinyModel, build_tiny_model

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
needs_llama_cpp = pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The ~2 MB tiny Llama (HF dir + GGUF), built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), "small")


@pytest.fixture(scope="session")
def tiny_gguf(tiny: TinyModel) -> Path:
    return tiny.gguf_path


@pytest.fixture(scope="session")
def llama(tiny_gguf: Path) -> Iterator[object]:
    """One real llama.cpp engine on the tiny GGUF, shared by the session's tests."""
    if not HAS_LLAMA_CPP:
        pytest.skip("llama-cpp-python is not installed")
    from unillm.engines.llamacpp import LlamaCppEngine

    engine = LlamaCppEngine(model=str(tiny_gguf), context_length=512, options={"n_threads": 2, "seed": 1234})
    with engine:
        yield engine


@pytest.fixture(scope="session")
def converter_python() -> str:
    """The interpreter of the model converters' own environment (scripts/converters.sh builds it on
    first use and reuses it after): torch and transformers < 5.6 stay out of the test environment."""
    import subprocess

    script = Path(__file__).resolve().parent.parent / "scripts" / "converters.sh"
    proc = subprocess.run([str(script)], capture_output=True, text=True, timeout=1800, check=False)
    assert proc.returncode == 0, f"scripts/converters.sh failed:\n{proc.stderr[-4000:]}"
    return proc.stdout.strip().splitlines()[-1]
