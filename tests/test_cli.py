"""The `unillm` command line, run in-process through typer's runner."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from unillm.cli import app

from .conftest import needs_llama_cpp

runner = CliRunner()


def test_backends_and_doctor() -> None:
    out = runner.invoke(app, ["backends"])
    assert out.exit_code == 0 and "llama.cpp" in out.output and "gguf" in out.output
    doc = runner.invoke(app, ["doctor"])
    assert doc.exit_code == 0 and "python" in doc.output and "memory" in doc.output


def test_build_tiny(tmp_path: Path) -> None:
    out = runner.invoke(app, ["testing", "build-tiny", str(tmp_path), "--size", "small"])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "hf" / "config.json").is_file()
    assert (tmp_path / "tiny-small-f32.gguf").is_file()
    bad = runner.invoke(app, ["testing", "build-tiny", str(tmp_path), "--size", "huge"])
    assert bad.exit_code == 2 and "choose one of small, bench" in bad.output


def test_generate_error_is_readable(tmp_path: Path) -> None:
    out = runner.invoke(app, ["generate", str(tmp_path / "absent.gguf"), "hi"])
    assert out.exit_code == 2
    assert "ModelNotFound" in out.output and "never downloads" in out.output


@needs_llama_cpp
def test_generate_and_chat(tiny_gguf: Path) -> None:
    out = runner.invoke(
        app,
        [
            "generate",
            str(tiny_gguf),
            "The quick brown fox",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
            "--explain",
        ],
    )
    assert out.exit_code == 0, out.output
    assert "backend: llama.cpp" in out.output and "[length; " in out.output
    chat = runner.invoke(app, ["chat", str(tiny_gguf), "-m", "Why is the sky blue?", "--max-tokens", "5"])
    assert chat.exit_code == 0, chat.output
    assert "completion tokens" in chat.output


@needs_llama_cpp
def test_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNILLM_CACHE", str(tmp_path))
    out = runner.invoke(app, ["demo"])
    assert out.exit_code == 0, out.output
    for section in ("== selection ==", "chosen by auto", "== stream", "== chat", "usage:", "KVStats("):
        assert section in out.output
    assert (tmp_path / "tiny-small-v1" / "tiny-small-f32.gguf").is_file()  # built on first use
