"""Shared fixtures: the tiny models are built once per test session into a temp dir."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from unillm.testing import TinyModel, build_tiny_model

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
needs_llama_cpp = pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed")
HAS_VLLM = importlib.util.find_spec("vllm") is not None

#: The options the shared vLLM engine starts with. No dtype: unillm's default, the weights' own
#: (f32 here; vLLM's "auto" would run bf16, which changes greedy tokens and costs a ~25 s kernel JIT
#: on the first request). Eager: a start of 25-60 s instead of minutes of torch.compile.
VLLM_OPTIONS: dict[str, Any] = {
    "enforce_eager": True,
    "kv_cache_memory_bytes": 64 << 20,
    "max_num_seqs": 32,
    "seed": 0,
}
VLLM_CONTEXT = 2048  # room for the tool tests' Hermes prompts (tests/test_tools.py)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The ~2 MB tiny Llama (HF dir + GGUF), built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), "small")


@pytest.fixture(scope="session")
def tiny_gguf(tiny: TinyModel) -> Path:
    return tiny.gguf_path


@pytest.fixture(scope="session")
def llama(tiny_gguf: Path) -> Iterator[object]:
    """One real llama.cpp engine on the tiny GGUF, shared by the session's tests."""
    if not HAS_LLAMA_CPP:
        pytest.skip("llama-cpp-python is not installed")
    from unillm.engines.llamacpp import LlamaCppEngine

    engine = LlamaCppEngine(model=str(tiny_gguf), context_length=512, options={"n_threads": 2, "seed": 1234})
    with engine:
        yield engine


@pytest.fixture(scope="session")
def vllm_engine(tiny: TinyModel) -> Iterator[Any]:
    """One real vLLM engine on the tiny HF model (VLLM_OPTIONS, VLLM_CONTEXT tokens), shared by
    every module whose tests need vLLM with these options: each vLLM start costs 25-60 s here, the
    suite's largest single cost. A test that needs another configuration, or closes or breaks its
    engine, starts its own and says why."""
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed")
    from unillm import load_engine

    engine = load_engine(
        {
            "model": str(tiny.hf_dir),
            "backend": "vllm",
            "context_length": VLLM_CONTEXT,
            "backend_options": {"vllm": VLLM_OPTIONS},
        }
    )
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="session")
def embed_last(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The tiny model as an embedding model with last-token pooling (HF dir + GGUF)."""
    from unillm.testing import tiny_embedding_model

    return tiny_embedding_model("last", cache_dir=tmp_path_factory.mktemp("embed-last"))


@pytest.fixture(scope="session")
def vllm_embed_engine(embed_last: TinyModel) -> Iterator[Any]:
    """One real vLLM engine loaded for embeddings (its pooling runner) on ``embed_last``, shared by
    the modules that check vLLM's embed: vLLM runs a model for generation or for pooling, fixed
    when it starts, so ``vllm_engine`` cannot embed."""
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed")
    from unillm import load_engine

    config = {"model": str(embed_last.hf_dir), "backend": "vllm", "context_length": 256}
    engine = load_engine({**config, "options": {**VLLM_OPTIONS, "max_num_seqs": 16}})
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="session")
def converter_python() -> str:
    """The interpreter of the model converters' own environment (scripts/converters.sh builds it on
    first use and reuses it after): torch and transformers < 5.6 stay out of the test environment."""
    import subprocess

    script = Path(__file__).resolve().parent.parent / "scripts" / "converters.sh"
    proc = subprocess.run([str(script)], capture_output=True, text=True, timeout=1800, check=False)
    assert proc.returncode == 0, f"scripts/converters.sh failed:\n{proc.stderr[-4000:]}"
    return proc.stdout.strip().splitlines()[-1]


# ---- where the time goes: seconds per test module at the end of every run ----

_MODULE_SECONDS: dict[str, float] = {}
_MODULE_TESTS: dict[str, int] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = report.nodeid.split("::", 1)[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _MODULE_TESTS[module] = _MODULE_TESTS.get(module, 0) + 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Seconds per module (setup, call and teardown of its tests; a module-scoped fixture counts
    where it is set up), beside pytest's --durations list of the slowest single phases."""
    if not _MODULE_SECONDS:
        return
    total = sum(_MODULE_SECONDS.values())
    terminalreporter.write_sep("=", f"time per module ({total / 60:.1f} min in tests)")
    for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1]):
        if seconds >= 1.0:
            tests = _MODULE_TESTS.get(module, 0)
            terminalreporter.write_line(f"{seconds:8.1f} s  {tests:5d} tests  {module}")
