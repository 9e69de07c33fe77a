"""unillm's conformance kit on this backend: every rule of the engine contract, one test each,
with llama.cpp on the same weights as the parity reference."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from unillm_onnxruntime_genai.engine import OnnxGenAIEngine

from unillm.testing import Conformance


@pytest.fixture
def unillm_engine(engine: OnnxGenAIEngine) -> OnnxGenAIEngine:
    return engine


@pytest.fixture
def unillm_engine_factory(onnx_dir: Path) -> Callable[[], OnnxGenAIEngine]:
    return lambda: OnnxGenAIEngine({"model": str(onnx_dir)})


@pytest.fixture
def unillm_reference(llama: Any) -> Any:
    return llama


@pytest.fixture
def unillm_missing_model(tmp_path: Path) -> str:
    return str(tmp_path / "no-such-genai-model")


class TestConformance(Conformance):
    pass
