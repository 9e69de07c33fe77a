"""What continuous batching buys on llama.cpp, in process: 1, 4 and 8 concurrent streams.

One process, the same GGUF, the same settings on every side: context 1024 per sequence, f16 KV,
n_batch 512, threads = the cores, every request exactly 128 tokens (greedy, ignore_eos), distinct
prompts. Contenders, each at 1, 4 and 8 streams started together on threads:

- ``batch``: unillm's llama.cpp engine with ``parallel=8`` (one context, one llama_decode a step);
- ``serial``: unillm's engine with ``parallel=1`` (requests run one after another under its lock);
- ``raw``: llama-cpp-python used directly, the leanest loop (``Llama.eval`` of the prompt, then a
  greedy sampler and ``Llama.eval`` of each token), requests one after another: the single-stream
  reference, and what a plain llama-cpp-python user gets under concurrency.

Each level's streams run on threads started for it, as a server's workers are; ``<name>-main`` is
one stream on the main thread, a script's way and the leanest for the one-sequence paths:
llama-cpp-python's CPU build runs OpenMP, and every thread that calls ``llama_decode`` gets a pool
of its own (the batching engine decodes on its one worker thread either way).

Rounds interleave (who goes first rotates). Aggregate throughput = generated tokens / (first
submit -> last token); TTFT per stream = its first token - the common start. Models: the tiny
bench model (~50 MB) and, with ``--large``, a ~125M-parameter Llama of random weights (f32 GGUF,
~400 MB) the builders write. Goals (issue 28): batch >= 2x serial at 8 streams on the bench model;
batch at 1 stream >= 0.99x raw. The server-level comparison with llama-cpp-python's server and
xllamacpp is ``unillm bench --servers``.

    python benchmarks/batching_llamacpp.py [--rounds 5] [--large] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
from pathlib import Path
from time import perf_counter
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _common import large_model, machine, tiny_bench_model

TOKENS = 128
LEVELS = (1, 4, 8)
CONTEXT = 1024
PROMPTS = [f"Story {i}: once upon a time, a small model number {i} wanted to tell stories." for i in range(8)]


def run_main(generate: Any) -> dict[str, Any]:
    """One prompt on this (long-lived) thread: the leanest single stream."""
    t0 = perf_counter()
    first, count = 0.0, 0
    for k, _ in enumerate(generate(PROMPTS[0])):
        if k == 0:
            first = perf_counter()
        count += 1
    end = perf_counter()
    if count != TOKENS:
        sys.exit(f"the stream produced {count} tokens, want {TOKENS}")
    return {"tok_s": TOKENS / (end - t0), "ttft_p50_s": first - t0, "ttft_max_s": first - t0}


def run_streams(generate: Any, n: int) -> dict[str, Any]:
    """``n`` prompts on threads started together; aggregate tok/s and TTFT of each."""
    firsts: list[float] = [0.0] * n
    counts = [0] * n
    start = threading.Barrier(n + 1)

    def one(i: int) -> None:
        start.wait()
        for k, _ in enumerate(generate(PROMPTS[i])):
            if k == 0:
                firsts[i] = perf_counter()
            counts[i] += 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    start.wait()
    t0 = perf_counter()
    for t in threads:
        t.join()
    end = perf_counter()
    if counts != [TOKENS] * n:
        sys.exit(f"streams produced {counts} tokens, want {TOKENS} each")
    ttft = sorted(f - t0 for f in firsts)
    return {"tok_s": n * TOKENS / (end - t0), "ttft_p50_s": statistics.median(ttft), "ttft_max_s": ttft[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--large", action="store_true", help="also the ~125M-parameter model")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import llama_cpp
    from llama_cpp._internals import LlamaSampler

    from unillm import SamplingParams
    from unillm.engines.llamacpp import LlamaCppEngine
    from unillm.testing import tiny_model

    cores = os.cpu_count() or 1
    models = {"bench": tiny_model("bench")}
    if args.large:
        models["large"] = large_model()
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    common = {"n_threads": cores, "n_threads_batch": cores, "n_batch": 512, "seed": 0}
    report: dict[str, Any] = {"machine": machine("llama-cpp-python"), "tokens": TOKENS, "models": {}}
    for name, model in models.items():
        path = str(model.gguf_path)
        batch = LlamaCppEngine(model=path, context_length=CONTEXT, options={**common, "parallel": 8}).load()
        serial = LlamaCppEngine(model=path, context_length=CONTEXT, options={**common, "parallel": 1}).load()
        raw = llama_cpp.Llama(
            model_path=path, n_ctx=CONTEXT, n_threads=cores, n_threads_batch=cores, verbose=False
        )
        raw_lock = threading.Lock()

        def raw_generate(prompt: str, raw: Any = raw, lock: threading.Lock = raw_lock) -> Any:
            with lock:  # llama-cpp-python's Llama is one sequence: callers take turns
                ids = raw.tokenize(prompt.encode(), add_bos=True, special=True)
                raw.reset()
                raw.eval(ids)
                sampler = LlamaSampler()
                sampler.add_greedy()
                for _ in range(TOKENS):
                    tok = sampler.sample(raw._ctx, -1)
                    yield tok
                    raw.eval([tok])
                sampler.close()

        def via(engine: Any) -> Any:
            def generate(prompt: str) -> Any:
                for chunk in engine.stream(prompt, greedy):
                    yield from chunk.token_ids

            return generate

        contenders = {"batch": via(batch), "serial": via(serial), "raw": raw_generate}
        samples: dict[tuple[str, int], list[dict[str, Any]]] = {}
        names = list(contenders)
        for r in range(args.rounds):
            for who in names[r % len(names) :] + names[: r % len(names)]:
                for n in LEVELS:
                    samples.setdefault((who, n), []).append(run_streams(contenders[who], n))
                # one stream on the main thread, the way a script calls it: no thread of its own
                samples.setdefault((f"{who}-main", 1), []).append(run_main(contenders[who]))
        table: dict[str, Any] = {}
        for (who, n), runs in samples.items():
            table[f"{who}@{n}"] = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        ratios = {
            f"batch/serial@{n}": statistics.median(
                b["tok_s"] / s["tok_s"]
                for b, s in zip(samples[("batch", n)], samples[("serial", n)], strict=True)
            )
            for n in LEVELS
        }
        ratios["batch/raw@1"] = statistics.median(
            b["tok_s"] / r["tok_s"] for b, r in zip(samples[("batch", 1)], samples[("raw", 1)], strict=True)
        )
        ratios["batch-main/raw-main@1"] = statistics.median(
            b["tok_s"] / r["tok_s"]
            for b, r in zip(samples[("batch-main", 1)], samples[("raw-main", 1)], strict=True)
        )
        ratios["serial-main/raw-main@1"] = statistics.median(
            b["tok_s"] / r["tok_s"]
            for b, r in zip(samples[("serial-main", 1)], samples[("raw-main", 1)], strict=True)
        )
        report["models"][name] = {
            "model": tiny_bench_model(model, gguf=True),
            "medians": table,
            "paired": ratios,
        }
        print(f"== {name} ({model.spec.n_params / 1e6:.0f}M parameters), medians of {args.rounds} rounds")
        for key, row in table.items():
            print(f"  {key:10s} {row['tok_s']:7.0f} tok/s  TTFT p50 {row['ttft_p50_s'] * 1000:6.0f} ms")
        for key, value in ratios.items():
            print(f"  {key:16s} {value:.2f}x (paired, median)")
        batch.close()
        serial.close()
        raw.close()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
