"""unillm.bench against MockEngine and synthetic records: the metrics exactly as defined, the
runner's concurrency and arrivals, the prompts, the result schema, compare and the plots."""

from __future__ import annotations

import copy
import itertools
import json
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from unillm import ConfigError
from unillm._types import Capabilities, SamplingParams
from unillm.bench import (
    SLO,
    IncompleteResult,
    RequestRecord,
    Workload,
    WorkloadMismatch,
    bench_engine,
    compare,
    load_workload,
    percentile,
    plot,
    read_result,
    table,
    write_result,
)
from unillm.bench._metrics import summarize
from unillm.bench._prompts import HFTokenizer, Prompts
from unillm.bench._runner import Bench, arrival_times
from unillm.bench._targets import Target
from unillm.testing import MockEngine

BATCHING = Capabilities(sampling=frozenset(SamplingParams.model_fields), batching=True)


class Scripted:
    """A responder that sleeps ``first_s`` before its first token and ``gap_s`` between the others,
    and counts the requests inside it at once."""

    def __init__(self, first_s: float = 0.0, gap_s: float = 0.0) -> None:
        self.first_s, self.gap_s = first_s, gap_s
        self.inside = 0
        self.peak = 0
        self.lock = threading.Lock()

    def __call__(self, prompt: str, params: SamplingParams) -> Iterator[str]:
        with self.lock:
            self.inside += 1
            self.peak = max(self.peak, self.inside)
        try:
            time.sleep(self.first_s)
            for i in range(params.max_tokens):
                if i and self.gap_s:
                    time.sleep(self.gap_s)
                yield f" w{i}"
        finally:
            with self.lock:
                self.inside -= 1


def mock(responder: Any = None) -> MockEngine:
    return MockEngine(responder or Scripted(), capabilities=BATCHING).load()


MODEL_META = {
    "name": "mock-model",
    "architecture": "llama",
    "parameters": 1,
}


def complete(result: dict[str, Any]) -> dict[str, Any]:
    """A mock run's result with the model facts a mock cannot have filled in."""
    meta = result["metadata"]
    meta["model"].update(MODEL_META)
    meta["weights"].update({"format": "mock", "quantization": "none", "sha256": "0" * 64})
    meta["engine"]["version"] = "1"
    return result


# ---- the metrics, exactly as defined ----


def record(
    send: float, chunks: list[float], *, out: int | None = None, end: float | None = None
) -> RequestRecord:
    return RequestRecord(
        0, send=send, chunk_times=chunks, chunk_tokens=[1] * len(chunks),
        end=end if end is not None else chunks[-1], input_tokens=10,
        output_tokens=out if out is not None else len(chunks), output_asked=len(chunks),
    )  # fmt: skip


def test_ttft_tpot_itl_e2e_follow_their_definitions() -> None:
    r = record(1.0, [1.5, 1.6, 1.8, 2.1])
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.1)
    assert r.tpot == pytest.approx((1.1 - 0.5) / 3)  # the first token excluded, as vLLM's TPOT
    assert r.itl == pytest.approx([0.1, 0.2, 0.3])
    one = record(0.0, [0.4])
    assert one.tpot is None and one.itl == []


def test_a_failed_request_has_no_latencies_and_counts_by_kind() -> None:
    bad = RequestRecord(1, send=0.0, error="HTTP 500", end=0.2)
    assert bad.ttft is None and bad.e2e is None
    s = summarize([record(0.0, [0.1, 0.2]), bad, RequestRecord(2, error="ReadTimeout")], SLO())
    assert s["errors"] == {"HTTP 500": 1, "ReadTimeout": 1}
    assert s["completed"] == 1 and s["requests"] == 3


def test_percentiles_interpolate_as_numpy_does() -> None:
    np = pytest.importorskip("numpy")
    xs = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4, 0.05]
    for p in (50, 90, 95, 99):
        assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    assert percentile([], 50) is None


