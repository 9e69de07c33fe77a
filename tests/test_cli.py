"""The `unillm` command line, run in-process through typer's runner (and as a real process where a
terminal or the exit status of the script matters)."""

from __future__ import annotations

import builtins
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import unillm
from unillm._choose._doctor import with_engine_builds
from unillm.cli import app
from unillm.testing import MockEngine, TinyModel

from .conftest import HAS_LLAMA_CPP, needs_llama_cpp

runner = CliRunner()
PROFILES = Path(__file__).parent / "profiles"


def test_backends_and_doctor() -> None:
    out = runner.invoke(app, ["backends"])
    assert out.exit_code == 0 and "llama.cpp" in out.output and "gguf" in out.output
    doc = runner.invoke(app, ["doctor"])
    assert doc.exit_code == 0 and "python" in doc.output and "memory" in doc.output


class Probed(MockEngine):
    name = "probed"

    @classmethod
    def probe_build(cls, hardware: Any, findings: list[str]) -> Any:
        findings.append("probed is built without its accelerator")
        from unillm.backend import EngineBuild

        return EngineBuild("probed", "9.9", ("cpu",))


class Broken(MockEngine):
    name = "broken"

    @classmethod
    def probe_build(cls, hardware: Any, findings: list[str]) -> Any:
        raise RuntimeError("probe kaboom")


def test_doctor_reports_the_builds_the_backends_report(monkeypatch: pytest.MonkeyPatch) -> None:
    from unillm._choose import _registry as _plugins

    reg = _plugins.Registry(builtins=False, entry_points=False)
    reg.register_backend(Probed)
    reg.register_backend(Broken)
    monkeypatch.setattr(_plugins, "_default", reg)
    doc = runner.invoke(app, ["doctor"])
    assert doc.exit_code == 0, doc.output
    assert "engine   probed 9.9 (cpu)" in doc.output
    assert "finding  probed is built without its accelerator" in doc.output
    assert "probe kaboom" in doc.output
    data = json.loads(runner.invoke(app, ["doctor", "--json"]).output)
    assert data["hardware"]["engines"] == [{"name": "probed", "version": "9.9", "devices": ["cpu"]}]
    assert "probed is built without its accelerator" in data["hardware"]["findings"]


def test_version() -> None:
    out = runner.invoke(app, ["--version"])
    assert out.exit_code == 0 and out.output.strip() == f"unillm {unillm.__version__}"


