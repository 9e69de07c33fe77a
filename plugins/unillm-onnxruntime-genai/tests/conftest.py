"""The plugin's fixtures: the project's tiny model, converted by ONNX Runtime GenAI's own builder
(``unillm.testing.convert_tiny``, cached beside it), and engines on it.

The builder needs torch, transformers, onnx and onnx-ir, which the runtime does not: it runs in the
interpreter ``$UNILLM_CONVERTER_PYTHON`` names (this repository's scripts/converters.sh prints one).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from unillm_onnxruntime_genai.engine import OnnxGenAIEngine

from unillm.testing import TinyModel, convert_tiny, tiny_model


@pytest.fixture(scope="session")
def tiny() -> TinyModel:
    return tiny_model()  # built once into $UNILLM_CACHE (default ~/.cache/unillm)


@pytest.fixture(scope="session")
def onnx_dir(tiny: TinyModel) -> Path:
    try:
        return convert_tiny(tiny, "onnxruntime-genai")  # cached after the first conversion
    except RuntimeError:
        if os.environ.get("UNILLM_CONVERTER_PYTHON") or importlib.util.find_spec("onnx_ir") is not None:
            raise
        pytest.skip(
            "no converter: set UNILLM_CONVERTER_PYTHON to a Python with torch, transformers, onnx, onnx-ir"
        )


@pytest.fixture(scope="session")
def engine(onnx_dir: Path) -> Iterator[OnnxGenAIEngine]:
    """One loaded engine the read-only tests share."""
    with OnnxGenAIEngine({"model": str(onnx_dir)}) as e:
        yield e


@pytest.fixture
def fresh(onnx_dir: Path) -> Iterator[OnnxGenAIEngine]:
    """An engine of the test's own, for tests that close it."""
    e = OnnxGenAIEngine({"model": str(onnx_dir)}).load()
    yield e
    e.close()


@pytest.fixture(scope="session")
def llama(tiny: TinyModel) -> Iterator[Any]:
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("needs llama-cpp-python (pip install 'unillm[llamacpp]')")
    import unillm

    with unillm.load_engine({"model": str(tiny.gguf_path), "backend": "llama.cpp"}) as e:
        yield e
