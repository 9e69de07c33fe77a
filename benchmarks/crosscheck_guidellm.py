"""Cross-check `unillm bench --url` against guidellm, a load generator no one here wrote.

Both tools drive the same llama-cpp-python server (``python -m llama_cpp.server``, loopback) on the
tiny ``bench`` model's GGUF with the same workload: the same prompts (one JSONL file both read:
128 tokens each under the model's own tokenizer), the same output length asked (64, with
``ignore_eos``, which this server does not read: see the note below), greedy, streamed
completions, closed loop at each concurrency, the same request count, no warm-up inside either
tool (the server is warmed once before the first round). Runs are interleaved A B, B A, ... per
level, so a shared machine's drift falls on both tools alike.

Per level and tool it reads each tool's own JSON and puts side by side: completed requests, output
tokens counted, output tok/s, TTFT p50, TPOT/ITL p50 (each tool's own figures), and the same
figures recomputed from guidellm's per-request timings with unillm's definitions, which separates
a difference of definition from a difference of measurement. Writes
``benchmarks/results/crosscheck-guidellm.json``.

    python benchmarks/crosscheck_guidellm.py [--requests 16] [--concurrency 1,4] [--rounds 2]
        [--input-len 128] [--output-len 64] [--json benchmarks/results/crosscheck-guidellm.json]

guidellm comes from its own environment (``scripts/loadgen.sh`` builds it and prints its
interpreter; ``--loadgen-python`` to pass one). llama-cpp-python's server needs its ``[server]``
extra (``starlette-context``, ``sse-starlette``, ``pydantic-settings``) in this interpreter.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from _common import ROOT, checkout_unillm, free_port

RESULT = ROOT / "benchmarks" / "results" / "crosscheck-guidellm.json"
SERVED = "tiny-bench"  # the model alias the server is started with and both tools send
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

# ---- the outside tool's environment ----


def loadgen_python() -> str:
    """The interpreter of guidellm's own environment (scripts/loadgen.sh builds it once)."""
    proc = subprocess.run(
        [str(ROOT / "scripts" / "loadgen.sh")], capture_output=True, text=True, timeout=3600, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/loadgen.sh failed:\n{proc.stderr[-4000:]}")
    return proc.stdout.strip().splitlines()[-1]


def guidellm_bin(python: str) -> str:
    return str(Path(python).parent / "guidellm")


def version_in(python: str, package: str) -> str | None:
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, timeout=120)
        return done.stdout.strip()
    return None


# ---- the server ----


