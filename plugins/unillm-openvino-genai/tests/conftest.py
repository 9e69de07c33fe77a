"""Fixtures: the tiny model (HF dir + GGUF, same weights), its OpenVINO IR export, engines on it.

The export runs optimum-intel in the interpreter ``$UNILLM_CONVERTER_PYTHON`` names (this
project's ``scripts/converters.sh`` builds it; ~18 s, then cached beside the tiny model).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from _ov import F32, open_engine
from unillm_openvino_genai.engine import OpenVINOGenAIEngine

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
