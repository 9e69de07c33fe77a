"""`unillm doctor` lists the installed plugins: the distribution and version pip installed, the
backends each reaches, and those that failed, while the others keep working."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ._plugin_util import ROOT, clean_env, fake_install, pip_install, run


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """unillm-reverse installed by pip from its directory, beside a plugin whose import fails."""
    where = pip_install(ROOT / "plugins" / "unillm-reverse", tmp_path_factory.mktemp("site"))
    (where / "unillm_broken_plugin.py").write_text("raise ImportError('needs libbroken.so')\n")
    fake_install(where, "unillm-broken", "broken", "unillm_broken_plugin")
    return where


def _env(site: Path, tmp_path: Path) -> dict[str, str]:
    return {**clean_env(tmp_path / "cache"), "PYTHONPATH": str(site)}


def test_doctor_json_lists_plugins_with_versions_reach_and_failures(site: Path, tmp_path: Path) -> None:
    out = json.loads(run(["-m", "unillm", "doctor", "--json"], _env(site, tmp_path)))
    plugins = {p["name"]: p for p in out["plugins"]}
    reverse = plugins["reverse"]
    assert (reverse["distribution"], reverse["version"]) == ("unillm-reverse", "0.1.0")
    assert reverse["backends"] == ["reverse"] and reverse["failures"] == []
    broken = plugins["broken"]
    assert broken["backends"] == [] and "libbroken.so" in broken["failures"][0]
    assert "reverse" in out["backends"] and "llama.cpp" in out["backends"]  # the others still work


def test_doctor_table_shows_the_plugins(site: Path, tmp_path: Path) -> None:
    env = {**_env(site, tmp_path), "COLUMNS": "200"}
    text = run(["-m", "unillm", "doctor"], env)
    rows = [line for line in text.splitlines() if "unillm-reverse" in line or "unillm-broken" in line]
    assert any("reverse" in r and "0.1.0" in r and "ok" in r for r in rows), text[-3000:]
    assert any("broken" in r and "failed" in r for r in rows), text[-3000:]


def test_doctor_says_when_no_plugin_is_installed(tmp_path: Path) -> None:
    env = {**clean_env(tmp_path / "cache"), "COLUMNS": "200"}
    env.pop("PYTHONPATH", None)
    assert "plugins  none installed" in run(["-m", "unillm", "doctor"], env, cwd=Path(os.sep))


def test_backends_show_the_capability_matrix(site: Path, tmp_path: Path) -> None:
    out = json.loads(run(["-m", "unillm", "backends", "--json"], _env(site, tmp_path)))
    import unillm

    for name, row in out["backends"].items():  # the JSON is each class's declaration, a plugin's too
        declared = unillm.backends()[name].cls.capabilities if name in unillm.backends() else None
        caps = row["capabilities"]
        assert isinstance(caps["batching"], bool) and isinstance(caps["sampling"], list)
        if declared is not None:
            assert set(caps["sampling"]) == set(declared.sampling), name
    assert "reverse" in out["backends"]
    text = run(["-m", "unillm", "backends"], {**_env(site, tmp_path), "COLUMNS": "220"})
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if "structured" in line)  # the matrix's header
    assert "logprobs" in lines[at] and "batching" in lines[at]
    vllm_row = next((line for line in lines[at:] if line.startswith("│ vllm ")), None)
    if vllm_row is not None:  # vLLM declares structured output, logprobs and batching
        assert vllm_row.count("yes") >= 3, vllm_row