class LlamaServer:
    """llama-cpp-python's own server on loopback; a context manager that kills what it started."""

    def __init__(
        self, gguf: Path, *, n_ctx: int = 2048, n_threads: int | None = None, log: Path | None = None
    ):
        self.port = free_port()
        self.argv = [
            sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", SERVED,
            "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", str(n_ctx),
            "--interrupt_requests", "False",
        ]  # fmt: skip
        if n_threads:
            self.argv += ["--n_threads", str(n_threads)]
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LlamaServer:
        out = open(self.log, "wb") if self.log else subprocess.DEVNULL
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited with {self.proc.returncode} (log: {self.log})")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.root + "/v1/models", timeout=2.0).status_code == 200:
                    self.startup_s = time.perf_counter() - t0
                    return self
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError("llama_cpp.server did not answer /v1/models within 300 s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def complete(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        """One unstreamed greedy completion: the server's own usage (what it really generated)."""
        body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        return httpx.post(self.root + "/v1/completions", json=body, timeout=300).json()


# ---- the workload, one file both tools read ----


def candidate_prompts(hf_dir: Path, count: int, input_len: int, seed: int = 0) -> list[str]:
    """``count`` prompts of exactly ``input_len`` tokens, built by unillm's exact-length builder
    with the model's own tokenizer."""
    from unillm.bench import Workload
    from unillm.bench._prompts import HFTokenizer, Prompts

    tok = HFTokenizer(hf_dir)
    prompts = Prompts(
        Workload(input_len=input_len, requests=count, seed=seed), tok, vocab_size=tok.vocab_size
    )
    out = []
    for i in range(count):
        req = prompts.get(i)
        if req.input_tokens != input_len:
            raise RuntimeError(f"prompt {i} is {req.input_tokens} tokens, not {input_len}")
        out.append(req.prompt)
    return out


def screen(
    srv: LlamaServer, candidates: list[str], n: int, output_len: int
) -> tuple[list[str], dict[str, Any]]:
    """The first ``n`` candidates whose greedy completion runs to ``output_len`` tokens without
    meeting an end-of-sequence token (the server's own usage, unstreamed). llama-cpp-python's
    server does not read ``ignore_eos``; this makes the asked length the real one, the same for
    both tools."""
    kept, stopped = [], 0
    for prompt in candidates:
        done = srv.complete(prompt, output_len)
        if (
            done["choices"][0]["finish_reason"] == "length"
            and done["usage"]["completion_tokens"] == output_len
        ):
            kept.append(prompt)
            if len(kept) == n:
                break
        else:
            stopped += 1
    if len(kept) < n:
        raise RuntimeError(
            f"only {len(kept)} of {len(candidates)} prompts run to {output_len} tokens; need {n}"
        )
    return kept, {"screened": len(kept) + stopped, "stopped_early_dropped": stopped, "kept": n}


def write_prompts(prompts: list[str], input_len: int, output_len: int, path: Path) -> None:
    """One JSONL file both tools read: the prompt, and the output length in each one's column."""
    rows = [
        {
            "prompt": p,
            "output_tokens": output_len,  # unillm's prompts_jsonl column
            "output_tokens_count": output_len,  # guidellm's generative column mapper
            "prompt_tokens_count": input_len,
        }
        for p in prompts
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


# ---- the two tools ----


def run_unillm(
    url: str, prompts: Path, hf_dir: Path, concurrency: int, requests: int, output_len: int, out_dir: Path
) -> tuple[dict[str, Any], float, list[str], float]:
    """`unillm bench run --url` at one concurrency; its result document, wall seconds, argv and
    the CPU seconds the tool's process spent (startup included)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    workload = out_dir / "workload.toml"
    workload.write_text(
        "[workload]\n"
        'name = "crosscheck-guidellm"\n'
        f'prompts_jsonl = "{prompts}"\n'
        f"output_len = {output_len}\n"
        f"requests = {requests}\n"
        f"concurrency = [{concurrency}]\n"
        'mode = "completion"\nstream = true\nwarmup = 0\ntemperature = 0.0\n',
        encoding="utf-8",
    )
    argv, env = checkout_unillm()
    argv += [
        "bench", "run", "--url", url + "/v1", "--workload", str(workload), "--model-path", str(hf_dir.parent),
        "--served-model", SERVED, "--engine", "llama-cpp-python server",
        "--engine-version", md.version("llama-cpp-python"), "--out", str(out_dir), "--no-plots",
    ]  # fmt: skip
    t0, c0 = time.perf_counter(), _children_cpu()
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=1800, check=False, env={**os.environ, **env}
    )
    wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
    if proc.returncode != 0:
        raise RuntimeError(f"unillm bench failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    files = sorted(out_dir.glob("bench-*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise RuntimeError(f"unillm bench wrote no result under {out_dir}:\n{proc.stdout[-2000:]}")
    return json.loads(files[-1].read_text()), wall, argv, cpu


def run_guidellm(
    exe: str, url: str, prompts: Path, hf_dir: Path, concurrency: int, requests: int, out_json: Path
) -> tuple[dict[str, Any], float, list[str], float]:
    """guidellm at one concurrency (its `concurrent` profile), same prompts and request count."""
    argv = [
        exe, "run",
        "--backend",
        f"kind=openai_http,target={url},model={SERVED},validate_backend=false,"
        "request_format=/v1/completions,extras.body.temperature=0.0",
        "--profile", f"kind=concurrent,streams={concurrency}",
        "--constraint", f"kind=max_requests,count={requests}",
        "--data", f"kind=json_file,path={prompts}",
        "--tokenizer", f"kind=huggingface_auto,model={hf_dir}",
        "--output", f"kind=json,path={out_json}",
        "--disable-console-interactive",
    ]  # fmt: skip
    env = {**os.environ, **OFFLINE_ENV, "HF_DATASETS_CACHE": str(out_json.parent / "hf-datasets")}
    t0, c0 = time.perf_counter(), _children_cpu()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False, env=env)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
    if proc.returncode != 0 or not out_json.exists():
        raise RuntimeError(f"guidellm failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(out_json.read_text()), wall, argv, cpu


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's waited-for children: a tool's own cost."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


# ---- reading both tools' JSON ----


def percentile(xs: list[float], p: float) -> float | None:
    """Linear interpolation between order statistics (numpy's default; unillm's definition)."""
    from unillm.bench import percentile as pct

    return pct(xs, p)


def unillm_figures(result: dict[str, Any]) -> dict[str, Any]:
    level = result["levels"][0]
    s = level["summary"]
    records = [r for r in level["records"] if r.get("error") is None and r.get("end") is not None]
    return {
        "requests_completed": s["completed"],
        "errors": s["errors"],
        "output_tokens": s["output_tokens"],
        "output_tokens_per_request": sorted({r["output_tokens"] for r in records}),
        "wall_s": s["wall_s"],
        "output_tok_s": s["output_tokens_per_s"],
        "requests_s": s["requests_per_s"],
        "ttft_p50_ms": _ms(s["ttft"]["p50"]),
        "ttft_mean_ms": _ms(s["ttft"]["mean"]),
        "tpot_p50_ms": _ms(s["tpot"]["p50"]),  # (E2E - TTFT) / (out - 1)
        "itl_p50_ms": _ms(s["itl"]["p50"]),  # every gap between token chunks
        "e2e_p50_ms": _ms(s["e2e"]["p50"]),
        "output_len_mismatches": s["output_len_mismatches"],
        # per request, seconds from the level's start: (send, first token, end, tokens counted)
        "records": [
            [
                round(r["send"], 4),
                round(r["chunk_times"][0], 4) if r["chunk_times"] else None,
                round(r["end"], 4),
                r["output_tokens"],
            ]
            for r in sorted(records, key=lambda r: r["send"])
        ],
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000.0


def _stat(metrics: dict[str, Any], key: str, stat: str) -> float | None:
    summary = (metrics.get(key) or {}).get("successful") or {}
    if stat in ("p50", "p90", "p99"):
        return (summary.get("percentiles") or {}).get(stat)
    return summary.get(stat)


def guidellm_figures(report: dict[str, Any]) -> dict[str, Any]:
    """guidellm's own figures (its first benchmark, successful requests), and the same figures
    recomputed from its per-request timings under unillm's definitions."""
    bench = report["benchmarks"][0]
    m = bench["metrics"]
    reqs = (bench.get("requests") or {}).get("successful") or []
    own = {
        "requests_completed": (m.get("request_totals") or {}).get("successful"),
        "errors": (m.get("request_totals") or {}).get("errored"),
        "output_tokens": _stat(m, "output_token_count", "total_sum"),
        "duration_s": bench.get("duration"),
        "output_tok_s": _stat(m, "output_tokens_per_second", "mean"),
        "requests_s": _stat(m, "requests_per_second", "mean"),
        "ttft_p50_ms": _stat(m, "time_to_first_token_ms", "p50"),
        "ttft_mean_ms": _stat(m, "time_to_first_token_ms", "mean"),
        "itl_p50_ms": _stat(m, "inter_token_latency_ms", "p50"),  # (last - first token) / (out - 1)
        "tpot_p50_ms": _stat(m, "time_per_output_token_ms", "p50"),  # (last token - start) / out
        "e2e_p50_ms": _ms(_stat(m, "request_latency", "p50")),
    }
    own["output_tokens_per_request"] = sorted(
        {int(r["output_tokens"]) for r in reqs if r.get("output_tokens")}
    )
    # unillm's definitions over guidellm's own per-request timings
    ttft, tpot, e2e, out, starts, ends = [], [], [], 0, [], []
    for r in reqs:
        t = r["info"]["timings"]
        start, first, end = t.get("request_start"), t.get("first_token_iteration"), t.get("request_end")
        n = int(r.get("output_tokens") or 0)
        if start is None or end is None:
            continue
        out += n
        starts.append(start)
        ends.append(end)
        e2e.append(end - start)
        if first is not None:
            ttft.append(first - start)
            if n > 1:
                tpot.append((end - first) / (n - 1))
    wall = (max(ends) - min(starts)) if ends else None
    recomputed = {
        "output_tokens": out,
        "wall_s": wall,
        "output_tok_s": out / wall if wall else None,
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "tpot_p50_ms": _ms(percentile(tpot, 50)),
        "e2e_p50_ms": _ms(percentile(e2e, 50)),
    }
    t0 = min(starts) if starts else 0.0
    own["records"] = sorted(
        [
            round(t["request_start"] - t0, 4),
            round(t["first_token_iteration"] - t0, 4) if t.get("first_token_iteration") else None,
            round(t["request_end"] - t0, 4),
            int(r.get("output_tokens") or 0),
        ]
        for r in reqs
        if (t := r["info"]["timings"]).get("request_start") is not None and t.get("request_end") is not None
    )
    return {"own": own, "as_unillm": recomputed}


# ---- the run ----

COMPARED = (  # (label, unillm figure, guidellm figure, where guidellm's comes from)
    ("requests completed", "requests_completed", ("own", "requests_completed")),
    ("output tokens counted", "output_tokens", ("own", "output_tokens")),
    ("output tok/s", "output_tok_s", ("own", "output_tok_s")),
    ("TTFT p50 ms", "ttft_p50_ms", ("own", "ttft_p50_ms")),
    ("TPOT p50 ms vs guidellm's ITL p50 (both: first token excluded)", "tpot_p50_ms", ("own", "itl_p50_ms")),
    ("TPOT p50 ms vs guidellm's TPOT p50 (its: first token included)", "tpot_p50_ms", ("own", "tpot_p50_ms")),
    ("output tok/s, its timings, unillm's definition", "output_tok_s", ("as_unillm", "output_tok_s")),
    ("TTFT p50 ms, its timings, unillm's definition", "ttft_p50_ms", ("as_unillm", "ttft_p50_ms")),
    ("TPOT p50 ms, its timings, unillm's definition", "tpot_p50_ms", ("as_unillm", "tpot_p50_ms")),
)  # fmt: skip


def compare(u: list[dict[str, Any]], g: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure: the median over rounds of each tool, and their ratio unillm / guidellm."""
    out = {}
    for label, ukey, (gpart, gkey) in COMPARED:
        uv = [x[ukey] for x in u if x.get(ukey) is not None]
        gv = [x[gpart][gkey] for x in g if x[gpart].get(gkey) is not None]
        um = statistics.median(uv) if uv else None
        gm = statistics.median(gv) if gv else None
        out[label] = {
            "unillm": um,
            "guidellm": gm,
            "ratio_unillm_over_guidellm": um / gm if um is not None and gm else None,
            "unillm_rounds": uv,
            "guidellm_rounds": gv,
        }
    return out


def load_avg() -> float | None:
    with contextlib.suppress(OSError):
        return os.getloadavg()[0]
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--rounds", type=int, default=2, help="A B rounds per level (the order alternates)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument(
        "--n-threads",
        type=int,
        default=1,
        help="llama.cpp threads in the server (1: two threads on a busy 2-core machine wait on each other)",
    )
    ap.add_argument("--loadgen-python", help="guidellm's interpreter (default: scripts/loadgen.sh)")
    ap.add_argument("--json", type=Path, default=RESULT)
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]

    from unillm.testing import tiny_model

    sys.path.insert(0, str(Path(__file__).parent))
    from _common import machine, tiny_bench_model

    py = args.loadgen_python or loadgen_python()
    exe = guidellm_bin(py)
    model = tiny_model("bench")
    with tempfile.TemporaryDirectory(prefix="unillm-crosscheck-") as tmp_s:
        tmp = Path(tmp_s)
        prompts = tmp / "prompts.jsonl"
        candidates = candidate_prompts(model.hf_dir, 6 * args.requests, args.input_len)
        with LlamaServer(model.gguf_path, n_threads=args.n_threads, log=tmp / "server.log") as srv:
            print(f"llama_cpp.server ready in {srv.startup_s:.1f} s on {srv.root}", flush=True)
            # the server warms up here too: every kept prompt has been through it once
            kept, screening = screen(srv, candidates, args.requests, args.output_len)
            write_prompts(kept, args.input_len, args.output_len, prompts)
            print(f"prompts: {screening}", flush=True)
            runs: dict[int, dict[str, list[dict[str, Any]]]] = {
                c: {"unillm": [], "guidellm": []} for c in levels
            }
            log: list[dict[str, Any]] = []
            for rnd in range(args.rounds):
                for c in levels:
                    order = ("unillm", "guidellm") if rnd % 2 == 0 else ("guidellm", "unillm")
                    for tool in order:
                        la = load_avg()
                        started = time.time()
                        if tool == "unillm":
                            res, wall, cmd, cpu = run_unillm(
                                srv.root, prompts, model.hf_dir, c, args.requests, args.output_len,
                                tmp / f"unillm-{c}-{rnd}",
                            )  # fmt: skip
                            figs = unillm_figures(res)
                        else:
                            rep, wall, cmd, cpu = run_guidellm(
                                exe,
                                srv.root,
                                prompts,
                                model.hf_dir,
                                c,
                                args.requests,
                                tmp / f"guidellm-{c}-{rnd}.json",
                            )
                            figs = guidellm_figures(rep)
                        runs[c][tool].append(figs)
                        own = figs if tool == "unillm" else figs["own"]
                        log.append(
                            {
                                "round": rnd, "concurrency": c, "tool": tool, "started": started,
                                "wall_s": round(wall, 2), "tool_cpu_s": round(cpu, 2), "load_avg_1m": la,
                                "command": shlex.join(cmd),
                            }
                        )  # fmt: skip
                        print(
                            f"round {rnd} c={c} {tool:8s} {own['output_tok_s']:7.1f} tok/s  "
                            f"TTFT p50 {own['ttft_p50_ms']:7.1f} ms  tokens {own['output_tokens']}  "
                            f"requests {own['requests_completed']} (tool wall {wall:.1f} s, CPU {cpu:.1f} s, "
                            f"load {la})",
                            flush=True,
                        )
        versions = {
            "unillm": md.version("unillm"),
            "llama-cpp-python": md.version("llama-cpp-python"),
            "guidellm": version_in(py, "guidellm"),
            "torch (guidellm's env)": version_in(py, "torch"),
            "transformers (guidellm's env)": version_in(py, "transformers"),
            "httpx (unillm's env)": md.version("httpx"),
            "httpx (guidellm's env)": version_in(py, "httpx"),
        }
    result = {
        "what": "unillm bench --url vs guidellm run, same llama-cpp-python server, same prompts file",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "versions": versions,
        "model": tiny_bench_model(model, gguf=True),
        "server": {"command": shlex.join([*srv.argv[:3], "...", *srv.argv[5:]]), "startup_s": srv.startup_s},
        "workload": {
            "prompt_tokens": args.input_len,
            "output_tokens_asked": args.output_len,
            "requests_per_level": args.requests,
            "concurrency": levels,
            "rounds": args.rounds,
            "order": "per level, A B in even rounds and B A in odd ones (interleaved: drift falls on both)",
            "sampling": "greedy (temperature 0), ignore_eos and max_tokens sent by both tools",
            "warmup": "none inside either tool; the screening sent each prompt through the server first",
        },
        "prompts": {
            **screening,
            "why": "llama-cpp-python's server ignores ignore_eos; prompts whose greedy completion "
            "meets EOS before the asked length are dropped, so every kept request really generates "
            f"{args.output_len} tokens (the server's usage, unstreamed) for both tools",
            "server_tokens_per_level": args.output_len * args.requests,
        },
        "levels": {
            str(c): {"compare": compare(runs[c]["unillm"], runs[c]["guidellm"]), "runs": runs[c]}
            for c in levels
        },
        "log": log,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print_table(result)
    print(f"wrote {args.json}")
    return 0


def print_table(result: dict[str, Any]) -> None:
    for c, level in result["levels"].items():
        print(f"\nconcurrency {c}")
        print(f"  {'figure':66s} {'unillm':>10s} {'guidellm':>10s} {'ratio':>7s}")
        for label, row in level["compare"].items():
            u, g, r = row["unillm"], row["guidellm"], row["ratio_unillm_over_guidellm"]
            print(f"  {label:66s} {_f(u):>10s} {_f(g):>10s} {_f(r, 3):>7s}")


def _f(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


if __name__ == "__main__":
    raise SystemExit(main())
