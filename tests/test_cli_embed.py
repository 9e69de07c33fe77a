"""`unillm embed` and `unillm bench --task embed` on the tiny last-pooling GGUF, through typer's
runner: the CLI's vectors are the in-process engine's, texts come from arguments or stdin, limits
and bad flags are typed errors; the bench writes a result with a row per batch size."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from unillm import load_engine
from unillm.cli import app
from unillm.testing import TinyModel

from .conftest import needs_llama_cpp

pytestmark = needs_llama_cpp

runner = CliRunner()
TEXTS = ["Hello, world!", "Why is the sky blue? Because air scatters blue light more."]
#: one thread: on a busy two-core machine llama.cpp's second thread spins for hundreds of ms a call
ONE_THREAD = ["--option", "n_threads=1", "--option", "n_threads_batch=1"]


@pytest.fixture(scope="module")
def gguf(embed_last: TinyModel) -> str:
    return str(embed_last.gguf_path)


@pytest.fixture(scope="module")
def engine(gguf: str) -> Iterator[Any]:
    options = {"n_threads": 1, "n_threads_batch": 1}
    with load_engine({"model": gguf, "task": "embed", "options": options}) as e:
        yield e


def _embed(*args: str, stdin: str | None = None) -> Any:
    return runner.invoke(app, ["embed", *args, *ONE_THREAD], input=stdin)


def _json(out: Any) -> dict[str, Any]:
    assert out.exit_code == 0, out.output
    data: dict[str, Any] = json.loads(out.stdout)
    return data


def test_json_vectors_are_the_engines(gguf: str, engine: Any) -> None:
    data = _json(_embed(gguf, *TEXTS, "--json"))
    want = engine.embed(TEXTS)
    assert {k: data[k] for k in ("model", "backend", "pooling", "dimensions", "normalized")} == {
        "model": gguf,
        "backend": "llama.cpp",
        "pooling": "last",
        "dimensions": want.dimensions,
        "normalized": True,
    }
    assert data["usage"] == {"prompt_tokens": want.usage.prompt_tokens}
    assert [d["index"] for d in data["data"]] == [0, 1]
    got = np.array([d["embedding"] for d in data["data"]], dtype=np.float64)
    assert np.abs(got - want.array()).max() < 1e-6


def test_texts_from_stdin(gguf: str, engine: Any) -> None:
    want = engine.embed(TEXTS).array()
    for args in ((gguf, "--json"), (gguf, "-", "--json")):
        data = _json(_embed(*args, stdin=f"{TEXTS[0]}\n\n{TEXTS[1]}\n"))  # blank lines skipped
        got = np.array([d["embedding"] for d in data["data"]])
        assert got.shape == want.shape and np.abs(got - want).max() < 1e-6


def test_human_output_and_options(gguf: str, engine: Any) -> None:
    out = _embed(gguf, *TEXTS)
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("0  128 dims  norm 1.0000  [") and "'Hello, world!'" in lines[0]
    assert "2 texts" in out.stderr and "load " in out.stderr and "embed " in out.stderr
    data = _json(_embed(gguf, TEXTS[0], "--json", "--dimensions", "8", "--no-normalize"))
    assert (data["dimensions"], data["normalized"]) == (8, False)
    want = engine.embed(TEXTS[0], dimensions=8, normalize=False).array()[0]
    assert np.abs(np.array(data["data"][0]["embedding"]) - want).max() < 1e-6


def test_too_long_fails_without_truncate(gguf: str) -> None:
    long = "word " * 100
    out = _embed(gguf, long, "--context", "32")
    assert out.exit_code == 2 and out.stdout == ""
    assert out.stderr.startswith("error: ContextLengthExceeded: input 0 has")
    assert "Traceback" not in out.output
    data = _json(_embed(gguf, long, "--context", "32", "--truncate", "--json"))
    assert data["truncated"] == [0] and data["usage"]["prompt_tokens"] == 32


@pytest.mark.parametrize(
    ("value", "expected"),
    [("0", "--dimensions is a positive number"), ("1000", "dimensions=1000 is more than the model's 128")],
)
def test_bad_dimensions(gguf: str, value: str, expected: str) -> None:
    out = _embed(gguf, "hi", "--dimensions", value)
    assert out.exit_code == 2 and out.stdout == ""
    assert out.stderr.startswith("error: ConfigError: ") and expected in out.stderr


def test_a_generative_gguf_embeds_with_last_pooling(tiny_gguf: Path) -> None:
    data = _json(_embed(str(tiny_gguf), "hi", "--json"))
    assert data["pooling"] == "last" and len(data["data"]) == 1


def test_no_text_is_an_error(gguf: str) -> None:
    out = _embed(gguf, stdin="\n")
    assert out.exit_code == 2 and "no text to embed" in out.stderr


def test_bench_task_embed(gguf: str, tmp_path: Path) -> None:
    args = ["bench", gguf, "--task", "embed", "--requests", "4", "--batch-sizes", "1,4", "--input-len", "8"]
    out = runner.invoke(app, [*args, "--no-plots", "--out", str(tmp_path), *ONE_THREAD])
    assert out.exit_code == 0, out.output
    assert "texts/s" in out.stdout and "latency p50 / p90 / p99 ms" in out.stdout
    (path,) = tmp_path.glob("bench-*.json")
    result = json.loads(path.read_text())
    assert result["task"] == "embed" and not result["partial"]
    assert result["metadata"]["workload"]["batch_sizes"] == [1, 4]
    assert [(lv["kind"], lv["value"]) for lv in result["levels"]] == [("batch_size", 1), ("batch_size", 4)]
    for level in result["levels"]:
        s = level["summary"]
        size = int(level["value"])
        assert (s["calls"], s["completed"], s["errors"], s["texts"]) == (4, 4, {}, 4 * size)
        assert s["texts_per_s"] > 0 and s["tokens_per_s"] > 0 and s["input_tokens"] >= 8 * 4 * size
        assert all(s["latency"][p] is not None for p in ("p50", "p90", "p99"))
    from unillm.bench import read_result, table

    again = read_result(path)  # the summaries recomputed from the records are the ones written
    assert [lv["summary"] for lv in again["levels"]] == [lv["summary"] for lv in result["levels"]]
    assert table([again]).splitlines()[0].startswith("| engine | batch | texts/s |")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--task", "embed", "--concurrency", "4"], "--concurrency does not go with --task embed"),
        (["--task", "embed", "--batch-sizes", "1,x"], "--batch-sizes takes comma-separated whole numbers"),
        (["--task", "embed", "--batch-sizes", "0"], "batch sizes must be at least 1"),
        (["--batch-sizes", "4"], "--batch-sizes goes with --task embed"),
    ],
)
def test_bench_embed_bad_flags(gguf: str, argv: list[str], expected: str) -> None:
    out = runner.invoke(app, ["bench", gguf, *argv, "--no-plots"])
    assert out.exit_code == 2 and expected in out.stderr, out.output


def test_the_model_from_the_environment(gguf: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNILLM_MODEL", gguf)
    assert len(_json(_embed("hi", "there", "--json"))["data"]) == 2  # every argument a text
    assert len(_json(_embed(gguf, "hi", "--json"))["data"]) == 1  # a path that is there is MODEL