def test_level_figures_and_goodput() -> None:
    recs = [record(0.0, [0.1, 0.2, 0.3]), record(0.0, [0.5, 0.6, 0.7]), record(0.5, [0.6, 0.9, 1.0])]
    s = summarize(recs, SLO(ttft_ms=200, tpot_ms=150))
    assert s["wall_s"] == pytest.approx(1.0)
    assert s["requests_per_s"] == pytest.approx(3.0)
    assert s["output_tokens_per_s"] == pytest.approx(9.0)
    assert s["prefill_tokens_per_s"] == pytest.approx(30 / (0.1 + 0.5 + 0.1))
    assert s["decode_tokens_per_s"] == pytest.approx(6 / (0.2 + 0.2 + 0.4))
    # request 0 meets both; 1 misses TTFT (500 ms); 2 misses TPOT (200 ms)
    assert s["goodput"]["good"] == 1 and s["goodput"]["share"] == pytest.approx(1 / 3)
    assert s["goodput"]["requests_per_s"] == pytest.approx(1.0)
    assert s["ttft"]["p50"] == pytest.approx(0.1) and s["ttft"]["max"] == pytest.approx(0.5)
    assert s["itl"]["count"] == 6


def test_a_run_against_scripted_delays_measures_them() -> None:
    engine = mock(Scripted(first_s=0.05, gap_s=0.01))
    wl = Workload(input_len=8, output_len=6, requests=4, concurrency=1, warmup=0)
    result = bench_engine(engine, wl)
    s = result["levels"][0]["summary"]
    # the scripted delay is a floor; a busy shared machine adds to it, never takes away
    assert 0.05 <= s["ttft"]["p50"] < 0.05 + 0.2
    assert 0.01 <= s["tpot"]["p50"] < 0.01 + 0.05
    # one gap can read short when the one before it was handed over late; their mean cannot
    assert s["itl"]["count"] == 4 * 5 and s["itl"]["mean"] >= 0.0095
    assert s["output_tokens"] == 24 and s["output_len_mismatches"] == 0
    assert result["output_lengths"] == {"enforced": True, "how": "ignore_eos"}


# ---- the runner ----


def test_concurrency_reaches_the_engine() -> None:
    script = Scripted(first_s=0.05)
    engine = mock(script)
    result = bench_engine(engine, Workload(input_len=4, output_len=2, requests=8, concurrency=[4], warmup=0))
    assert script.peak == 4
    assert result["levels"][0]["peak_in_flight"] == 4


def test_poisson_arrivals_have_the_configured_rate() -> None:
    times = arrival_times(5000, 50.0, seed=7)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # mean gap 1/rate: its standard error is 1.4 % here, so 5 % is well over 3 sigma
    assert statistics.fmean(gaps) == pytest.approx(1 / 50, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 50, rel=0.07)  # exponential: sd = mean
    bursty = arrival_times(5000, 50.0, burstiness=0.25, seed=7)
    bgaps = [b - a for a, b in itertools.pairwise(bursty)]
    assert statistics.fmean(bgaps) == pytest.approx(1 / 50, rel=0.1)
    cv2 = (statistics.stdev(bgaps) / statistics.fmean(bgaps)) ** 2
    assert cv2 == pytest.approx(1 / 0.25, rel=0.2)  # gamma of shape k: CV^2 = 1/k
    assert arrival_times(10, 5.0, seed=1) == arrival_times(10, 5.0, seed=1)


def test_an_open_loop_sends_at_the_arrival_times() -> None:
    engine = mock()
    wl = Workload(input_len=4, output_len=2, requests=12, arrival="poisson", rates=[40.0], warmup=0, seed=3)
    result = bench_engine(engine, wl)
    sends = sorted(r["send"] for r in result["levels"][0]["records"])
    planned = arrival_times(12, 40.0, seed=3)
    late = [s - sends[0] - p for s, p in zip(sends, planned, strict=True)]
    assert all(-0.005 < d < 0.25 for d in late), late


