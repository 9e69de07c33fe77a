"""Fixtures: the tiny model (HF dir + GGUF, same weights), its OpenVINO IR export, engines on it.

The export runs optimum-intel in the interpreter ``$UNILLM_CONVERTER_PYTHON`` names (this
project's ``scripts/converters.sh`` builds it; ~18 s, then cached beside the tiny model).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _ov import F32, open_engine
from unillm_openvino_genai.engine import OpenVINOGenAIEngine

import unillm
from unillm.testing import TinyModel, convert_tiny, tiny_model


@pytest.fixture(scope="session")
def tiny() -> TinyModel:
    # in $UNILLM_CACHE (else ~/.cache/unillm): the IR export is cached beside it, for the next run
    return tiny_model("small")


@pytest.fixture(scope="session")
def ir_dir(tiny: TinyModel) -> Path:
    if not os.environ.get("UNILLM_CONVERTER_PYTHON") and importlib.util.find_spec("optimum") is None:
        pytest.skip("no converter: set UNILLM_CONVERTER_PYTHON to an interpreter with optimum-intel")
    return convert_tiny(tiny, "openvino")


@pytest.fixture(scope="session")
def engine(ir_dir: Path) -> Iterator[OpenVINOGenAIEngine]:
    with open_engine(ir_dir, properties=F32) as e:
        yield e


# ---- the fixtures unillm.testing.Conformance asks for ----


@pytest.fixture(scope="session")
def unillm_engine(engine: OpenVINOGenAIEngine) -> OpenVINOGenAIEngine:
    return engine


@pytest.fixture(scope="session")
def unillm_engine_factory(ir_dir: Path) -> Callable[[], OpenVINOGenAIEngine]:
    return lambda: open_engine(ir_dir, properties=F32)


@pytest.fixture(scope="session")
def unillm_reference(tiny: TinyModel) -> Iterator[Any]:
    # llama.cpp on the GGUF of the same tensors
    with unillm.load_engine({"model": str(tiny.gguf_path), "backend": "llama.cpp"}) as ref:
        yield ref


@pytest.fixture
def unillm_missing_model(tmp_path: Path) -> str:
    return str(tmp_path / "no-such-ir-dir")
