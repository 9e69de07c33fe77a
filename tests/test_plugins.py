"""Plugin discovery through real entry points, and broken plugins that must not take unillm down."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import unillm
from unillm import ConfigError, Registry, UnknownBackend, hookimpl
from unillm.testing import MockEngine

GOOD_PLUGIN = """
from typing import ClassVar
from unillm import hookimpl
from unillm.testing import MockEngine


class Shout(MockEngine):
    name: ClassVar[str] = "shout"
    formats: ClassVar[frozenset[str]] = frozenset({"gguf"})

    def __init__(self, config=None, **kw):
        super().__init__(lambda p, s: p.upper(), config, **kw)


@hookimpl
def unillm_register_backends(register):
    register(Shout)
"""


def make_distribution(site: Path, dist: str, module: str, source: str, entry: str | None = None) -> None:
    """Write an installed distribution by hand: a module plus its .dist-info with an entry point."""
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"  # PEP 427 escaping
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[unillm]\n{entry or dist} = {module}\n")


def run_with_site(site: Path, code: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


DISCOVER = """
import json, warnings
import unillm
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    names = list(unillm.backends())
from unillm._choose._registry import default_registry
print(json.dumps({
    "names": names,
    "failures": [[f.plugin, f.reason] for f in default_registry().failures],
    "warnings": [str(w.message) for w in caught],
}))
"""


def test_plugin_is_discovered_through_its_entry_point(tmp_path: Path) -> None:
    make_distribution(tmp_path, "unillm-shout", "unillm_shout", GOOD_PLUGIN, entry="shout")
    result = run_with_site(tmp_path, DISCOVER)
    assert result["names"] == ["llama.cpp", "mlx", "exllamav2", "vllm", "shout"]
    assert result["failures"] == []


def test_plugin_engine_runs_like_a_builtin(tmp_path: Path, tiny_gguf: Path) -> None:
    make_distribution(tmp_path, "unillm-shout", "unillm_shout", GOOD_PLUGIN, entry="shout")
    code = f"""
    import json, unillm
    with unillm.auto_engine({str(tiny_gguf)!r}, backend="shout") as e:
        print(json.dumps({{"text": e.generate("hello world").text, "source": e.selection.chosen_by}}))
    """
    assert run_with_site(tmp_path, code) == {"text": "HELLO WORLD", "source": "config"}


def test_broken_plugins_are_reported_and_skipped(tmp_path: Path) -> None:
    make_distribution(tmp_path, "unillm-shout", "unillm_shout", GOOD_PLUGIN, entry="shout")
    make_distribution(tmp_path, "unillm-broken", "unillm_broken", "import does_not_exist\n", entry="broken")
    raising = """
    from unillm import hookimpl

    @hookimpl
    def unillm_register_backends(register):
        raise RuntimeError("boom")
    """
    make_distribution(tmp_path, "unillm-raises", "unillm_raises", raising, entry="raises")
    result = run_with_site(tmp_path, DISCOVER)
    # the good plugin still works
    assert result["names"] == ["llama.cpp", "mlx", "exllamav2", "vllm", "shout"]
    failures = dict(result["failures"])  # type: ignore[arg-type]
    assert "does_not_exist" in failures["broken"]
    assert "boom" in failures["raises"]
    assert any("broken" in w and "skipped" in w for w in result["warnings"])  # type: ignore[union-attr]


class _Plugin:
    def __init__(self, *classes: type) -> None:
        self.classes = classes

    @hookimpl
    def unillm_register_backends(self, register):  # type: ignore[no-untyped-def]
        for cls in self.classes:
            register(cls)


class Alpha(MockEngine):
    name = "alpha"
    formats = frozenset({"gguf"})


class FakeLlama(MockEngine):
    name = "llama.cpp"


class Ollama(MockEngine):
    name = "Ollama"


def test_fresh_registry_with_a_direct_plugin() -> None:
    reg = Registry(entry_points=False)
    reg.register_plugin(_Plugin(Alpha), name="alpha-plugin")
    assert list(reg.backends()) == ["llama.cpp", "mlx", "exllamav2", "vllm", "alpha"]
    assert reg.backends()["alpha"].source == "alpha-plugin"
    assert reg.get("ALPHA") is Alpha


def test_a_plugin_cannot_take_a_builtin_name_or_register_ollama() -> None:
    reg = Registry(entry_points=False)
    with pytest.warns(unillm.UnillmWarning) as caught:
        reg.register_plugin(_Plugin(FakeLlama, Ollama, object), name="bad")
    assert reg.get("llama.cpp").__module__ == "unillm.engines.llamacpp"
    reasons = " ".join(f.reason for f in reg.failures)
    assert "already registered by builtin" in reasons
    assert "Ollama" in reasons
    assert "takes an Engine subclass" in reasons
    assert len(caught) == 3


def test_unknown_backend_names_the_known_ones() -> None:
    reg = Registry(entry_points=False)
    with pytest.raises(UnknownBackend, match=r"registered backends: llama\.cpp") as err:
        reg.get("exllamav9")
    assert "unillm backends" in str(err.value)


def test_asking_for_ollama_is_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match="does not wrap Ollama"):
        Registry(entry_points=False).get("ollama")


def test_backend_names_are_normalized() -> None:
    reg = Registry(entry_points=False)
    assert reg.get("llamacpp") is reg.get("Llama-CPP") is reg.get("llama.cpp")


def test_backends_report_availability() -> None:
    info = unillm.backends()["llama.cpp"]
    avail = info.availability()
    assert avail.available == (info.cls.available().available)
    if not avail.available:
        assert avail.install_hint and "pip install" in avail.install_hint


# ---- a plugin's own model format (unillm_inspect_model) ----


class Toy(MockEngine):
    name = "toy"
    formats = frozenset({"toy-dir"})

    def __init__(self, config: object = None, **kw: object) -> None:
        super().__init__(lambda p, s: "toy answer", config, **kw)  # type: ignore[arg-type]


class _ToyFormat:
    """Recognizes a directory holding toy.json, which unillm's own inspection cannot read."""

    @hookimpl
    def unillm_register_backends(self, register: object) -> None:
        register(Toy)  # type: ignore[operator]

    @hookimpl
    def unillm_inspect_model(self, path: str) -> unillm.ModelInfo | None:
        toy = Path(path) / "toy.json"
        if not toy.is_file():
            return None
        return unillm.ModelInfo(path, "toy-dir", architecture="toy", context_length=256)