def test_ctrl_c_keeps_what_was_measured_marked_partial() -> None:
    from unillm.bench._api import _run
    from unillm.bench._result import build_result

    class Interrupting(Target):
        kind = "test"

        def __init__(self) -> None:
            self.sent = 0

        async def send(self, req: Any, rec: RequestRecord, t0: float) -> None:
            self.sent += 1
            if self.sent == 4:
                raise KeyboardInterrupt
            rec.send, rec.end = 0.0, 0.01
            rec.chunk_times, rec.chunk_tokens, rec.output_tokens = [0.005], [1], 1

    wl = Workload(input_len=4, output_len=1, requests=10, warmup=0)
    bench = Bench(Interrupting(), wl, Prompts(wl, None))
    levels, interrupted = _run(bench)
    assert interrupted and len(levels) == 1 and levels[0].partial
    assert len(levels[0].records) == 3
    result = build_result(
        metadata={},
        target={},
        workload=wl,
        levels=levels,
        output_enforcement="none",
        prompt_lengths_exact=False,
    )
    assert result["partial"] is True


# ---- prompts ----


def test_shared_prefix_workloads_produce_the_prefix() -> None:
    engine = mock()
    wl = Workload(
        input_len=20, output_len=2, requests=40, shared_prefix_fraction=0.5, shared_prefix_len=8, warmup=0
    )
    result = bench_engine(engine, wl)
    prompts = Prompts(wl, engine)
    prefix = prompts.prefix
    assert len(engine.tokenize(prefix)) == 8
    sent = engine.requests
    assert sum(p.startswith(prefix) for p in sent) == 20
    assert all(len(engine.tokenize(p)) == 20 for p in sent)
    assert result["levels"][0]["summary"]["input_tokens"] == 40 * 20


def test_prompt_lengths_are_exact_under_a_real_tokenizer(tiny: Any) -> None:
    tok = HFTokenizer(tiny.hf_dir)
    wl = Workload(input_len={"kind": "uniform", "min": 5, "max": 120}, output_len=4, requests=30, seed=5)
    prompts = Prompts(wl, tok, vocab_size=tok.vocab_size)
    drawn = [prompts.get(i) for i in range(30)]
    for r in drawn:
        assert len(tok.tokenize(r.prompt)) == r.input_tokens
        assert 5 <= r.input_tokens <= 120
    assert prompts.exact
    again = Prompts(wl, tok, vocab_size=tok.vocab_size)
    assert [again.get(i).prompt for i in range(30)] == [r.prompt for r in drawn]  # the seed decides


