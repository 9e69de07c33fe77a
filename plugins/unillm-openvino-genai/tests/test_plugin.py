"""The plugin's side of unillm: its hooks, its suitability on each kind of machine and format,
its build probe; none of these loads a model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from unillm_openvino_genai import unillm_guide_entries, unillm_inspect_model, unillm_register_backends
from unillm_openvino_genai.engine import OpenVINOGenAIEngine

import unillm
from unillm import GPU, Hardware, ModelInfo
from unillm.backend import EngineBuild, GuideEntry

INTEL = Hardware(os="linux", arch="x86_64", cpu_model="Intel(R) Xeon(R) Platinum 8480+", cpu_cores=16)
AMD = Hardware(os="linux", arch="x86_64", cpu_model="AMD EPYC 9654", cpu_cores=16)
ARC = Hardware(
    os="linux", arch="x86_64", cpu_model="AMD Ryzen 9", gpus=(GPU(0, "intel", "Intel Arc A770", 16 << 30),)
)


def test_the_hooks_register_the_engine_and_a_guide_entry() -> None:
    got: list[Any] = []
    unillm_register_backends(got.append)
    assert got == [OpenVINOGenAIEngine]
    entries: list[GuideEntry] = []
    unillm_guide_entries(entries.append)
    assert [e.engine for e in entries] == ["openvino-genai"]
    assert entries[0].formats == frozenset({"openvino"}) and entries[0].rank == 0


def test_its_inspection_names_an_ir_dir_openvino_and_nothing_else(ir_dir: Path, tiny: Any) -> None:
    info = unillm_inspect_model(str(ir_dir))
    assert info is not None and info.format == "openvino" and info.path == str(ir_dir)
    assert (info.layers, info.kv_heads, info.head_dim, info.context_length) == (2, 1, 64, 4096)
    assert info.weights_bytes == (ir_dir / "openvino_model.bin").stat().st_size
    assert info.quantization is None  # fp32 export: optimum wrote no openvino_config.json
    for other in (tiny.hf_dir, tiny.gguf_path, tiny.root, ir_dir / "missing"):
        assert unillm_inspect_model(str(other)) is None


def test_its_inspection_reads_the_weight_compression(ir_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "openvino_model.xml").write_text("<net/>")
    (tmp_path / "openvino_config.json").write_text('{"quantization_config": {"bits": 4, "sym": false}}')
    info = unillm_inspect_model(str(tmp_path))
    assert info is not None and info.format == "openvino" and info.quantization == "int4"
    assert info.layers is None and info.weights_bytes is None  # no config.json, no .bin: unknown


@pytest.mark.parametrize(("hardware", "intel"), [(INTEL, True), (ARC, True), (AMD, False), (None, False)])
def test_an_ir_dir_unillm_calls_safetensors_still_outranks_every_built_in(
    ir_dir: Path, hardware: Any, intel: bool
) -> None:
    info = unillm.inspect_model(ir_dir)
    assert info.format == "safetensors"  # unillm reads the IR directory's config.json
    fit = OpenVINOGenAIEngine.suitability(hardware, info, None)
    assert not fit.blockers
    assert fit.score > 3.0  # a built-in's 1.0 plus the guide's largest bonus, 2.0
    assert (fit.score > 3.5) == intel and any("Intel" in r for r in fit.reasons) == intel


def test_its_own_format_name_scores_like_a_built_in_plus_the_guide() -> None:
    fit = OpenVINOGenAIEngine.suitability(INTEL, ModelInfo("/nowhere", "openvino"), None)
    assert not fit.blockers and fit.score == 1.75  # + 2.0 from its rank-0 guide entry


@pytest.mark.parametrize("fmt", ["gguf", "safetensors", "mlx", "awq"])
def test_other_formats_are_declined_with_a_reason(tmp_path: Path, fmt: str) -> None:
    fit = OpenVINOGenAIEngine.suitability(INTEL, ModelInfo(str(tmp_path), fmt), None)
    assert fit.blockers and f"does not read {fmt}" in fit.blockers[0] and "optimum-cli" in fit.blockers[0]


def test_probe_build_reports_the_version_and_openvinos_devices() -> None:
    findings: list[str] = []
    build = OpenVINOGenAIEngine.probe_build(INTEL, findings)
    assert isinstance(build, EngineBuild) and build.name == "openvino-genai"
    assert build.version and build.version.startswith("2026.") and "cpu" in build.devices
    assert findings == []


def test_available_without_importing_openvino() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from unillm_openvino_genai.engine import OpenVINOGenAIEngine as E; "
        "a = E.available(); print(a.available, a.version, 'openvino' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == "True" and out.split()[-1] == "False", out