class _Raises:
    @hookimpl
    def unillm_inspect_model(self, path: str) -> None:
        raise RuntimeError("the plugin's parser broke")


class _Junk:
    @hookimpl
    def unillm_inspect_model(self, path: str) -> object:
        return {"format": "toy-dir"}


def test_a_plugin_format_is_inspected_and_selected_by_the_plugin(tmp_path: Path) -> None:
    (tmp_path / "toy.json").write_text("{}")
    reg = Registry(entry_points=False)
    with pytest.raises(unillm.ModelFormatError):  # unillm alone cannot read it
        reg.inspect_model(tmp_path)
    reg.register_plugin(_ToyFormat(), name="toy-plugin")
    info = reg.inspect_model(tmp_path)
    assert (info.format, info.architecture, info.context_length) == ("toy-dir", "toy", 256)
    with unillm.auto_engine(str(tmp_path), registry=reg) as engine:
        assert engine.name == "toy"
        assert (engine.selection.backend, engine.selection.format) == ("toy", "toy-dir")
        assert engine.generate("hi", max_tokens=4).text == "toy answer"


def test_a_broken_inspect_hook_is_a_failure_and_the_builtin_inspection_goes_on(
    tmp_path: Path, tiny_gguf: Path
) -> None:
    reg = Registry(entry_points=False)
    with pytest.warns(unillm.UnillmWarning):
        reg.register_plugin(_Raises(), name="raises")
        reg.register_plugin(_Junk(), name="junk")
        info = reg.inspect_model(tiny_gguf)
    assert info.format == "gguf"  # the built-in inspection answered
    reasons = {f.plugin: f.reason for f in reg.failures}
    assert "the plugin's parser broke" in reasons["raises"]
    assert "not a ModelInfo" in reasons["junk"]