def test_jsonl_prompts(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello there"}\n\n{"prompt": "why", "output_tokens": 3}\n')
    engine = mock()
    result = bench_engine(engine, Workload(prompts_jsonl=str(f), output_len=2, requests=4, warmup=0))
    assert engine.requests == ["hello there", "why", "hello there", "why"]
    outs = [r["output_tokens"] for r in result["levels"][0]["records"]]
    assert outs == [2, 3, 2, 3]


# ---- workloads as data ----


def test_workloads_load_from_toml_and_python(tmp_path: Path) -> None:
    toml = tmp_path / "w.toml"
    toml.write_text(
        '[workload]\nname = "chatty"\n'
        'input_len = {kind = "normal", mean = 64, std = 8, min = 16, max = 128}\n'
        'output_len = 32\nconcurrency = [1, 4]\nrequests = 8\nmode = "chat"\n'
        "[workload.slo]\nttft_ms = 500\n"
    )
    wl = load_workload(toml)
    assert wl.concurrency == (1, 4) and wl.input_len.kind == "normal" and wl.slo.ttft_ms == 500
    py = tmp_path / "w.py"
    py.write_text(
        "from unillm.bench import Workload\nWORKLOAD = Workload(duration_s=5, arrival='gamma', rates=[2.0])\n"
    )
    wl2 = load_workload(py)
    assert wl2.requests is None and wl2.duration_s == 5 and wl2.levels() == [("rate", 2.0)]


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"concurrency": [0]}, "concurrency"),
        ({"rates": [2.0]}, "arrival"),
        ({"arrival": "poisson"}, "rates"),
        ({"shared_prefix_fraction": 0.5}, "shared_prefix_len"),
        ({"input_len": {"kind": "uniform", "min": 4}}, "max"),
        ({"requests": 4, "duration_s": 3}, "not both"),
        ({"input_len": 8, "colour": "red"}, "colour"),
    ],
)
def test_bad_workloads_are_config_errors(bad: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        Workload(**bad)


def test_a_bad_toml_file_is_a_config_error(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("requests = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_workload(f)
    with pytest.raises(ConfigError, match="does not exist"):
        load_workload(tmp_path / "none.toml")


# ---- results: schema, metadata, compare, reports ----


@pytest.fixture(scope="module")
def mock_result() -> dict[str, Any]:
    engine = mock(Scripted(first_s=0.002))
    wl = Workload(input_len=8, output_len=4, requests=6, concurrency=[1, 2], warmup=1, slo={"ttft_ms": 1000})
    return complete(bench_engine(engine, wl, price_per_hour=2.0))


def test_the_json_schema_round_trips(mock_result: dict[str, Any], tmp_path: Path) -> None:
    path = write_result(mock_result, tmp_path / "r.json")
    back = read_result(path)
    assert back["schema"] == "unillm.bench/1"
    for a, b in zip(back["levels"], mock_result["levels"], strict=True):
        assert json.loads(json.dumps(a["summary"])) == json.loads(json.dumps(b["summary"]))
    assert back["metadata"] == json.loads(json.dumps(mock_result["metadata"]))
    level = back["levels"][0]
    tps = level["summary"]["output_tokens_per_s"]
    assert level["cost_per_1m_output_tokens"] == pytest.approx(2.0 / 3600 / tps * 1e6)


def test_a_result_missing_metadata_is_not_written(mock_result: dict[str, Any], tmp_path: Path) -> None:
    bad = copy.deepcopy(mock_result)
    bad["metadata"]["engine"]["version"] = None
    bad["metadata"]["weights"]["sha256"] = None
    with pytest.raises(IncompleteResult, match=r"weights\.sha256, engine\.version") as info:
        write_result(bad, tmp_path / "r.json")
    assert info.value.missing == ("weights.sha256", "engine.version")
    assert not (tmp_path / "r.json").exists()


def test_compare_refuses_mismatched_workloads_unless_forced(mock_result: dict[str, Any]) -> None:
    other = copy.deepcopy(mock_result)
    other["metadata"]["workload"]["output_len"]["mean"] = 64
    with pytest.raises(WorkloadMismatch, match=r"output_len\.mean: 4 != 64"):
        compare([mock_result, other])
    assert any("forced" in n for n in compare([mock_result, other], force=True))
    renamed = copy.deepcopy(mock_result)
    renamed["metadata"]["workload"]["name"] = "another label"
    assert compare([mock_result, renamed]) == []


def test_compare_flags_a_version_change(mock_result: dict[str, Any]) -> None:
    upgraded = copy.deepcopy(mock_result)
    upgraded["metadata"]["engine"]["version"] = "2"
    upgraded["metadata"]["unillm_version"] = "9.9"
    flags = compare([mock_result, upgraded])
    assert "engine changed: 1 -> 2" in flags and "unillm changed: 0.1.0 -> 9.9" in flags


def test_the_table_and_the_plots(
    mock_result: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from matplotlib.figure import Figure

    from unillm.bench._report import plot_title

    text = table([mock_result])
    assert text.count("\n") == 3 and "| mock 1 | c=1 |" in text and "| c=2 |" in text
    titles: list[str] = []
    labels: list[str] = []
    real_suptitle, real_ylabel = Figure.suptitle, __import__("matplotlib.axes").axes.Axes.set_ylabel
    monkeypatch.setattr(
        Figure, "suptitle", lambda self, t, **kw: titles.append(t) or real_suptitle(self, t, **kw)
    )
    monkeypatch.setattr(
        "matplotlib.axes.Axes.set_ylabel",
        lambda self, t, **kw: labels.append(t) or real_ylabel(self, t, **kw),
    )
    paths = plot([mock_result], tmp_path)
    meta = mock_result["metadata"]
    title = plot_title([mock_result])
    assert titles == [title, title]  # each figure says what it shows
    assert meta["model"]["name"] in title and "mock 1" in title and meta["date"][:10] in title
    assert "tokens/s" in labels and "ms" in labels  # each axis its unit
    assert [p.name for p in paths] == ["bench-cdf.png", "bench-sweep.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_the_cli_compares_and_refuses(mock_result: dict[str, Any], tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from unillm.cli import app

    a = write_result(mock_result, tmp_path / "a.json")
    other = copy.deepcopy(mock_result)
    other["metadata"]["workload"]["seed"] = 99
    b = write_result(other, tmp_path / "b.json")
    runner = CliRunner()
    ok = runner.invoke(app, ["bench", "compare", str(a), str(a)])
    assert ok.exit_code == 0, ok.output
    assert "| mock 1 | c=1 |" in ok.output
    refused = runner.invoke(app, ["bench", "compare", str(a), str(b)])
    assert refused.exit_code == 2 and "WorkloadMismatch" in refused.output and "seed" in refused.output
    forced = runner.invoke(app, ["bench", "compare", str(a), str(b), "--force"])
    assert forced.exit_code == 0 and "flag: workloads differ (forced)" in forced.output


def test_a_duration_ends_each_level() -> None:
    engine = mock(Scripted(first_s=0.02))
    wl = Workload(input_len=4, output_len=1, duration_s=0.3, concurrency=[2], warmup=0)
    assert wl.requests is None
    result = bench_engine(engine, wl)
    level = result["levels"][0]
    # two clients, ~20 ms a request: about 30 requests in 0.3 s, and none sent after it
    assert 4 <= level["summary"]["requests"] <= 40
    assert max(r["send"] for r in level["records"]) < 0.3


def test_structured_output_asks_for_the_schema_and_says_lengths_are_not_enforced() -> None:
    seen: list[SamplingParams] = []

    def respond(prompt: str, params: SamplingParams) -> str:
        seen.append(params)
        return '{"answer": "x", "confidence": 1}'

    engine = mock(respond)
    result = bench_engine(engine, Workload(input_len=4, output_len=16, requests=2, warmup=0, structured=True))
    assert all(p.response_format is not None and not p.ignore_eos for p in seen)
    assert result["output_lengths"]["enforced"] is False
    assert "structured" in result["output_lengths"]["how"]
    assert result["levels"][0]["summary"]["output_len_mismatches"] == 2  # said, not hidden


def test_an_engine_without_ignore_eos_says_so() -> None:
    caps = Capabilities(sampling=frozenset({"max_tokens", "temperature", "stop"}), batching=True)
    engine = MockEngine(Scripted(), capabilities=caps).load()
    result = bench_engine(engine, Workload(input_len=4, output_len=3, requests=1, warmup=0))
    assert result["output_lengths"] == {
        "enforced": False,
        "how": "none: mock has no ignore_eos; max_tokens bounds the output",
    }


def test_a_workload_longer_than_the_context_fails_before_it_runs() -> None:
    engine = MockEngine(Scripted(), capabilities=BATCHING, context_length=64).load()
    with pytest.raises(
        ConfigError, match=r"60 prompt \+ 16 output tokens\) does not fit mock's context of 64"
    ):
        bench_engine(engine, Workload(input_len=60, output_len=16, requests=1))
    assert engine.requests == []


def test_http_token_count_without_usage_is_not_the_chunk_count() -> None:
    # a server that streams no usage (llama-cpp-python's): ids it streamed, else max_tokens when it
    # stopped for length, else the text through the tokenizer; the chunks only failing all of those
    from unillm.bench._targets import HttpTarget
    from unillm.bench._workload import Workload

    target = HttpTarget("http://127.0.0.1:9/v1", "m", Workload(), count_tokens=lambda t: len(t.split()))
    chunks = [1, 1, 1]  # three chunks with text for what may be more tokens
    assert target._count("length", 0, "a b c", chunks, 16) == 16
    assert target._count("stop", 5, "a b c", chunks, 16) == 5
    assert target._count("stop", 0, "a b c d", chunks, 16) == 4
    assert HttpTarget("http://127.0.0.1:9/v1", "m", Workload())._count("stop", 0, "a b c d", chunks, 16) == 3
