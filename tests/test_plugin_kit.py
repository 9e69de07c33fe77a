"""A plugin takes part like a built-in: tests/plugin_ggufish, installed through a real entry point
and written against public names only, outranks llama.cpp where its guide entry says so, shows
in `unillm select --explain`, and has its own fallback steps walked by auto_engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ._plugin_util import unillm_imports

PLUGIN = Path(__file__).parent / "plugin_ggufish"
ROOT = Path(__file__).parent.parent


def test_the_plugin_imports_nothing_private() -> None:
    ours, private = unillm_imports(PLUGIN.rglob("*.py"))
    assert ours, "the plugin should use unillm"
    assert private == [], f"the plugin imports private modules: {private}"


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """An installed distribution by hand: its .dist-info with the entry point; the code beside."""
    info = tmp_path / "unillm_ggufish-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: unillm-ggufish\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[unillm]\nggufish = unillm_ggufish\n")
    return tmp_path


def run(site: Path, code: str, *args: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(PLUGIN), str(ROOT)])}
    env.pop("UNILLM_BACKEND", None)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


CHOSEN = """
import json, sys
import unillm
from unillm_ggufish.engine import LOADS

gguf = sys.argv[1]
e = unillm.auto_engine(gguf, concurrency=8, backend_options={"ggufish": {"fits_at": 2}})
text = e.generate("one two three", max_tokens=3).text
print(json.dumps({
    "name": e.name, "text": text, "loads": LOADS, "steps": e.selection.steps,
    "candidates": [[c.name, c.eligible, c.score] for c in e.selection.candidates],
    "source": next(c.source for c in e.selection.candidates if c.name == "ggufish"),
}))
"""


def test_a_plugin_outranks_llama_cpp_where_its_entry_says_and_its_steps_are_walked(
    site: Path, tiny_gguf: Path
) -> None:
    got = run(site, CHOSEN, str(tiny_gguf))
    assert got["name"] == "ggufish" and got["source"] == "ggufish"
    assert got["text"] == "one two three"
    ranked = [c[0] for c in got["candidates"]]  # type: ignore[union-attr]
    assert ranked.index("ggufish") < ranked.index("llama.cpp")
    # its own steps, in the order it declared them, before the (costlier) shorter context
    assert got["loads"] == [[8, None], [4, None], [2, None]]  # the context left as asked
    steps = got["steps"]
    assert isinstance(steps, list) and len(steps) == 2
    assert "ggufish: out of memory (8 slots" in steps[0] and "retrying with slots=4" in steps[0]
    assert "retrying with slots=2" in steps[1]


LOCAL = """
import json, sys
import unillm
from unillm import Workload, inspect_model, select
from unillm._choose._registry import default_registry

reg = default_registry()
info = inspect_model(sys.argv[1])
hw = unillm.Hardware("Linux", "x86_64", "cpu", 8, (), 64 * 10**9)
out = {}
for users in (1, 8):
    s = select(hw, info, Workload(concurrency=users), reg.backends(), guide_entries=reg.guide())
    out[users] = [c.name for c in s.candidates if c.eligible]
print(json.dumps(out))
"""


def test_where_its_entry_does_not_apply_llama_cpp_keeps_the_case(site: Path, tiny_gguf: Path) -> None:
    got = run(site, LOCAL, str(tiny_gguf))
    assert got["1"][:2] == ["llama.cpp", "ggufish"]  # type: ignore[index]
    assert got["8"][:2] == ["ggufish", "llama.cpp"]  # type: ignore[index]


EXPLAIN = """
import json, sys
from typer.testing import CliRunner
from unillm.cli import app

r = CliRunner().invoke(app, ["select", sys.argv[1], "--concurrency", "8", "--explain"])
print(json.dumps({"code": r.exit_code, "out": r.output}))
"""


def test_its_guide_entry_shows_in_select_explain(site: Path, tiny_gguf: Path) -> None:
    got = run(site, EXPLAIN, str(tiny_gguf))
    out = str(got["out"])
    assert got["code"] == 0, out
    line = next(line for line in out.splitlines() if "ggufish [ggufish]" in line)
    assert line.strip().startswith("+") and "ggufish batches GGUF requests for several users" in line
