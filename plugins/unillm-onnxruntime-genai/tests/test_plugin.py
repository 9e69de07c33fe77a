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
    assert all(e.formats == frozenset({"onnx-genai"}) and e.rank == 0 for e in entries)
    assert any(e.machines == frozenset({"cpu"}) and "app deployment" in e.reason for e in entries)
    assert any(e.machines is None and "DirectML" in e.reason for e in entries)


def test_its_inspection_names_genai_directories_only(onnx_dir: Path, tiny: TinyModel, tmp_path: Path) -> None:
    info = unillm_onnxruntime_genai.unillm_inspect_model(str(onnx_dir))
    assert isinstance(info, unillm.ModelInfo) and info.format == "onnx-genai"
    assert (info.architecture, info.layers, info.kv_heads, info.head_dim) == ("llama", 2, 1, 64)
    assert (info.context_length, info.vocab_size, info.hidden_size, info.heads) == (4096, 512, 128, 2)
    size = (onnx_dir / "model.onnx").stat().st_size + (onnx_dir / "model.onnx.data").stat().st_size
    assert info.weights_bytes == size
    for other in (tiny.hf_dir, tiny.gguf_path, tiny.root, tmp_path / "nowhere"):
        assert unillm_onnxruntime_genai.unillm_inspect_model(str(other)) is None
    (tmp_path / "genai_config.json").write_text("[1, 2")  # still its format: load says what is wrong
    assert unillm_onnxruntime_genai.unillm_inspect_model(str(tmp_path)) == unillm.ModelInfo(
        str(tmp_path), "onnx-genai"
    )


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
