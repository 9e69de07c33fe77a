"""Same weights, same meaning on every engine, with default options.

llama.cpp reads the tiny model's GGUF, MLX and vLLM its HF directory: the same tensors. Greedy
decoding of 50 prompts (mixed languages and lengths) must give the same token ids, finish reasons
and usage counts on all of them for at least 95 % of the prompts, and ``check_parity`` must explain
every other difference by a near-tie (the top two tokens closer than 0.1 nats on both engines).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from unillm import EngineConfig, SamplingParams, auto_engine
from unillm._choose._auto import choose
from unillm.testing import TinyModel, build_tiny_model, check_parity
from unillm.testing._tiny import SPECIAL_TOKENS

from .conftest import VLLM_OPTIONS

HAS = {m: importlib.util.find_spec(m) is not None for m in ("llama_cpp", "mlx_lm", "vllm")}
pytestmark = [
    pytest.mark.skipif(not (HAS["llama_cpp"] and HAS["mlx_lm"]), reason="needs llama-cpp-python and mlx-lm"),
    # each model size's engines (vLLM compiling its graphs among them) start once: a random order
    # (--random-order) shuffles this module among the others but keeps its tests grouped by size
    pytest.mark.random_order(disabled=True),
]

PROMPTS = [
    "The quick brown fox", "Hello world", "Once upon a time", "Why is the sky blue?",
    "What is the capital of France?", "Paris is", "0 1 2 3", "How much wood would a woodchuck chuck?",
    "Quantization stores weights in fewer bits", "Decode makes one token at a time and is bound by",
    "Le renard brun rapide saute par-dessus le chien paresseux.", "Der schnelle braune Fuchs",
    "El zorro marrón rápido", "Быстрая коричневая лиса", "敏捷的棕色狐狸跳过了懒狗", "素早い茶色の狐",
    "def fibonacci(n):\n    return", "SELECT * FROM users WHERE", '{"name": "unillm", "version":',
    "a", "?", "1000 + 2026 =", "She sells sea shells by the sea shore.", "Local inference runs",
    "The engine loads the weights, turns text into tokens, runs the forward pass, samples the next token",
    "A laptop, a desktop with one graphics card, a workstation with four, and a server rack each want",
    "Paged attention splits the cache into blocks.", "It had few layers and a tiny vocabulary, but it",
    "Bonjour, comment ça va ?", "Wie geht es dir?", "¿Dónde está la biblioteca?", "Привет, мир!",
    "你好，世界", "こんにちは世界", "안녕하세요", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया",  # noqa: RUF001
    "for i in range(10):", "#include <stdio.h>\nint main() {", "<html><body>", "1, 1, 2, 3, 5, 8, 13,",
    "Formats are not portable between engines. " * 3,
    "The cache grows with the context and with the number of users; a long context can run out of "
    "memory even when the weights fit.",
    "Prefill reads the whole prompt at once and is bound by compute. " * 2, "🙂🙃 emoji test",
    "tab\tseparated\tvalues", "UPPER CASE TEXT", "MiXeD cAsE", "the the the the the",
]  # fmt: skip
assert len(PROMPTS) == 50


def _engines(model: TinyModel, vllm_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every engine installed here on ``model``, each with its default options (vLLM with
    ``vllm_options`` instead where given)."""
    from unillm.engines.llamacpp import LlamaCppEngine
    from unillm.engines.mlx import MLXEngine

    engines: dict[str, Any] = {
        "llama.cpp": LlamaCppEngine(model=str(model.root)),
        "mlx": MLXEngine(model=str(model.root)),
    }
    if HAS["vllm"]:
        from unillm.engines.vllm import VLLMEngine

        engines["vllm"] = VLLMEngine(model=str(model.root), options=vllm_options or {})
    return engines


