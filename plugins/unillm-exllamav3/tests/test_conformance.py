"""unillm's conformance kit (``unillm.testing.Conformance``) on the plugin, against the fake
exllamav3. Greedy parity with a reference engine is left out here: the fake's toy model is not the
tiny model's weights; scripts/gpu_check_exllamav3.py checks parity with exllamav3 on a GPU."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from unillm_exllamav3.engine import ASSUME_GPU_ENV, ExLlamaV3Engine

from unillm.testing import Conformance


@pytest.fixture(scope="module")
def unillm_engine(exl3_dir: Path, exl: Any) -> Iterator[ExLlamaV3Engine]:
    mp = pytest.MonkeyPatch()
    mp.setenv(ASSUME_GPU_ENV, "1")
    with ExLlamaV3Engine(model=str(exl3_dir), context_length=512) as engine:
        yield engine
    mp.undo()


@pytest.fixture
def unillm_engine_factory(exl3_dir: Path) -> Callable[[], ExLlamaV3Engine]:
    return lambda: ExLlamaV3Engine(model=str(exl3_dir), context_length=512)


@pytest.fixture
def unillm_missing_model(tmp_path: Path) -> str:
    return str(tmp_path / "no-such-exl3-model")


class TestConformance(Conformance):
    pass
