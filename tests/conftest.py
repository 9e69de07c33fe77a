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
