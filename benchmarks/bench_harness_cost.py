"""What `unillm bench` itself costs: with a mock engine that emits tokens instantly, how many tokens
per second can the harness time and account for? It must stay far above any engine it measures
(issue 15 asks for at least 50,000 tokens/s on this machine), so it never becomes what it measures.

Three paths, each through the whole harness (runner, per-chunk timing, the level's summary and the
result document):

- ``native``: a MockEngine with a native async ``_astream`` (the way a batching engine such as
  vLLM streams): engine.astream's base-class bookkeeping plus the harness;
- ``thread``: the stock MockEngine, whose ``astream`` runs the sync stream on a thread of its own
  (the way llama.cpp and MLX stream): adds one thread-to-loop hand-over per token;
- ``harness``: a target that makes its records directly: the harness's bookkeeping alone.

    .venv/bin/python benchmarks/bench_harness_cost.py [--tokens 200] [--requests 200] [--concurrency 8]

Prints one JSON line per path and writes benchmarks/results/bench-harness-cost.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from unillm._contract._engine import Request
from unillm._types import Capabilities, SamplingParams
from unillm.bench import Workload, bench_engine
from unillm.bench._api import _run
from unillm.bench._metrics import RequestRecord
from unillm.bench._prompts import Prompts
from unillm.bench._result import build_result
from unillm.bench._runner import Bench
from unillm.bench._targets import Target
from unillm.testing import MockEngine

CAPS = Capabilities(sampling=frozenset(SamplingParams.model_fields), batching=True)


def instant(prompt: str, params: SamplingParams) -> Any:
    return (" x" for _ in range(params.max_tokens))


class NativeMock(MockEngine):
    """MockEngine streaming on the caller's event loop, as a batching engine's ``_astream`` does."""

    async def _astream(
        self, prepared: str, params: SamplingParams, req: Request
    ) -> AsyncGenerator[Any, None]:
        req.prompt_tokens = len(self.tokenize(prepared))
        for _ in range(params.max_tokens):
            yield " x", (1,), None
        req.finish_reason = "length"


class Instant(Target):
    kind = "harness"

    async def send(self, req: Any, rec: RequestRecord, t0: float) -> None:
        now = time.perf_counter
        rec.send = now() - t0
        for _ in range(req.output_tokens):
            rec.chunk_times.append(now() - t0)
            rec.chunk_tokens.append(1)
        rec.end = now() - t0
        rec.output_tokens = req.output_tokens
        rec.input_tokens = req.input_tokens


def once(path: str, wl: Workload) -> float:
    t = time.perf_counter()
    if path == "harness":
        bench = Bench(Instant(), wl, Prompts(wl, None))
        levels, _ = _run(bench)
        result = build_result(
            metadata={},
            target={},
            workload=wl,
            levels=levels,
            output_enforcement="",
            prompt_lengths_exact=False,
        )
    else:
        engine = (NativeMock if path == "native" else MockEngine)(instant, capabilities=CAPS).load()
        result = bench_engine(engine, wl)
    elapsed = time.perf_counter() - t
    tokens = sum(lv["summary"]["output_tokens"] for lv in result["levels"])
    return tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=200, help="output tokens per request")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    wl = Workload(
        input_len=16, output_len=args.tokens, requests=args.requests, concurrency=[args.concurrency], warmup=0
    )
    out: dict[str, Any] = {
        "what": "tokens/s the bench harness sustains against a mock engine emitting tokens instantly "
        "(whole harness: runner, per-chunk timing, summary, result document)",
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "note": "shared 2-core CPU",
        },
        "workload": wl.as_dict(),
        "paths": {},
    }
    for path in ("native", "thread", "harness"):
        runs = [once(path, wl) for _ in range(args.repeats)]
        entry = {"median_tokens_per_s": statistics.median(runs), "runs": runs}
        out["paths"][path] = entry
        print(json.dumps({"path": path, "median_tokens_per_s": round(entry["median_tokens_per_s"])}))
    dest = Path(__file__).parent / "results" / "bench-harness-cost.json"
    dest.parent.mkdir(exist_ok=True)
    dest.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
