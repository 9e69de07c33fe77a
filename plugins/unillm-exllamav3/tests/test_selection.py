"""What the selector and ``auto_engine`` ask the plugin: suitability (EXL3 on NVIDIA GPUs), its
guide entry, its fallback steps on out-of-memory, its build probe, and that it is written
against unillm's public names only."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import unillm_exllamav3
from unillm_exllamav3.engine import ExLlamaV3Engine

import unillm
from unillm import GPU, Hardware, Registry, Workload, inspect_model, select
from unillm.backend import Cost, EngineConfig, Facts

PACKAGE = Path(unillm_exllamav3.__file__).parent
TESTS = Path(__file__).parent


def rtx4090(i: int) -> GPU:
    return GPU(i, "nvidia", "NVIDIA GeForce RTX 4090", 24 * 2**30, 23 * 2**30, "8.9", 1008.0, "table", 4)


def machine(gpus: tuple[GPU, ...]) -> Hardware:
    return Hardware("Linux", "x86_64", "AMD Ryzen 9", 32, (), 128 * 2**30, 120 * 2**30, gpus=gpus)


FOUR_4090 = machine(tuple(rtx4090(i) for i in range(4)))
ONE_4090 = machine((rtx4090(0),))
CPU_ONLY = machine(())
MI300 = machine((GPU(0, "amd", "AMD Instinct MI300X", 192 * 2**30, None, "gfx942"),))


def registry() -> Registry:
    reg = Registry(entry_points=False)
    reg.register_plugin(unillm_exllamav3, name="exllamav3")
    return reg


def ranked(hw: Hardware, path: Path, users: int = 1) -> Any:
    reg = registry()
    return select(
        hw, inspect_model(str(path)), Workload(concurrency=users), reg.backends(), guide_entries=reg.guide()
    )


def test_the_plugin_imports_nothing_private() -> None:
    imported: list[str] = []
    for path in [*PACKAGE.rglob("*.py"), *TESTS.glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.append(node.module)
    ours = [m for m in imported if m.split(".")[0] == "unillm"]
    assert ours, "the plugin should use unillm"
    private = [m for m in ours if any(part.startswith("_") for part in m.split("."))]
    assert private == [], f"the plugin imports private modules: {private}"


@pytest.mark.parametrize("hw", [FOUR_4090, ONE_4090], ids=["4x4090", "1x4090"])
def test_exl3_on_nvidia_gpus_picks_exllamav3(hw: Hardware, exl3_dir: Path) -> None:
    s = ranked(hw, exl3_dir)
    first = s.candidates[0]
    assert first.name == "exllamav3" and first.eligible, s.explain()
    text = " ".join(first.reasons)
    assert "EXL3" in text
    if hw is FOUR_4090:
        assert "across 4 NVIDIA GPUs" in text
    # nothing else reads EXL3
    assert [c.name for c in s.candidates if c.eligible] == ["exllamav3"]


@pytest.mark.parametrize(
    ("hw", "why"),
    [(CPU_ONLY, "needs an NVIDIA (CUDA) GPU"), (MI300, "NVIDIA (CUDA) GPUs only")],
    ids=["cpu", "amd"],
)
def test_without_an_nvidia_gpu_it_is_declined_with_the_reason(hw: Hardware, why: str, exl3_dir: Path) -> None:
    fit = ExLlamaV3Engine.suitability(hw, inspect_model(str(exl3_dir)), Workload())
    assert fit.blockers and why in fit.blockers[0]
    s = ranked(hw, exl3_dir)
    ours = next(c for c in s.candidates if c.name == "exllamav3")
    assert not ours.eligible and any(why in b for b in ours.blockers)


def test_plain_safetensors_are_read_but_left_to_the_built_ins(tiny: Any) -> None:
    fit = ExLlamaV3Engine.suitability(ONE_4090, inspect_model(str(tiny.hf_dir)), Workload())
    assert not fit.blockers and fit.score < 1.0
    s = ranked(ONE_4090, tiny.hf_dir)
    assert s.candidates[0].name != "exllamav3"


def test_other_formats_are_blocked(tiny: Any) -> None:
    fit = ExLlamaV3Engine.suitability(ONE_4090, inspect_model(str(tiny.gguf_path)), Workload())
    assert fit.blockers and "does not read gguf" in fit.blockers[0]


def test_the_guide_entry_is_consistent_with_the_cores() -> None:
    core = [e for e in registry().guide() if e.engine == "exllamav3"]
    assert any(e.formats == frozenset({"exl3"}) and e.machines is None for e in core)  # the core's line
    ours = unillm_exllamav3.GUIDE_ENTRIES
    assert all(e.engine == ExLlamaV3Engine.name and e.formats == frozenset({"exl3"}) for e in ours)
    assert all(e in core for e in ours)  # accepted by the registry
    # on 2-4 NVIDIA GPUs it ties with the core's line (rank 0, the same bonus), listed first


def test_fallbacks_quantize_the_cache_then_halve_the_batch_then_shorten_the_context(exl3_dir: Path) -> None:
    config = EngineConfig(model=str(exl3_dir), context_length=8192)
    steps = ExLlamaV3Engine.fallbacks(config, Facts(str(exl3_dir)))
    # as auto_engine tries them, after the free step (down to the trained context of 2048)
    ordered = [s.label for s in sorted(steps, key=lambda s: s.cost) if s.cost > Cost.FREE]
    assert ordered[:3] == ["cache_type=q8", "cache_type=q4", "max_batch_size=4"]
    assert ordered[3:] and all("context" in label for label in ordered[3:])
    q4 = EngineConfig(
        model=str(exl3_dir), backend_options={"exllamav3": {"cache_type": "q4", "cache_size": 4096}}
    )
    assert ExLlamaV3Engine.fallbacks(q4, Facts(str(exl3_dir))) == []


def test_auto_engine_walks_down_the_fallbacks_on_out_of_memory(exl3_dir: Path, fake: Any) -> None:
    # room for the weights and a Q8 cache of 8 x 2048 tokens, not for the FP16 one
    fake.GPU_MEMORY[0] = fake._used.get(0, 0) + 8 * 2**20
    with pytest.warns(unillm.UnillmWarning, match="selector sees a problem"):  # this machine: no GPU
        e = unillm.auto_engine(exl3_dir, backend="exllamav3", context_length=2048, registry=registry())
    with e:
        steps = "\n".join(e.selection.steps)
        assert "exllamav3: out of memory" in steps and "retrying with cache_type=q8" in steps
        assert e.kv_stats().dtype == "q8" and e.context_length == 2048


def test_capabilities_follow_the_batch_size() -> None:
    opts = ExLlamaV3Engine.Options
    assert ExLlamaV3Engine.capabilities_for(opts()).batching
    assert not ExLlamaV3Engine.capabilities_for(opts(max_batch_size=1)).batching
    caps = ExLlamaV3Engine.capabilities
    assert {"top_k", "min_p", "logit_bias", "min_tokens", "logprobs", "response_format"} <= caps.sampling


def test_probe_build_reports_the_install_without_importing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    found: list[str] = []
    build = ExLlamaV3Engine.probe_build(CPU_ONLY, found)
    assert build is not None and build.name == "exllamav3" and build.devices == ("cuda",)
    assert found and "no NVIDIA GPU" in found[0] and "compiles CUDA code" in found[0]
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    found = []
    ExLlamaV3Engine.probe_build(FOUR_4090, found)
    assert found and "nvcc" in found[0]
    assert not any("triton" in f for f in found)
    import unillm_exllamav3.engine as mod

    real = mod.find_spec
    monkeypatch.setattr(mod, "find_spec", lambda name: None if name == "triton" else real(name))
    found = []
    ExLlamaV3Engine.probe_build(FOUR_4090, found)
    assert any("triton is not" in f for f in found)  # exllamav3 1.6 does not import without it
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "fake_exllamav3" not in p])
    monkeypatch.delitem(sys.modules, "exllamav3", raising=False)
    assert ExLlamaV3Engine.probe_build(FOUR_4090, []) is None


def test_the_readme_options_table_matches_the_model() -> None:
    import re

    readme = Path(__file__).resolve().parent.parent / "README.md"  # the source tree, installed or not
    text = readme.read_text(encoding="utf-8").split("\n## Options\n", 1)[1]
    rows = [
        [c.strip() for c in line.strip().split("|")[1:-1]]
        for line in text.splitlines()
        if line.startswith("| `")
    ]
    fields = ExLlamaV3Engine.Options.model_fields
    assert [row[0].strip("`") for row in rows] == list(fields)  # same names, same order
    for name, default, _ in rows:
        assert ast.literal_eval(default.strip("`")) == fields[name.strip("`")].default, name
        assert re.fullmatch(r"`[^`]+`", name)
