"""The openai-http plugin's own tests pass (against real servers on loopback), and the plugin is
found through a real entry point, beside the built-ins, without any change to unillm."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

from ._plugin_util import ROOT, clean_env, pip_install, run, unillm_imports

PLUGIN = ROOT / "plugins" / "unillm-openai-http"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return clean_env(tmp_path_factory.mktemp("unillm-cache"))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin installed by pip from its directory (code and real .dist-info, no
    dependencies): the tests below run that copy, not the source tree."""
    return pip_install(PLUGIN, tmp_path_factory.mktemp("site"))


def test_the_plugin_imports_nothing_private() -> None:
    ours, private = unillm_imports(PLUGIN.rglob("*.py"))
    assert {"unillm", "unillm.backend", "unillm.testing"} <= set(ours)
    assert private == [], f"the plugin imports private modules: {private}"


def test_openai_http_plugin_tests_pass(env: dict[str, str], site: Path) -> None:
    plugin_env = {**env, "PYTHONPATH": str(site)}  # the installed copy
    out = run(
        ["-m", "pytest", str(PLUGIN / "tests"), "-q", "-p", "no:cacheprovider", "-rs"],
        plugin_env,
        timeout=1200,  # vLLM's server alone takes a minute to start here, several under load
    )
    passed = int(re.findall(r"(\d+) passed", out)[-1])
    skipped = re.findall(r"(\d+) skipped", out)
    # 99 with every server here (unillm serve on llama.cpp, vLLM's, llama-cpp-python's, mlx_lm's);
    # the offline ones (hook, options, /metrics of each family, the wire against a scripted server)
    # always
    assert passed >= 20, out
    if not skipped:
        assert passed >= 99, out
    assert not re.search(r"\d+ (failed|error)", out), out


def test_openai_http_plugin_is_found_through_its_entry_point(env: dict[str, str], site: Path) -> None:
    # pip installed it: its .dist-info names the module in the "unillm" entry-point group
    script = (
        "import sys, unillm\n"
        "from unillm._choose._registry import default_registry\n"
        "for name, info in unillm.backends().items():\n"
        "    print(f'backend {name} from {info.source}')\n"
        "print('failures', default_registry().failures)\n"
        "cls = unillm.backends()['openai-http'].cls\n"
        "try:\n"
        "    cls({'model': 'tiny'}).load()\n"
        "except unillm.ConfigError as exc:\n"
        "    print('refused', type(exc).__name__, exc)\n"
    )
    plugin_env = {**env, "PYTHONPATH": str(site)}
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
