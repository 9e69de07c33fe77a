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


def test_install_hints_keep_their_brackets(monkeypatch: pytest.MonkeyPatch) -> None:
    """`unillm[exllamav2]` is an extra, not rich markup: the command must print it whole."""
    monkeypatch.setenv("UNILLM_EXLLAMAV2_ASSUME_GPU", "0")
    monkeypatch.setenv("COLUMNS", "400")  # one line per row
    out = runner.invoke(app, ["backends"])
    assert out.exit_code == 0
    assert "pip install 'unillm[exllamav2]'" in out.output


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


def test_doctor_json() -> None:
    import json

    out = runner.invoke(app, ["doctor", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["hardware"]["cpu_cores"] >= 1 and data["hardware"]["ram_total_bytes"] > 0
    assert "llama.cpp" in data["backends"]


def test_inspect_plan_select(tiny: object) -> None:
    import json

    gguf = str(tiny.gguf_path)  # type: ignore[attr-defined]
    out = runner.invoke(app, ["inspect", gguf])
    assert out.exit_code == 0, out.output
    assert "llama" in out.output and "F32" in out.output and "kv bytes/token" in out.output
    info = json.loads(runner.invoke(app, ["inspect", gguf, "--json"]).output)
    assert info["format"] == "gguf" and info["layers"] == 2
    planned = runner.invoke(app, ["plan", gguf, "--context", "4096"])
    assert planned.exit_code == 0, planned.output
    assert "fits" in planned.output and "kv cache" in planned.output
    chosen = runner.invoke(app, ["select", gguf])
    assert chosen.exit_code == 0 and chosen.output.strip() == "llama.cpp"
    explained = runner.invoke(app, ["select", gguf, "--explain", "--concurrency", "8"])
    assert "the ten questions:" in explained.output and "8 concurrent" in explained.output


def test_plan_and_select_for_a_machine_we_do_not_have(tiny: object) -> None:
    profile = Path(__file__).parent / "profiles" / "h100-8x-nvlink.json"
    hf = str(tiny.hf_dir)  # type: ignore[attr-defined]
    out = runner.invoke(app, ["select", hf, "--hardware", str(profile), "--concurrency", "64", "--explain"])
    assert out.exit_code == 0, out.output
    assert "vllm" in out.output  # the guide's first choice, named with how to install it
    assert "NVLink between all GPUs" in out.output
    bad = runner.invoke(app, ["plan", hf, "--hardware", str(profile.with_name("absent.json"))])
    assert bad.exit_code == 2 and "hardware profile not found" in bad.output
