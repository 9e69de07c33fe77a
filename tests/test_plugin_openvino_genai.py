"""The openvino-genai plugin's own tests pass (on the tiny model's OpenVINO IR export, against
llama.cpp on the same weights), it imports only unillm's public names, and it is found through a
real entry point beside the built-ins: ``auto_engine`` on an IR directory picks it with no change
to unillm."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ._plugin_util import ROOT, clean_env, pip_install, run, unillm_imports

PLUGIN = ROOT / "plugins" / "unillm-openvino-genai"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin installed by pip from its directory (its code and real .dist-info, as CI and a
    user get it); the tests below run that copy, never the source tree."""
    return pip_install(PLUGIN, tmp_path_factory.mktemp("site"))


pytestmark = pytest.mark.skipif(
    not all(__import__("importlib").util.find_spec(m) for m in ("openvino_genai", "llama_cpp")),
    reason="needs openvino-genai and llama-cpp-python",
)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, converter_python: str) -> dict[str, str]:
    clean = clean_env(tmp_path_factory.mktemp("unillm-cache"))
    # The tiny model and its IR export (~18 s of the converter, more on a busy machine) are kept
    # inside the converters' environment, rebuilt with it: the export is keyed by the weights'
    # digest and the converter's version, so a later run reuses it only when nothing changed.
    cache = Path(converter_python).parent.parent / "unillm-cache"  # bin/python of that venv
    return {**clean, "UNILLM_CACHE": str(cache), "UNILLM_CONVERTER_PYTHON": converter_python}


def test_the_plugin_imports_nothing_private() -> None:
    ours, private = unillm_imports(PLUGIN.rglob("*.py"))
    assert ours, "the plugin should use unillm"
    assert private == [], f"the plugin imports private modules: {private}"


def test_openvino_genai_plugin_tests_pass(site: Path, env: dict[str, str]) -> None:
    plugin_env = {**env, "PYTHONPATH": str(site)}  # the installed copy
    out = run(
        ["-m", "pytest", str(PLUGIN / "tests"), "-q", "-p", "no:cacheprovider", "-rs"],
        plugin_env,
        timeout=400,
    )
    passed = int(re.findall(r"(\d+) passed", out)[-1])
    assert passed >= 51, out  # 17 of them the conformance kit's
    assert not re.search(r"\d+ (failed|error|skipped)", out), out


AUTO = """
import sys, unillm
from unillm.testing import convert_tiny, tiny_model
ir = convert_tiny(tiny_model("small"), "openvino")
for name, info in unillm.backends().items():
    print(f"backend {name} from {info.source}")
from unillm._choose._registry import default_registry
print("failures", default_registry().failures)
with unillm.auto_engine(str(ir)) as e:
    print("chosen", e.name, type(e).__module__, "format", e.selection.format)
    print("explain", e.selection.explain())
    print("ranked", [c.name for c in e.selection.candidates])
    print("text", e.generate("Paris is", max_tokens=4, temperature=0.0).usage.completion_tokens)
"""


def test_it_is_found_through_its_entry_point_and_auto_engine_picks_it(
    site: Path, env: dict[str, str], tmp_path: Path
) -> None:
    # What `pip install` would leave behind: a .dist-info naming the module in the "unillm" group.
    plugin_env = {**env, "PYTHONPATH": str(site)}
    out = run(["-c", AUTO], plugin_env)
    assert "backend openvino-genai from openvino-genai" in out, out
    assert "backend llama.cpp from builtin" in out  # the plugin sits beside the built-ins
    assert "failures []" in out
    # its inspection (unillm_inspect_model) names the IR directory, and its guide entry applies
    assert "chosen openvino-genai unillm_openvino_genai.engine format openvino" in out, out
    assert "OpenVINO IR is OpenVINO's own format" in out, out
    ranked = re.search(r"ranked (\[.*\])", out)
    assert ranked and ranked.group(1).startswith("['openvino-genai'"), out
    assert "text 4" in out
