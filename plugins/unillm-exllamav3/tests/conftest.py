"""Fixtures the plugin's tests share: the fake exllamav3 on ``sys.path`` (the real one needs CUDA
at import), a GPU assumed, and the tiny model as an EXL3 directory."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from unillm_exllamav3.engine import ASSUME_GPU_ENV

from unillm.testing import TinyModel, build_tiny_model

FAKE = Path(__file__).resolve().parent / "fake_exllamav3"
if str(FAKE) not in sys.path:  # the main suite's subprocess puts it on PYTHONPATH already
    sys.path.insert(0, str(FAKE))


@pytest.fixture(autouse=True)
def _gpu_assumed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(ASSUME_GPU_ENV, "1")
    yield


@pytest.fixture(scope="session")
def exl() -> ModuleType:
    import exllamav3

    module: ModuleType = exllamav3
    assert Path(exllamav3.__file__).is_relative_to(FAKE), exllamav3.__file__
    return module


@pytest.fixture
def fake(exl: ModuleType) -> Iterator[Any]:
    """The fake's knobs (GPU memory, step time), restored after the test."""
    from exllamav3 import _fake

    memory, step = list(_fake.GPU_MEMORY), _fake.STEP_SECONDS
    yield _fake
    _fake.GPU_MEMORY[:] = memory
    _fake.STEP_SECONDS = step
    _fake.FAIL_NEXT_STEP = None
    _fake.FAIL_NEXT_PREFILL = None


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The ~2 MB tiny Llama (HF dir + GGUF from the same weights), built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), "small")


def make_exl3(hf_dir: Path, where: Path, bits: float = 4.0) -> Path:
    """``hf_dir`` as exllamav3's converter leaves it: config.json with an EXL3 quantization_config
    (the fake reads the weights' size only, so they stay as they are)."""
    shutil.copytree(hf_dir, where)
    cfg = json.loads((where / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "exl3", "version": "1.6.5", "bits": bits, "head_bits": 6}
    (where / "config.json").write_text(json.dumps(cfg, indent=2))
    return where


@pytest.fixture(scope="session")
def exl3_dir(tiny: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_exl3(tiny.hf_dir, tmp_path_factory.mktemp("exl3") / "tiny-exl3")