@pytest.fixture(scope="module", params=["small", "bench"])
def loaded(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    model = build_tiny_model(tmp_path_factory.mktemp(f"parity-{request.param}"), request.param)
    engines = _engines(model)
    try:
        for e in engines.values():
            e.load()
        yield engines
    finally:
        for e in engines.values():
            e.close()


@pytest.mark.slow
def test_greedy_parity_with_default_options(loaded: dict[str, Any]) -> None:
    report = check_parity(loaded, PROMPTS, max_tokens=64)
    print(report.summary())
    report.assert_parity(min_share=0.95)
    # the run did reach the end of sequence on some prompts and max_tokens on others
    finishes = {p.completions["llama.cpp"].finish_reason for p in report.prompts}
    assert finishes <= {"stop", "length"}


def test_eos_stops_at_the_same_token_and_ignore_eos_runs_on(loaded: dict[str, Any]) -> None:
    llama = loaded["llama.cpp"]
    eos = next(iter(llama.eos_token_ids))
    assert all(e.eos_token_ids == llama.eos_token_ids for e in loaded.values()), {
        n: e.eos_token_ids for n, e in loaded.items()
    }
    # push the EOS to the top after a few tokens: every engine stops there, without emitting it
    for n in (0, 3):
        ids = [*llama.tokenize("The quick brown fox"), *llama.generate("The quick brown fox", temperature=0,
               max_tokens=n or 1).token_ids[:n]]  # fmt: skip
        got = {
            name: e.generate(ids, temperature=0, max_tokens=8, logit_bias={eos: 100.0})
            for name, e in loaded.items()
        }
        for name, c in got.items():
            assert c.finish_reason == "stop" and c.token_ids == () and c.usage.completion_tokens == 0, name
    # with ignore_eos every engine runs to max_tokens, the EOS now an ordinary token
    sp = SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100.0}, ignore_eos=True)
    runs = {name: e.generate("The quick brown fox", sp) for name, e in loaded.items()}
    for name, c in runs.items():
        assert c.finish_reason == "length" and c.usage.completion_tokens == 8, name
        assert c.token_ids == (eos,) * 8, name


def test_a_model_declaring_several_eos_ids_stops_on_each(tmp_path: Path) -> None:
    declared = SPECIAL_TOKENS[::-1]  # <|im_end|> (EOS), <|im_start|> (EOT), <|endoftext|> (EOM)
    model = build_tiny_model(tmp_path / "multi", "small", eos=declared)
    hf_cfg = json.loads((model.hf_dir / "generation_config.json").read_text())
    assert len(hf_cfg["eos_token_id"]) == 3
    # vLLM eager with a small KV cache: the EOS set does not depend on compiled graphs, and the
    # start takes half the time; the parity fixture above runs vLLM with its defaults
    engines = _engines(model, VLLM_OPTIONS)
    try:
        for e in engines.values():
            e.load()
        vocab = json.loads((model.hf_dir / "tokenizer.json").read_text())["model"]["vocab"]
        ids = {vocab[t] for t in declared}
        for name, e in engines.items():
            assert e.eos_token_ids == ids, name
            for tok in ids:
                c = e.generate("Hello world", temperature=0, max_tokens=8, logit_bias={tok: 100.0})
                assert c.finish_reason == "stop" and c.token_ids == (), (name, tok)
    finally:
        for e in engines.values():
            e.close()


_APP = """
import json, sys
from unillm import load_engine
with load_engine(sys.argv[1]) as e:
    c = e.generate("The quick brown fox", temperature=0, max_tokens=16)
    print(json.dumps({"backend": e.name, "ids": list(c.token_ids), "finish": c.finish_reason}))
"""


def test_unillm_backend_alone_swaps_the_engine(tiny: TinyModel, tmp_path: Path) -> None:
    """The same app, the same config file naming the multi-format model directory, only
    UNILLM_BACKEND changed. The file holds vLLM's options (eager, a small KV cache) in its own
    table, which the other backends never read: vLLM's defaults are the parity fixture's."""
    config = tmp_path / "unillm.toml"
    config.write_text(
        f"model = {json.dumps(str(tiny.root))}\n[backend_options.vllm]\n"
        + "".join(f"{k} = {json.dumps(v)}\n" for k, v in VLLM_OPTIONS.items())
    )
    runs = {}
    for backend in ["llama.cpp", "mlx", *(["vllm"] if HAS["vllm"] else [])]:
        env = {**os.environ, "UNILLM_BACKEND": backend}
        out = subprocess.run(
            [sys.executable, "-c", _APP, str(config)],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        runs[backend] = json.loads(out.stdout.strip().splitlines()[-1])
    assert {r["backend"] for r in runs.values()} == set(runs)
    first = next(iter(runs.values()))
    assert all(r["ids"] == first["ids"] and r["finish"] == first["finish"] for r in runs.values()), runs


@pytest.mark.skipif(not HAS["vllm"], reason="vLLM is not installed")
def test_several_users_select_vllm_and_say_why(tiny: TinyModel) -> None:
    # options for vLLM only (eager, a small KV cache), so that each start is the shared engine's
    # 25-60 s rather than minutes of compiling: the choice is made before any option is read
    quick = {"backend_options": {"vllm": VLLM_OPTIONS}}
    with auto_engine(tiny.hf_dir, concurrency=16, **quick) as e:
        assert e.name == "vllm"
        assert e.selection is not None
        text = e.selection.explain()
        assert "16 concurrent requests" in text and "several users" in text
    # the directory with both formats too: the same choice, made as auto_engine makes it before it
    # loads (the load above showed that a choice of vLLM loads)
    both = choose(EngineConfig(model=str(tiny.root), concurrency=16, **quick))
    assert both.selection.backend == "vllm", both.selection.explain()
    assert "several users" in both.selection.explain()
