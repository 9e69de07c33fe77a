"""unillm bench on real engines: a short side-by-side run on llama.cpp and MLX in-process with the
tiny model (each in its own format of the same weights), and HTTP runs against real servers on
loopback (``unillm serve`` and llama-cpp-python's own server). Tiny workloads: a few seconds each."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._server_util import start_server
from unillm.bench import bench_url, read_result, write_result
from unillm.bench._meta import REQUIRED, missing_metadata

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
HAS_MLX = importlib.util.find_spec("mlx_lm") is not None
needs_llama_cpp = pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed")

WORKLOAD = [
    "--requests",
    "4",
    "--concurrency",
    "1,2",
    "--input-len",
    "24",
    "--output-len",
    "8",
    "--warmup",
    "1",
]


def check_exact(result: dict[str, Any], input_len: int, output_len: int) -> None:
    """No errors; every prompt and output as long as the workload drew it."""
    assert result["prompt_lengths_exact"] is True
    for level in result["levels"]:
        s = level["summary"]
        assert s["errors"] == {} and s["completed"] == s["requests"]
        assert s["output_len_mismatches"] == 0
        assert {r["input_tokens"] for r in level["records"]} == {input_len}
        assert {r["output_tokens"] for r in level["records"]} == {output_len}
        assert s["ttft"]["p50"] > 0 and s["tpot"]["p50"] > 0 and s["itl"]["count"] > 0


@needs_llama_cpp
def test_side_by_side_on_llama_cpp_and_mlx(tiny: Any, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from unillm.cli import app

    backends = ["llama.cpp", *(["mlx"] if HAS_MLX else [])]
    out = tmp_path / "out"
    args = ["bench", str(tiny.root), "--backends", ",".join(backends), *WORKLOAD, "--context", "512"]
    # each backend's own options: from a config file's table, and from --option BACKEND:KEY=VALUE
    config = tmp_path / "engines.toml"
    config.write_text('model = "unused"\n[backend_options.mlx]\nbatch_size = 2\n')
    flags = ["--config", str(config), "--option", "llama.cpp:n_threads=1"]
    if len(backends) > 1:  # a bare KEY=VALUE names no backend: refused before anything loads
        bare = CliRunner().invoke(app, [*args, "--option", "n_threads=1", "--out", str(out)])
        assert bare.exit_code == 2 and "write BACKEND:KEY=VALUE" in bare.output, bare.output
    res = CliRunner().invoke(app, [*args, *flags, "--interleave", "--out", str(out)])
    assert res.exit_code == 0, res.output
    files = sorted(out.glob("bench-*.json"))
    assert len(files) == len(backends)
    results = [read_result(f) for f in files]
    by_engine = {r["metadata"]["engine"]["name"]: r for r in results}
    assert set(by_engine) == set(backends)
    for r in results:
        assert missing_metadata(r["metadata"]) == [], r["metadata"]
        assert r["output_lengths"]["enforced"] and not r["partial"]
        check_exact(r, 24, 8)
        assert [lv["value"] for lv in r["levels"]] == [1, 2]
        mem = r["levels"][0]["memory"]
        assert mem["peak_rss_bytes"] > 0 and mem["plan"]["total_bytes"] > 0
        assert r["levels"][0]["kv"]["capacity_tokens"]
    assert by_engine["llama.cpp"]["metadata"]["weights"]["format"] == "gguf"
    assert by_engine["llama.cpp"]["metadata"]["engine"]["options"]["n_threads"] == 1
    if HAS_MLX:
        assert by_engine["mlx"]["metadata"]["engine"]["options"]["batch_size"] == 2
    if HAS_MLX:
        mlx = by_engine["mlx"]["metadata"]
        assert mlx["weights"]["format"] != "gguf" and mlx["weights"]["files"] == ["model.safetensors"]
        assert by_engine["mlx"]["levels"][1]["peak_in_flight"] == 2  # a batching engine gets both
    assert "| llama.cpp " in res.output and "| c=2 |" in res.output
    if HAS_MLX:  # interleaved: each level on each engine in turn
        starts = sorted(
            (lv["started"], r["metadata"]["engine"]["name"], lv["value"])
            for r in results
            for lv in r["levels"]
        )
        assert [(e, v) for _, e, v in starts] == [("llama.cpp", 1), ("mlx", 1), ("llama.cpp", 2), ("mlx", 2)]
    for png in out.glob("*.png"):
        assert png.stat().st_size > 5000
    assert len(list(out.glob("*.png"))) == 2


def test_every_required_field_is_named_in_the_docs() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "benchmarks.md").read_text()
    for field in REQUIRED:
        assert f"`{field}`" in doc, field


@pytest.fixture(scope="module")
def unillm_server(tiny: Any) -> Iterator[Any]:
    if not HAS_LLAMA_CPP:
        pytest.skip("llama-cpp-python is not installed")
    s = start_server([str(tiny.gguf_path), "--backend", "llama.cpp", "--alias", "tiny", "--context", "512"])
    try:
        yield s
    finally:
        s.stop()


def test_http_run_against_unillm_serve(unillm_server: Any, tiny: Any, tmp_path: Path) -> None:
    wl = {"input_len": 20, "output_len": 6, "requests": 4, "concurrency": [2], "warmup": 1}
    result = bench_url(
        unillm_server.v1, wl, model_path=tiny.gguf_path, tokenizer=tiny.hf_dir,
        engine_name="unillm serve (llama.cpp)", engine_version="0.1.0",
    )  # fmt: skip
    assert result["target"] == {"kind": "http", "url": unillm_server.v1, "model": "tiny"}
    check_exact(result, 20, 6)
    kv = result["levels"][0]["kv"]  # from the server's /metrics
    assert kv["prefix_cache_queries"] > 0 and kv["prefix_cache_hits"] is not None
    assert kv["peak_usage"] is not None and 0 < kv["peak_usage"] <= 1
    # the server's memory from its own /metrics (unillm:resident_memory_bytes), not this process's
    from unillm.bench._targets import rss_bytes

    peak, server_now = result["levels"][0]["memory"]["peak_rss_bytes"], rss_bytes(unillm_server.proc.pid)
    assert peak is not None and server_now is not None
    assert 0.5 < peak / server_now < 2, (peak, server_now, rss_bytes())
    path = write_result(result, tmp_path / "http.json")
    assert missing_metadata(json.loads(path.read_text())["metadata"]) == []


def test_http_chat_and_no_stream(unillm_server: Any, tiny: Any) -> None:
    wl = {"input_len": 12, "output_len": 5, "requests": 2, "warmup": 0, "mode": "chat", "stream": False}
    result = bench_url(unillm_server.url, wl, tokenizer=tiny.hf_dir)
    s = result["levels"][0]["summary"]
    assert s["errors"] == {} and s["ttft"]["count"] == 0 and s["e2e"]["count"] == 2  # no stream, no TTFT
    assert {r["output_tokens"] for r in result["levels"][0]["records"]} == {5}


def test_a_url_result_without_engine_version_is_not_written(
    unillm_server: Any, tiny: Any, tmp_path: Path
) -> None:
    from unillm.bench import IncompleteResult

    result = bench_url(unillm_server.v1, {"input_len": 8, "output_len": 2, "requests": 1, "warmup": 0})
    assert result["levels"][0]["summary"]["completed"] == 1
    with pytest.raises(IncompleteResult, match=r"engine\.version"):
        write_result(result, tmp_path / "x.json")


@needs_llama_cpp
def test_the_cli_compares_unillm_serve_with_llama_cpp_python_s_server(tiny: Any, tmp_path: Path) -> None:
    """``unillm bench MODEL --servers llama-cpp-python``: both servers started on loopback, the same
    workload on each, a result per server with that server's own memory, the ratios printed, and
    nothing left running."""
    import psutil
    from typer.testing import CliRunner

    from unillm.cli import app

    before = {p.pid for p in psutil.Process().children(recursive=True)}  # a module's server may run
    args = ["bench", str(tiny.root), "--servers", "llama-cpp-python", "--requests", "3", "--concurrency", "1"]
    args += ["--input-len", "16", "--output-len", "6", "--warmup", "1", "--context", "512", "--parallel", "2"]
    res = CliRunner().invoke(app, [*args, "--no-plots", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "unillm serve (llama.cpp) / llama_cpp.server at c=1: output tok/s" in res.output
    ours = read_result(next(tmp_path.glob("bench-*-unillm-serve-llama.cpp-*.json")))
    theirs = read_result(next(tmp_path.glob("bench-*-llama-cpp.server-*.json")))
    assert ours["metadata"]["engine"]["name"] == "unillm serve (llama.cpp)"
    assert theirs["metadata"]["engine"]["version"] == md.version("llama-cpp-python")
    for result in (ours, theirs):
        level = result["levels"][0]
        s = level["summary"]
        assert s["errors"] == {} and s["completed"] == 3
        assert {r["input_tokens"] for r in level["records"]} == {16}  # the same prompts on both
        # the server's resident memory (it loaded the model), not this process's
        assert (
            level["memory"]["peak_rss_bytes"]
            and level["memory"]["peak_rss_bytes"] != psutil.Process().memory_info().rss
        )
    assert {r["output_tokens"] for r in ours["levels"][0]["records"]} == {6}  # it reads ignore_eos
    # llama_cpp.server reads no ignore_eos: the result says how many outputs came out short
    records = theirs["levels"][0]["records"]
    assert theirs["levels"][0]["summary"]["output_len_mismatches"] == sum(
        r["output_tokens"] != 6 for r in records
    )
    assert theirs["levels"][0]["kv"]["peak_usage"] is None  # no /metrics: nothing made up
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before  # both servers stopped


def test_the_cli_refuses_servers_it_cannot_compare(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from unillm.cli import app

    bad = CliRunner().invoke(app, ["bench", str(tmp_path), "--servers", "ollama"])
    assert bad.exit_code == 2 and "unknown server 'ollama'" in bad.output and "xllamacpp" in bad.output
    missing = CliRunner().invoke(
        app, ["bench", str(tmp_path), "--servers", "xllamacpp", "--peer-python", sys.executable]
    )
    if importlib.util.find_spec("xllamacpp") is None:
        assert missing.exit_code == 2 and "pip install xllamacpp" in missing.output
    both = CliRunner().invoke(app, ["bench", str(tmp_path), "--servers", "vllm", "--backends", "mlx"])
    assert both.exit_code == 2 and "--servers" in both.output


@needs_llama_cpp
def test_without_backends_the_selector_chooses(tiny: Any, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from unillm.cli import app

    args = ["bench", str(tiny.gguf_path), "--requests", "2", "--input-len", "8", "--output-len", "3"]
    res = CliRunner().invoke(app, [*args, "--warmup", "0", "--no-plots", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    [written] = tmp_path.glob("bench-*-llama.cpp-*.json")
    assert read_result(written)["levels"][0]["summary"]["completed"] == 2


def test_the_cli_wants_a_model_or_a_url() -> None:
    from typer.testing import CliRunner

    from unillm.cli import app

    res = CliRunner().invoke(app, ["bench"])
    assert res.exit_code == 2 and "give a MODEL" in res.output
    bad = CliRunner().invoke(app, ["bench", "x.gguf", "--concurrency", "1,two"])
    assert bad.exit_code == 2 and "--concurrency" in bad.output


def test_the_cli_benchmarks_a_url(unillm_server: Any, tiny: Any, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from unillm.cli import app

    args = [
        "bench",
        "--url",
        unillm_server.v1,
        "--model-path",
        str(tiny.gguf_path),
        "--tokenizer",
        str(tiny.hf_dir),
    ]
    args += ["--engine", "unillm serve", "--engine-version", "0.1.0", "--requests", "2", "--rate", "20"]
    res = CliRunner().invoke(
        app, [*args, "--input-len", "8", "--output-len", "3", "--no-plots", "--out", str(tmp_path)]
    )
    assert res.exit_code == 0, res.output
    [written] = tmp_path.glob("bench-*-unillm-serve-*.json")
    result = read_result(written)
    assert result["metadata"]["workload"]["arrival"]["process"] == "poisson"
    assert result["levels"][0]["kind"] == "rate" and result["levels"][0]["summary"]["completed"] == 2
