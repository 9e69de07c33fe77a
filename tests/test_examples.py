"""Every example runs, as a user would run it, and prints what it promises; the tutorial plugin's
own tests pass, and the plugin is found through a real entry point."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from pathlib import Path

import pytest

from ._plugin_util import ROOT, clean_env, fake_install, run

EXAMPLES = ROOT / "examples"
PLUGIN = ROOT / "plugins" / "unillm-reverse"

needs_llamacpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"
)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A clean environment whose UNILLM_CACHE is shared by the module: the tiny model builds once."""
    return clean_env(tmp_path_factory.mktemp("unillm-cache"))


def field(out: str, pattern: str) -> list[str]:
    found = re.findall(pattern, out)
    assert found, f"{pattern!r} not in output:\n{out}"
    return found


@needs_llamacpp
@pytest.mark.llamacpp
def test_quickstart(env: dict[str, str]) -> None:
    out = run([str(EXAMPLES / "quickstart.py")], env)
    assert "backend: llama.cpp (chosen by auto)" in out
    assert re.search(r"\+ llama\.cpp \[builtin\]: GGUF is llama\.cpp's own format; reads gguf", out)
    # the tiny model was built into the module's cache, not the user's
    assert f"model:   {env['UNILLM_CACHE']}" in out
    stream_finish, chat_finish = field(out, r"\nfinish: (\w+)")
    assert stream_finish in ("stop", "length") and chat_finish in ("stop", "length")
    usages = [tuple(map(int, u)) for u in field(out, r"usage: prompt=(\d+) completion=(\d+) cached=(\d+)")]
    assert len(usages) == 3
    (stream_prompt, stream_completion, _), _, (_, _, follow_cached) = usages
    assert stream_prompt > 0 and 0 < stream_completion <= 24
    assert follow_cached > 0  # the follow-up chat turn reused the first turn's prefix
    assert field(out, r"\(source: (\w+)\)") == ["engine"]  # llama.cpp's own counters
    capacity, used = map(int, field(out, r"kv: capacity=(\d+) used=(\d+)")[0])
    assert capacity == 512 and 0 < used <= capacity
    hits, queries = map(int, field(out, r"prefix cache: (\d+) of (\d+) prompt tokens")[0])
    # queries and hits count prompt tokens: the three prompts, and what the follow-up reused
    assert queries == sum(u[0] for u in usages) and hits == sum(u[2] for u in usages) >= follow_cached


@needs_llamacpp
@pytest.mark.llamacpp
def test_quickstart_takes_a_model_path(env: dict[str, str], tmp_path: Path) -> None:
    from unillm.testing import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    out = run([str(EXAMPLES / "quickstart.py"), str(model.gguf_path)], env)
    assert f"model:   {model.gguf_path} (format: gguf)" in out


@needs_llamacpp
@pytest.mark.llamacpp
def test_swap_engine_env_overrides_the_file(env: dict[str, str]) -> None:
    """One variable (UNILLM_BACKEND) moves the same config from llama.cpp to MLX on one directory
    holding both formats; each engine gets its own table's options."""
    out = run([str(EXAMPLES / "swap_engine.py")], env)
    lines = {m[0]: m[1] for m in re.findall(r"^\[([^\]]+)\] (.*)$", out, re.MULTILINE)}
    assert set(lines) == {"file", "UNILLM_BACKEND=mlx", "UNILLM_BACKEND=no-such-engine"}

    from_file = lines["file"]
    assert "ran on backend llama.cpp (chosen by config)" in from_file
    assert re.search(r"model \S+/model,", from_file)  # relative to the TOML file
    assert "options {'n_threads': 1}" in from_file  # the [backend_options."llama.cpp"] table

    swapped = lines["UNILLM_BACKEND=mlx"]
    if importlib.util.find_spec("mlx_lm") is not None:
        assert "ran on backend mlx (chosen by environment)" in swapped
        assert re.search(r"model \S+/model,", swapped)  # the same directory: MLX reads its HF copy
        assert "options {'batch_size': 1}" in swapped  # its own table, not llama.cpp's
        assert swapped.endswith(": 8 tokens") and from_file.endswith(": 8 tokens")
    else:
        assert swapped.startswith("refused: BackendUnavailable:")

    refused = lines["UNILLM_BACKEND=no-such-engine"]
    assert refused.startswith("refused: UnknownBackend:") and "'no-such-engine'" in refused


def test_minimal_plugin(env: dict[str, str]) -> None:
    out = run([str(EXAMPLES / "minimal_plugin.py")], env)
    assert "registered: shout (from shout-example)" in out
    assert "registered: llama.cpp (from builtin)" in out
    assert "stream: THE| QUICK| BROWN| FOX|\n" in out
    assert "chat: HELLO PLUGIN WORLD (finish=stop" in out
    checks = field(out, r"conformance passed: (.*)")[0].split(", ")
    assert {"generate-equals-stream", "stop-strings", "async-mirror", "tokenizer-round-trip"} <= set(checks)


def test_reverse_plugin_tests_pass(env: dict[str, str]) -> None:
    plugin_env = {**env, "PYTHONPATH": str(PLUGIN)}  # importable without installing it
    out = run(["-m", "pytest", str(PLUGIN / "tests"), "-q", "-p", "no:cacheprovider"], plugin_env)
    passed = int(field(out, r"(\d+) passed")[0])
    assert passed >= 8
    assert not re.search(r"\d+ (failed|error)", out), out


def test_reverse_plugin_is_found_through_its_entry_point(env: dict[str, str], tmp_path: Path) -> None:
    # What `pip install` would leave behind: a .dist-info naming the module in the "unillm" group.
    fake_install(tmp_path, "unillm-reverse", "reverse", "unillm_reverse")
    script = (
        "import unillm\n"
        "from unillm._choose._registry import default_registry\n"
        "for name, info in unillm.backends().items():\n"
        "    print(f'backend {name} from {info.source}')\n"
        "print('failures', default_registry().failures)\n"
        "with unillm.backends()['reverse'].cls({'model': '.'}) as engine:\n"
        "    print('reply', engine.generate('one two three').text)\n"
    )
    plugin_env = {**env, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(PLUGIN)])}
    out = run(["-c", script], plugin_env)
    assert "backend reverse from reverse" in out
    assert "backend llama.cpp from builtin" in out  # the plugin sits beside the built-ins
    assert "failures []" in out
    assert "reply three two one" in out


def test_entry_point_discovery_needs_the_dist_info(env: dict[str, str]) -> None:
    # The control for the test above: importable is not registered; the entry point is what counts.
    if any(ep.name == "reverse" for ep in importlib.metadata.entry_points(group="unillm")):
        pytest.skip("unillm-reverse is installed in this environment")
    out = run(["-c", "import unillm; print(sorted(unillm.backends()))"], {**env, "PYTHONPATH": str(PLUGIN)})
    assert "'reverse'" not in out
    assert "'llama.cpp'" in out
