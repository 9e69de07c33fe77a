"""The onnxruntime-genai plugin's own tests pass (on the tiny model converted by ONNX Runtime
GenAI's builder in the converters' environment), it is written against public names only, and it
is found through a real entry point, beside the built-ins, without any change to unillm."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shutil
from pathlib import Path

import pytest

from unillm.testing import convert_tiny, tiny_model

from ._plugin_util import ROOT, clean_env, pip_install, run, unillm_imports

PLUGIN = ROOT / "plugins" / "unillm-onnxruntime-genai"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin installed by pip from its directory (its code and real .dist-info, as CI and a
    user get it); the tests below run that copy, never the source tree."""
    return pip_install(PLUGIN, tmp_path_factory.mktemp("site"))


pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("onnxruntime_genai") is None, reason="needs onnxruntime-genai"
)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, converter_python: str) -> dict[str, str]:
    clean = clean_env(tmp_path_factory.mktemp("unillm-cache"))
    # The tiny model and its conversion (~11 s of the builder, more on a busy machine) are kept
    # inside the converters' environment (not resolved: the venv's python links to the base
    # interpreter), rebuilt with it; the conversion is keyed by the weights' digest and the
    # converter's version, so a later run reuses it only when nothing changed.
    cache = Path(converter_python).parent.parent / "unillm-cache"
    return {**clean, "UNILLM_CACHE": str(cache), "UNILLM_CONVERTER_PYTHON": converter_python}


@pytest.fixture(scope="module")
def onnx_dir(env: dict[str, str], converter_python: str) -> Path:
    # built and converted into the subprocesses' cache, so the plugin's own tests find both there
    tiny = tiny_model("small", cache_dir=env["UNILLM_CACHE"])
    return convert_tiny(tiny, "onnxruntime-genai", python=converter_python)


def test_the_plugin_imports_nothing_private() -> None:
    ours, private = unillm_imports(PLUGIN.rglob("*.py"))
    assert {"unillm", "unillm.backend", "unillm.testing"} <= set(ours)
    assert private == [], f"the plugin imports private modules: {private}"


def test_onnxruntime_genai_plugin_tests_pass(site: Path, env: dict[str, str], onnx_dir: Path) -> None:
    plugin_env = {**env, "PYTHONPATH": str(site)}  # the installed copy
    out = run(
        ["-m", "pytest", str(PLUGIN / "tests"), "-q", "-p", "no:cacheprovider", "-rs"],
        plugin_env,
        timeout=400,
    )
    passed = int(re.findall(r"(\d+) passed", out)[-1])
    skipped = re.findall(r"(\d+) skipped", out)
    # 57 with llama-cpp-python here (three parity tests compare with it); 54 without
    assert passed >= 54, out
    if importlib.util.find_spec("llama_cpp") is not None:
        assert passed >= 57 and not skipped, out
    assert not re.search(r"\d+ (failed|error)", out), out


APP = """
import sys, unillm
from unillm._choose._registry import default_registry
for name, info in unillm.backends().items():
    print(f"backend {name} from {info.source}")
print("failures", default_registry().failures)
with unillm.auto_engine(sys.argv[1]) as e:
    out = e.generate("The quick brown fox", temperature=0.0, max_tokens=5)
    print("picked", e.name, "by", e.selection.chosen_by, out.usage.completion_tokens, out.finish_reason)
"""


def test_it_is_found_through_its_entry_point_and_unillm_backend_picks_it(
    site: Path, env: dict[str, str], onnx_dir: Path, tmp_path: Path
) -> None:
    # What `pip install` would leave behind: a .dist-info naming the module in the "unillm" group.
    plugin_env = {
        **env,
        "PYTHONPATH": str(site),
        "UNILLM_BACKEND": "onnxruntime-genai",  # the application's code is the same for every engine
    }
    out = run(["-c", APP, str(onnx_dir)], plugin_env)
    assert "backend onnxruntime-genai from onnxruntime-genai" in out
    assert "backend llama.cpp from builtin" in out  # the plugin sits beside the built-ins
    assert "failures []" in out
    assert "picked onnxruntime-genai by environment 5 length" in out


AUTO = """
import sys, unillm
with unillm.auto_engine(sys.argv[1]) as e:
    out = e.generate("The quick brown fox", temperature=0.0, max_tokens=5)
    print("picked", e.name, "by", e.selection.chosen_by, out.usage.completion_tokens, out.finish_reason)
    print("format", e.selection.format)
    print(e.selection.explain())
"""


def test_auto_engine_picks_it_for_a_genai_model_directory(
    site: Path, env: dict[str, str], onnx_dir: Path, tmp_path: Path
) -> None:
    plugin_env = {**env, "PYTHONPATH": str(site)}
    out = run(["-c", AUTO, str(onnx_dir)], plugin_env)
    # its unillm_inspect_model names the directory's format, which only it reads
    assert "picked onnxruntime-genai by auto 5 length" in out, out
    assert "format onnx-genai" in out, out
    assert "app deployment on CPUs" in out, out  # its guide entry, on this CPU machine
    assert re.search(r"- llama\.cpp \[builtin\].*does not read onnx-genai", out), out


def test_auto_engine_picks_it_where_the_directory_also_holds_config_json(
    site: Path, env: dict[str, str], onnx_dir: Path, tmp_path: Path
) -> None:
    # Hugging Face's ONNX repos ship the HF config.json beside genai_config.json: the plugin's
    # inspection still names it, before unillm's would read it as HF weights (none there)
    model = tmp_path / "model"
    shutil.copytree(onnx_dir, model)
    shutil.copy(tiny_model("small", cache_dir=env["UNILLM_CACHE"]).hf_dir / "config.json", model)
    plugin_env = {**env, "PYTHONPATH": str(site)}
    out = run(["-c", AUTO, str(model)], plugin_env)
    assert "picked onnxruntime-genai by auto 5 length" in out, out
