"""The openai-http plugin's own tests pass (against real servers on loopback), and the plugin is
found through a real entry point, beside the built-ins, without any change to unillm."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "plugins" / "unillm-openai-http"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UNILLM_")}
    clean["UNILLM_CACHE"] = str(tmp_path_factory.mktemp("unillm-cache"))
    clean.pop("PYTHONPATH", None)
    return clean


def run(args: list[str], env: dict[str, str], timeout: float = 400) -> str:
    proc = subprocess.run(
        [sys.executable, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, (
        f"{args} exited {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def test_openai_http_plugin_tests_pass(env: dict[str, str]) -> None:
    plugin_env = {**env, "PYTHONPATH": str(PLUGIN)}  # importable without installing it
    out = run(["-m", "pytest", str(PLUGIN / "tests"), "-q", "-p", "no:cacheprovider", "-rs"], plugin_env)
    passed = int(re.findall(r"(\d+) passed", out)[-1])
    skipped = re.findall(r"(\d+) skipped", out)
    # 49 with every server here (unillm serve on llama.cpp, llama-cpp-python's, mlx_lm's); the
    # offline ones (hook, options, /metrics of each family, retries against a scripted server) always
    assert passed >= 9, out
    if not skipped:
        assert passed >= 49, out
    assert not re.search(r"\d+ (failed|error)", out), out


def test_openai_http_plugin_is_found_through_its_entry_point(env: dict[str, str], tmp_path: Path) -> None:
    # What `pip install` would leave behind: a .dist-info naming the module in the "unillm" group.
    dist_info = tmp_path / "unillm_openai_http-0.1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: unillm-openai-http\nVersion: 0.1.0\n")
    (dist_info / "entry_points.txt").write_text("[unillm]\nopenai-http = unillm_openai_http\n")
    script = (
        "import sys, unillm\n"
        "from unillm._plugins import default_registry\n"
        "for name, info in unillm.backends().items():\n"
        "    print(f'backend {name} from {info.source}')\n"
        "print('failures', default_registry().failures)\n"
        "cls = unillm.backends()['openai-http'].cls\n"
        "try:\n"
        "    cls({'model': 'tiny'}).load()\n"
        "except unillm.ConfigError as exc:\n"
        "    print('refused', type(exc).__name__, exc)\n"
    )
    plugin_env = {**env, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(PLUGIN)])}
    out = run(["-c", script], plugin_env)
    assert "backend openai-http from openai-http" in out
    assert "backend llama.cpp from builtin" in out  # the plugin sits beside the built-ins
    assert "failures []" in out
    # no base URL configured: it says what to set (and `auto_engine` never picks it: tested there)
    assert "refused ConfigError openai-http needs the server's URL" in out and "UNILLM_OPENAI_BASE_URL" in out


def test_entry_point_discovery_needs_the_dist_info(env: dict[str, str]) -> None:
    if any(ep.name == "openai-http" for ep in importlib.metadata.entry_points(group="unillm")):
        pytest.skip("unillm-openai-http is installed in this environment")
    out = run(["-c", "import unillm; print(sorted(unillm.backends()))"], {**env, "PYTHONPATH": str(PLUGIN)})
    assert "'openai-http'" not in out
    assert "'llama.cpp'" in out
