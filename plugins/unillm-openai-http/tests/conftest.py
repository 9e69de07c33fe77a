"""Fixtures the plugin's tests share: the tiny model, a folder for server logs, and no server
configured from the developer's environment."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from unillm.testing import TinyModel, build_tiny_model


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The ~2 MB tiny Llama (HF dir + GGUF from the same weights), built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), "small")


@pytest.fixture(scope="session")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(autouse=True)
def _no_configured_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # a developer's own server must not take part in these tests
    monkeypatch.delenv("UNILLM_OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("UNILLM_OPENAI_API_KEY", raising=False)
    yield
