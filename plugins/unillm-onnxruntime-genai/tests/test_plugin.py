"""The plugin's hooks, its answers to the selector and to `unillm doctor`."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

import pluggy
import unillm_onnxruntime_genai
from unillm_onnxruntime_genai.engine import OnnxGenAIEngine

import unillm
from unillm.backend import EngineBuild, GuideEntry
from unillm.testing import TinyModel


def test_the_hooks_register_the_engine_and_its_guide_entries() -> None:
    pm = pluggy.PluginManager("unillm")
    pm.register(unillm_onnxruntime_genai)
    classes: list[type] = []
    entries: list[GuideEntry] = []
    pm.hook.unillm_register_backends(register=classes.append)
    pm.hook.unillm_guide_entries(add=entries.append)
    assert classes == [OnnxGenAIEngine]
    assert {e.engine for e in entries} == {"onnxruntime-genai"}
    assert any(e.machines and "cpu" in e.machines and e.workload == "local" for e in entries)


def test_importing_the_plugin_imports_no_engine() -> None:
    import subprocess
    import sys

    code = (
        "import sys, unillm_onnxruntime_genai\n"
        "print('onnxruntime_genai' in sys.modules, 'numpy' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": ":".join(sys.path)},
    )
    assert out.stdout.split() == ["False", "False"]


@dataclass(frozen=True)
class _Model:
    path: str
    format: str


def test_suitability_reads_genai_model_directories_and_declines_the_rest(
    onnx_dir: Path, tiny: TinyModel
) -> None:
    ours = OnnxGenAIEngine.suitability(None, _Model(str(onnx_dir), "unknown"), None)
    assert ours.score == 3.5 and not ours.blockers and "genai_config.json" in ours.reasons[0]
    named = OnnxGenAIEngine.suitability(None, _Model(str(onnx_dir), "onnx-genai"), None)
    assert named.score == 1.5  # where unillm names the format, the guide's entries give the bonus
    for path, fmt in [(tiny.gguf_path, "gguf"), (tiny.hf_dir, "safetensors")]:
        no = OnnxGenAIEngine.suitability(None, _Model(str(path), fmt), None)
        assert (
            no.score == 0.0
            and f"does not read {fmt}" in no.blockers[0]
            and "models.builder" in no.blockers[0]
        )
    # what unillm's own inspector says of the GGUF, through the public ModelInfo
    no = OnnxGenAIEngine.suitability(None, unillm.inspect_model(tiny.gguf_path), None)
    assert no.blockers


def test_probe_build_reports_the_installed_wheel() -> None:
    findings: list[str] = []
    build = OnnxGenAIEngine.probe_build(None, findings)
    assert isinstance(build, EngineBuild)
    assert build.name == "onnxruntime-genai"
    assert build.version == importlib.metadata.version("onnxruntime-genai")
    assert build.devices[0] == "cpu"
    avail = OnnxGenAIEngine.available()
    assert avail.available and avail.version == build.version
