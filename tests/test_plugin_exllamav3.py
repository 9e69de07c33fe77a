"""The exllamav3 plugin's own tests pass (against its fake of exllamav3's API: the real one needs
CUDA at import), it imports no private unillm module, and it is found through a real entry point
beside the built-ins: `unillm select` and `auto_engine` pick it for an EXL3 directory on an NVIDIA
machine (a hardware profile), with no change to unillm."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from unillm.testing import TinyModel

from ._plugin_util import ROOT, clean_env, pip_install, run, unillm_imports

PLUGIN = ROOT / "plugins" / "unillm-exllamav3"
FAKE = PLUGIN / "tests" / "fake_exllamav3"
FOUR_4090 = ROOT / "tests" / "profiles" / "rtx4090-4x-pcie.json"
LAPTOP = ROOT / "tests" / "profiles" / "laptop-8gb-cpu.json"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return clean_env(tmp_path_factory.mktemp("unillm-cache"))


@pytest.fixture(scope="module")
def exl3_dir(tiny: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as exllamav3's converter leaves it: an EXL3 quantization_config (the fake
    reads only the weights' size)."""
    where = tmp_path_factory.mktemp("exl3") / "tiny-exl3"
    shutil.copytree(tiny.hf_dir, where)
    cfg = json.loads((where / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "exl3", "version": "1.6.5", "bits": 4.0, "head_bits": 6}
    (where / "config.json").write_text(json.dumps(cfg))
    return where


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin installed by pip from its directory (code and real .dist-info, no
    dependencies): the tests below run that copy, beside the fake exllamav3."""
    return pip_install(PLUGIN, tmp_path_factory.mktemp("site"))


def test_exllamav3_plugin_tests_pass(env: dict[str, str], site: Path) -> None:
    plugin_env = {**env, "PYTHONPATH": os.pathsep.join([str(site), str(FAKE)])}
    out = run(
        ["-m", "pytest", str(PLUGIN / "tests"), "-q", "-p", "no:cacheprovider"], plugin_env, timeout=300
    )
    passed = int(re.findall(r"(\d+) passed", out)[-1])
    assert passed >= 63, out
    assert not re.search(r"\d+ (failed|error)", out), out
    # the one skip: the conformance kit's parity check, which needs a reference engine on the
    # same weights (the fake's toy model is not the tiny model's; gpu_check_exllamav3.py does it)
    assert re.findall(r"(\d+) skipped", out) in ([], ["1"]), out


def test_the_plugin_imports_nothing_private() -> None:
    ours, private = unillm_imports(
        [*(PLUGIN / "unillm_exllamav3").rglob("*.py"), *(PLUGIN / "tests").glob("*.py")]
    )
    assert ours, "the plugin should use unillm"
    assert private == [], f"the plugin imports private modules: {private}"


def test_found_through_its_entry_point_beside_the_built_ins(env: dict[str, str], site: Path) -> None:
    script = (
        "import unillm\n"
        "from unillm._choose._registry import default_registry\n"
        "for name, info in unillm.backends().items():\n"
        "    print(f'backend {name} from {info.source}')\n"
        "print('failures', default_registry().failures)\n"
        "print('guide', [e.reason for e in default_registry().guide() if e.engine == 'exllamav3'])\n"
        "print('available', unillm.backends()['exllamav3'].availability())\n"
    )
    out = run(["-c", script], {**env, "PYTHONPATH": str(site)})
    assert "backend exllamav3 from exllamav3" in out
    assert "backend exllamav2 from builtin" in out and "backend llama.cpp from builtin" in out
    assert "failures []" in out
    assert "EXL3 is ExLlamaV3's format" in out and "2-4 NVIDIA GPUs, local use" in out  # core's and its own
    # this machine: no NVIDIA GPU (and no exllamav3), said with the reason and the install hint
    assert "available=False" in out and "pip install unillm-exllamav3 exllamav3" in out


def test_unillm_select_picks_it_for_exl3_on_nvidia_gpus(
    env: dict[str, str], site: Path, exl3_dir: Path
) -> None:
    script = (
        "import json, sys\n"
        "from typer.testing import CliRunner\n"
        "from unillm.cli import app\n"
        "r = CliRunner().invoke(app, ['select', sys.argv[1], '--hardware', sys.argv[2], '--explain'])\n"
        "print(json.dumps({'code': r.exit_code, 'out': r.output}))\n"
    )
    paths = str(site)
    for profile, picked in ((FOUR_4090, True), (LAPTOP, False)):
        got = json.loads(run(["-c", script, str(exl3_dir), str(profile)], {**env, "PYTHONPATH": paths}))
        out = str(got["out"])
        if picked:
            assert got["code"] == 0, out
            assert "backend: exllamav3 (chosen by auto)" in out, out
            line = next(line for line in out.splitlines() if "exllamav3 [exllamav3]" in line)
            assert line.strip().startswith("+") and "across 4 NVIDIA GPUs" in line, out
        else:  # a CPU laptop: nothing can run EXL3, and exllamav3 says why
            line = next(line for line in out.splitlines() if "exllamav3 [exllamav3]" in line)
            assert line.strip().startswith("-") and "needs an NVIDIA (CUDA) GPU" in line, out


def test_auto_engine_loads_it_for_exl3_on_a_faked_nvidia_machine(
    env: dict[str, str], site: Path, exl3_dir: Path
) -> None:
    script = (
        "import sys, unillm\n"
        "from unillm import load_hardware\nfrom unillm._choose import _auto\n"
        "_auto._machine = lambda: load_hardware(sys.argv[2])  # the machine auto_engine sees\n"
        "with unillm.auto_engine(sys.argv[1], context_length=512) as e:\n"
        "    print('picked', e.name, type(e).__module__)\n"
        "    print('text', repr(e.generate('The quick brown fox', max_tokens=8, temperature=0).text))\n"
        "    print(e.selection.explain())\n"
    )
    plugin_env = {
        **env,
        "PYTHONPATH": os.pathsep.join([str(site), str(FAKE)]),
        "UNILLM_EXLLAMAV3_ASSUME_GPU": "1",  # the GPU the fake exllamav3 simulates
    }
    out = run(["-c", script, str(exl3_dir), str(FOUR_4090)], plugin_env)
    assert "picked exllamav3 unillm_exllamav3.engine" in out, out
    assert "text ''" not in out
    assert "EXL3 is ExLlamaV3's format" in out, out


def test_the_gpu_check_script_passes_against_the_fake(
    env: dict[str, str], tiny: TinyModel, tmp_path: Path
) -> None:
    # scripts/gpu_check_exllamav3.py, which scripts/gpu_check.sh runs on a GPU, here against the
    # fake (its converter included), with steps that take time so that requests meet in batches
    plugin_env = {
        **env,
        "PYTHONPATH": os.pathsep.join([str(PLUGIN), str(FAKE)]),
        "UNILLM_EXLLAMAV3_ASSUME_GPU": "1",
        "FAKE_EXLLAMAV3_STEP_SECONDS": "0.002",
    }
    script = str(ROOT / "scripts" / "gpu_check_exllamav3.py")
    out = run([script, str(tiny.hf_dir), "--work", str(tmp_path)], plugin_env, timeout=200)
    assert "all checks passed" in out, out
    assert "EXL3 4.0 bpw, converted here" in out and "3/3 prompts" in out, out
    assert "streams {1: 1, 2: 2, 8: 8}" in out, out  # the fake counts as exllamav3 1.6.5's Job does