def test_backends_json() -> None:
    out = runner.invoke(app, ["backends", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    row = data["backends"]["llama.cpp"]
    assert row["source"] == "builtin" and row["formats"] == ["gguf"]
    assert isinstance(row["available"], bool) and "install_hint" in row
    assert data["plugin_failures"] == []


def test_install_hints_keep_their_brackets(monkeypatch: pytest.MonkeyPatch) -> None:
    """`unillm[exllamav2]` is an extra, not rich markup: the command must print it whole."""
    monkeypatch.setenv("UNILLM_EXLLAMAV2_ASSUME_GPU", "0")
    monkeypatch.setenv("COLUMNS", "400")  # one line per row
    out = runner.invoke(app, ["backends"])
    assert out.exit_code == 0
    assert "pip install 'unillm[exllamav2]'" in out.output


def test_tables_print_whole_when_piped() -> None:
    """Piped (no terminal, no COLUMNS), each row of `unillm backends` is one line, however long;
    the capability table says what a default load does: MLX batches (batch_size 8), llama.cpp not
    until parallel or the concurrency is above 1."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["UNILLM_EXLLAMAV2_ASSUME_GPU"] = "0"
    proc = subprocess.run([sys.executable, "-m", "unillm", "backends"], capture_output=True, text=True,
                          env=env, timeout=120, check=True)  # fmt: skip
    rows = [line for line in proc.stdout.splitlines() if line.startswith("│ ")]
    first = {line.split("│")[1].strip(): line for line in reversed(rows)}  # the first table's rows
    assert "pip install 'unillm[exllamav2]'" in first["exllamav2"]  # the whole hint on its row
    assert "awq" in first["vllm"] and "safetensors" in first["vllm"]
    argv = [sys.executable, "-m", "unillm", "backends", "--json"]
    listed = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=True)
    caps = json.loads(listed.stdout)["backends"]
    assert (
        caps["mlx"]["capabilities"]["batching"] is True
        and caps["llama.cpp"]["capabilities"]["batching"] is False
    )


def test_build_tiny(tmp_path: Path) -> None:
    out = runner.invoke(app, ["testing", "build-tiny", str(tmp_path), "--size", "small"])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "hf" / "config.json").is_file()
    assert (tmp_path / "tiny-small-f32.gguf").is_file()


def test_generate_error_is_readable(tmp_path: Path) -> None:
    out = runner.invoke(app, ["generate", str(tmp_path / "absent.gguf"), "hi"])
    assert out.exit_code == 2
    assert "ModelNotFound" in out.output and "never downloads" in out.output


# -- bad input: a typed error on stderr, exit status 2, never a traceback ----------------------


def _profile(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["select", "{hf}", "--goal", "bogus"],
            "unknown goal 'bogus'; use one of latency, throughput, cost, portability",
        ),
        (["plan", "{hf}", "--goal", "fast"], "use one of latency, throughput"),
        (
            ["testing", "build-tiny", "{tmp}", "--size", "huge"],
            "unknown size 'huge'; choose one of small, bench",
        ),
        (["demo", "--size", "huge"], "unknown size 'huge'; choose one of small, bench"),
        (
            ["select", "{hf}", "--hardware", "{typo}"],
            "unknown key 'ram_gb' in the profile; the keys are os, arch",
        ),
        (["select", "{hf}", "--concurrency", "0"], "--concurrency must be at least 1"),
        (["select", "{hf}", "--concurrency", "-3"], "--concurrency must be at least 1"),
        (["plan", "{hf}", "--context", "-5"], "--context must be a positive number of tokens, not -5"),
        (["plan", "{hf}", "--hardware", "{tmp}/absent.json"], "hardware profile not found"),
        (["plan", "{hf}", "--hardware", "{tmp}"], "cannot be read: Is a directory"),
        (
            ["plan", "{hf}", "--hardware", "{gpu_typo}"],
            "unknown key 'mem' in gpus[0]; the keys are index, vendor",
        ),
        (["inspect", "{tmp}/absent.gguf"], "ModelNotFound: model not found"),
        (["plan", "{tmp}/absent.gguf"], "ModelNotFound: model not found"),
        (["select", "{tmp}/absent"], "ModelNotFound: model not found"),
        (["chat", "{tmp}/absent.gguf", "-m", "hi"], "ModelNotFound: model not found"),
        (["inspect", "{long}"], "too long"),
        (["generate", "{hf}"], "give MODEL and PROMPT"),
        (
            ["generate", "{hf}", "hi", "--option", "n_threads"],
            "--option takes KEY=VALUE, e.g. --option n_threads=4",
        ),
        (["generate", "hi", "--config", "{tmp}/absent.toml"], "config file not found"),
        (["generate", "{hf}", "hi", "--max-tokens", "0"], "max_tokens: Input should be greater than"),
        (["chat", "{hf}", "--temperature", "-1"], "temperature: Input should be greater than"),
        (["chat", "--config", "{tmp}"], "is not a .toml config file"),
        (["inspect", "{tmp}/[bold]x[/bold].gguf"], "[bold]x[/bold].gguf"),  # printed literally
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_bad_input_is_a_typed_error(tmp_path: Path, tiny: TinyModel, argv: list[str], expected: str) -> None:
    values = {
        "hf": str(tiny.hf_dir),
        "tmp": str(tmp_path),
        "typo": _profile(tmp_path, "typo.json", '{"os": "Linux", "arch": "x86_64", "ram_gb": 8}'),
        "gpu_typo": _profile(tmp_path, "gpu.json", '{"os": "Linux", "arch": "x86_64", "gpus": [{"mem": 1}]}'),
        "long": "x" * 5000,
    }
    out = runner.invoke(app, [a.format(**values) if "{" in a else a for a in argv])
    assert out.exit_code == 2, out.output
    assert expected in out.output
    assert out.output.startswith("error: ") and "Traceback" not in out.output
    assert out.stdout == ""  # errors go to stderr
    assert out.output.count("error: ") == 1  # one message


def test_plan_that_does_not_fit_exits_1(tiny: TinyModel) -> None:
    laptop = str(PROFILES / "laptop-8gb-cpu.json")
    out = runner.invoke(app, ["plan", str(tiny.hf_dir), "--hardware", laptop, "--context", "4096"])
    assert out.exit_code == 0 and "fits" in out.output
    huge = runner.invoke(app, ["plan", str(tiny.hf_dir), "--hardware", laptop, "--context", "100000000"])
    assert huge.exit_code == 1 and "does NOT fit" in huge.output
    as_json = runner.invoke(
        app, ["plan", str(tiny.hf_dir), "--hardware", laptop, "--context", "100000000", "--json"]
    )
    assert as_json.exit_code == 1 and json.loads(as_json.stdout)["fits"] is False
    assert "Exit status: 0 when it fits, 1 when it does not, 2 on bad input" in runner.invoke(
        app, ["plan", "--help"]
    ).output.replace("\n", " ").replace("  ", " ")


def test_doctor_json() -> None:
    out = runner.invoke(app, ["doctor", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["hardware"]["cpu_cores"] >= 1 and data["hardware"]["ram_total_bytes"] > 0
    assert "llama.cpp" in data["backends"]


def test_inspect_plan_select(tiny: TinyModel) -> None:
    gguf = str(tiny.gguf_path)
    out = runner.invoke(app, ["inspect", gguf])
    assert out.exit_code == 0, out.output
    assert "llama" in out.output and "F32" in out.output and "kv bytes/token" in out.output
    info = json.loads(runner.invoke(app, ["inspect", gguf, "--json"]).output)
    assert info["format"] == "gguf" and info["layers"] == 2
    planned = runner.invoke(app, ["plan", gguf, "--context", "4096"])
    assert planned.exit_code == 0, planned.output
    assert "fits" in planned.output and "kv cache" in planned.output
    chosen = runner.invoke(app, ["select", gguf])
    if unillm.backends()["llama.cpp"].availability().available:
        assert chosen.exit_code == 0 and chosen.output.strip() == "llama.cpp"
    explained = runner.invoke(app, ["select", gguf, "--explain", "--concurrency", "8"])
    assert "the ten questions:" in explained.output and "8 concurrent" in explained.output


# -- select --hardware judges the profile's machine --------------------------------------------


def test_select_for_a_machine_we_do_not_have_is_what_select_says(tiny: TinyModel) -> None:
    """A hand-written profile says nothing of installed engines: the CLI then agrees with
    `unillm.select()`, for which every registered backend counts as installed."""
    profile = PROFILES / "h100-8x-nvlink.json"
    hf = str(tiny.hf_dir)
    out = runner.invoke(app, ["select", hf, "--hardware", str(profile), "--concurrency", "64", "--explain"])
    assert out.exit_code == 0, out.output
    assert "backend: vllm (chosen by auto)" in out.output  # whether or not vllm is installed here
    assert "NVLink between all GPUs" in out.output
    hw = unillm.load_hardware(profile)
    info = unillm.inspect_model(hf)
    wl = unillm.Workload(concurrency=64)
    expected = unillm.select(hw, info, wl, unillm.backends(), plan=unillm.plan(info, hw, wl))
    brief = runner.invoke(app, ["select", hf, "--hardware", str(profile), "--concurrency", "64"])
    assert brief.output.strip() == expected.backend == "vllm"


def test_doctor_json_is_a_profile(tiny: TinyModel, tmp_path: Path) -> None:
    doc = runner.invoke(app, ["doctor", "--json"])
    profile = tmp_path / "this-machine.json"
    profile.write_text(doc.stdout, encoding="utf-8")
    hw = unillm.load_hardware(profile)  # as docs/hardware.md promises
    here = with_engine_builds(unillm.detect_hardware())  # the builds the backends report, as doctor
    assert (hw.os, hw.arch, hw.cpu_cores, hw.engines) == (here.os, here.arch, here.cpu_cores, here.engines)
    assert [g.name for g in hw.gpus] == [g.name for g in here.gpus]
    gguf = str(tiny.gguf_path)
    assert (
        runner.invoke(app, ["select", gguf, "--hardware", str(profile)]).output
        == runner.invoke(app, ["select", gguf]).output
    )
    # the profile's installed backends decide, not this machine's
    data = json.loads(doc.stdout)
    for entry in data["backends"].values():
        entry.update(available=False, reason="not installed there", install_hint=None)
    profile.write_text(json.dumps(data), encoding="utf-8")
    none = runner.invoke(app, ["select", gguf, "--hardware", str(profile)])
    assert none.exit_code == 0 and none.output.startswith("none installed; "), none.output
    why = runner.invoke(app, ["select", gguf, "--hardware", str(profile), "--explain"])
    assert "- llama.cpp [builtin]: GGUF is llama.cpp's own format; " in why.output
    assert "unavailable: not installed there" in why.output
    data["backends"] = {"mlx": data["backends"]["mlx"]}  # llama.cpp is not even registered there
    profile.write_text(json.dumps(data), encoding="utf-8")
    why = runner.invoke(app, ["select", gguf, "--hardware", str(profile), "--explain"])
    assert "unavailable: not installed on the profile's machine" in why.output
    data["backends"]["llama.cpp"] = "yes"
    profile.write_text(json.dumps(data), encoding="utf-8")
    bad = runner.invoke(app, ["select", gguf, "--hardware", str(profile)])
    assert bad.exit_code == 2 and "backends.llama.cpp is not an availability record" in bad.output


# -- generate and chat on the real engine -------------------------------------------------------


@needs_llama_cpp
def test_generate_and_chat(tiny_gguf: Path) -> None:
    out = runner.invoke(
        app,
        [
            "generate",
            str(tiny_gguf),
            "The quick brown fox",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
            "--explain",
        ],
    )
    assert out.exit_code == 0, out.output
    assert "backend: llama.cpp" in out.output and "[length; " in out.output
    assert "loading" not in out.output  # no spinner when stderr is not a terminal
    chat = runner.invoke(app, ["chat", str(tiny_gguf), "-m", "Why is the sky blue?", "--max-tokens", "5"])
    assert chat.exit_code == 0, chat.output
    assert "completion tokens" in chat.output


@needs_llama_cpp
def test_generate_with_config_options_context_stop_and_json(tiny_gguf: Path, tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(tiny_gguf.read_bytes())
    cfg = tmp_path / "unillm.toml"
    cfg.write_text('model = "m.gguf"\nbackend = "llama.cpp"\n[backend_options."llama.cpp"]\nn_threads = 1\n')
    base = [
        "generate",
        "--config",
        str(cfg),
        "The quick brown fox",
        "--max-tokens",
        "16",
        "--temperature",
        "0",
    ]
    out = runner.invoke(
        app, [*base, "--json", "--option", "n_threads=2", "--option", "seed=7", "--context", "256"]
    )
    assert out.exit_code == 0, out.output
    full = json.loads(out.stdout)
    assert full["backend"] == "llama.cpp" and full["model"] == str(tmp_path / "m.gguf")
    assert (
        full["finish_reason"] == "length"
        and len(full["token_ids"]) == full["usage"]["completion_tokens"] == 16
    )
    assert full["usage"]["total_tokens"] == full["usage"]["prompt_tokens"] + 16
    assert full["timings"]["ttft_s"] > 0
    stop = re.findall(r"[a-z]{3,}", full["text"])[-1]  # a word the greedy completion reaches
    cut = json.loads(runner.invoke(app, [*base, "--json", "--stop", stop, "--stop", "\x00never"]).stdout)
    assert cut["finish_reason"] == "stop" and cut["text"] == full["text"][: full["text"].index(stop)]
    # a value that is not JSON stays a string, which llama.cpp's options refuse for n_threads
    typo = runner.invoke(app, [*base, "--option", "n_threads=two"])
    assert typo.exit_code == 2 and "n_threads" in typo.output and "'two'" in typo.output
    # the context is the one asked for: the completion stops where the 16-token window is full
    small = json.loads(runner.invoke(app, [*base, "--context", "16", "--json"]).stdout)
    assert small["usage"]["total_tokens"] == 16 and small["usage"]["completion_tokens"] < 16


@needs_llama_cpp
def test_generate_takes_the_model_from_the_environment(tiny_gguf: Path) -> None:
    out = runner.invoke(
        app,
        ["generate", "hello", "--max-tokens", "3", "--temperature", "0", "--json"],
        env={"UNILLM_MODEL": str(tiny_gguf)},
    )
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["usage"]["completion_tokens"] == 3


@needs_llama_cpp
def test_chat_repl_exit_reset_and_eof(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from unillm.engines.llamacpp import LlamaCppEngine

    gguf = str(tiny_gguf)
    quit_at_once = runner.invoke(app, ["chat", gguf], input="/exit\n")
    assert quit_at_once.exit_code == 0, quit_at_once.output
    assert "/exit (or Ctrl-D) quits" in quit_at_once.output  # said before the first prompt
    assert "completion tokens" not in quit_at_once.output  # /exit never reached the model

    resets: list[object] = []
    real_reset = LlamaCppEngine.reset

    def reset(self: LlamaCppEngine) -> None:
        resets.append(self)
        real_reset(self)

    monkeypatch.setattr(LlamaCppEngine, "reset", reset)
    flags = ["--max-tokens", "4", "--temperature", "0"]
    out = runner.invoke(app, ["chat", gguf, *flags], input="Hello\n/reset\nHello\n/exit\n")
    assert out.exit_code == 0, out.output
    assert len(resets) == 1 and "(history cleared)" in out.output
    prompts = re.findall(r"; (\d+) prompt \+", out.output)
    assert len(prompts) == 2 and prompts[0] == prompts[1]  # the second turn started over

    keep = runner.invoke(app, ["chat", gguf, *flags], input="Hello\nHello\n")  # EOF ends it
    assert keep.exit_code == 0, keep.output
    first, second = (int(n) for n in re.findall(r"; (\d+) prompt \+", keep.output))
    assert second > first  # without /reset the history grows


@needs_llama_cpp
def test_chat_ctrl_c_at_the_prompt_quits(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(prompt: str = "") -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(builtins, "input", interrupted)
    out = runner.invoke(app, ["chat", str(tiny_gguf)])
    assert out.exit_code == 0 and "Traceback" not in out.output


@needs_llama_cpp
def test_chat_ctrl_c_during_a_reply_drops_that_turn(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from unillm.engines.llamacpp import LlamaCppEngine

    real = LlamaCppEngine.stream_chat
    calls: list[int] = []

    def stream_chat(self: LlamaCppEngine, *args: Any, **kw: Any) -> Iterator[Any]:
        calls.append(1)
        chunks = real(self, *args, **kw)
        if len(calls) == 1:  # the first reply is cut short after one piece, as Ctrl-C would
            yield next(chunks)
            chunks.close()
            raise KeyboardInterrupt
        yield from chunks

    monkeypatch.setattr(LlamaCppEngine, "stream_chat", stream_chat)
    flags = ["--max-tokens", "4", "--temperature", "0"]
    out = runner.invoke(app, ["chat", str(tiny_gguf), *flags], input="Hello\nHello\n")
    assert out.exit_code == 0, out.output
    assert "(interrupted)" in out.output and "Traceback" not in out.output
    fresh = runner.invoke(app, ["chat", str(tiny_gguf), *flags, "-m", "Hello"])
    prompt = re.compile(r"; (\d+) prompt \+")
    assert prompt.findall(out.output) == prompt.findall(fresh.output)  # the cut turn left no trace


@needs_llama_cpp
def test_chat_json_lines(tiny_gguf: Path) -> None:
    # greedy: a sampled first token may be the end of turn (4 in 40 runs gave 0 tokens)
    argv = ["chat", str(tiny_gguf), "--json", "--max-tokens", "3", "--temperature", "0"]
    out = runner.invoke(app, argv, input="Hi\nHi again\n")
    assert out.exit_code == 0, out.output
    replies = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["usage"]["completion_tokens"] for r in replies] == [3, 3]
    assert all(r["backend"] == "llama.cpp" and len(r["token_ids"]) == 3 for r in replies)


@needs_llama_cpp
def test_warnings_read_as_one_line(tiny: TinyModel) -> None:
    # llama.cpp asked for an HF directory: the selector warns, then llama.cpp refuses the model
    out = runner.invoke(app, ["generate", str(tiny.hf_dir), "hi", "--backend", "llama.cpp"])
    assert out.exit_code == 2
    warning = next(line for line in out.output.splitlines() if "selector sees a problem" in line)
    assert warning.startswith("warning: llama.cpp was asked for")
    assert "UnillmWarning" not in out.output and "warnings.warn" not in out.output


@needs_llama_cpp
def test_a_spinner_while_loading_only_on_a_terminal(tiny_gguf: Path) -> None:
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "unillm.cli", "generate", str(tiny_gguf), "hi", "--max-tokens", "2"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
        env={**os.environ, "COLUMNS": "400"},  # a new terminal has no size: rich would cut the line
    )
    os.close(slave)
    seen = bytearray()

    def drain() -> None:  # read while it runs, or a full terminal buffer would block it
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                return
            if not data:
                return
            seen.extend(data)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # it hung: no stray engine left for the next test
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
        os.close(master)
    assert proc.returncode == 0, seen.decode(errors="replace")
    assert f"loading {tiny_gguf} with llama.cpp...".encode() in seen


@needs_llama_cpp
def test_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNILLM_CACHE", str(tmp_path))
    out = runner.invoke(app, ["demo"])
    assert out.exit_code == 0, out.output
    for section in (
        "== selection ==",
        "chosen by auto",
        "== stream",
        "== chat",
        "tokens: 8 in, 24 out",
        "== kv_stats",
    ):
        assert section in out.output
    # the demo's point: the same weights give the same tokens on the other installed engine
    if importlib.util.find_spec("mlx_lm") is not None:
        assert "mlx: 24 tokens" in out.output and "(the same tokens)" in out.output
    assert (tmp_path / "tiny-small-v1" / "tiny-small-f32.gguf").is_file()  # built on first use


def test_the_script_exits_cleanly(tmp_path: Path) -> None:
    """The installed entry point, not the runner: bad input is exit status 2 and one line."""
    proc = subprocess.run(
        [sys.executable, "-m", "unillm.cli", "demo", "--size", "huge"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "error: ConfigError: unknown size 'huge'; choose one of small, bench"


@pytest.mark.parametrize("concurrency", [1, 8, 64])
def test_select_answers_as_auto_engine_chooses_on_a_multi_format_directory(
    tiny: TinyModel, concurrency: int
) -> None:
    """One choice through every door: `unillm select` prints the backend auto_engine's own choice
    (``choose``, what it loads first) takes for a directory holding a GGUF and an HF copy; at
    concurrency 1 auto_engine is loaded and runs it (vLLM's start at 8 and 64 is left to
    tests/test_parity.py, which loads it through this very choice)."""
    from unillm import EngineConfig, auto_engine
    from unillm._choose._auto import choose

    out = runner.invoke(app, ["select", str(tiny.root), "--concurrency", str(concurrency)])
    assert out.exit_code == 0, out.output
    chosen = choose(EngineConfig(model=str(tiny.root), concurrency=concurrency)).selection
    assert out.stdout.splitlines()[0] == chosen.backend
    if HAS_LLAMA_CPP and importlib.util.find_spec("vllm") is not None:  # the field's rule: serving -> vLLM
        assert chosen.backend == ("llama.cpp" if concurrency == 1 else "vllm")
    if concurrency == 1 and HAS_LLAMA_CPP:
        with auto_engine(tiny.root, concurrency=1) as engine:
            assert engine.name == chosen.backend and engine.selection is not None
            assert engine.selection.format == chosen.format == "gguf"


@pytest.mark.parametrize("backend", ["mlx", "vllm", "llama.cpp"])
def test_a_forced_backend_on_a_multi_format_directory_reads_its_own_format(
    tiny: TinyModel, backend: str
) -> None:
    """Forcing a backend on a directory that holds both formats: it is judged on the format it
    reads (no false "does not read gguf"), and the selection says which."""
    from unillm import EngineConfig
    from unillm._choose._auto import choose

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "the selector sees a problem" warning
        choice = choose(EngineConfig(model=str(tiny.root), backend=backend))
    model = choice.facts[backend][0]
    assert model.format == ("gguf" if backend == "llama.cpp" else "safetensors")
    assert not any("does not read" in step for step in choice.selection.steps)
