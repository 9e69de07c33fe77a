"""How close ``plan()``'s memory estimate is to what the engines really take, on this machine.

For each tiny model (small ~2 MB, bench ~50 MB) and context size, a fresh process imports the
engine, measures its resident memory (RSS), loads the model through unillm, runs a one-token
request (so compute buffers exist) and measures again; the difference is what loading cost. MLX
also reports its peak memory. The plan's total (weights + KV at that context + overhead) is set
beside it, with the ratio plan / measured.

    python benchmarks/plan_vs_actual.py [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PROBE = r"""
import json, sys
backend, path, ctx = sys.argv[1], sys.argv[2], int(sys.argv[3])
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
if backend == "llama.cpp":
    import llama_cpp  # noqa: F401
else:
    import mlx.core as mx, mlx_lm  # noqa: F401
import unillm
before = rss()
opts = {"batch_size": 1} if backend == "mlx" else {}
engine = unillm.auto_engine(path, backend=backend, context_length=ctx, options=opts)
engine.generate("hello", max_tokens=1, temperature=0)
peak = None
if backend == "mlx":
    peak = int(mx.get_peak_memory())
print(json.dumps({"rss_delta": rss() - before, "peak": peak}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="512,4096,32768")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    from unillm import Workload, detect_hardware, inspect_model, plan
    from unillm.testing import tiny_model

    hw = detect_hardware()
    rows = []
    for size in ("small", "bench"):
        model = tiny_model(size)  # type: ignore[arg-type]
        for backend, path in (("llama.cpp", model.gguf_path), ("mlx", model.hf_dir)):
            info = inspect_model(path)
            for ctx in (int(c) for c in args.contexts.split(",")):
                p = plan(info, hw, Workload(context_length=ctx))
                out = subprocess.run(
                    [sys.executable, "-c", PROBE, backend, str(path), str(ctx)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                measured = json.loads(out.stdout.strip().splitlines()[-1])
                row = {
                    "model": size,
                    "backend": backend,
                    "context": ctx,
                    "plan_total": p.total_bytes,
                    "plan_weights": p.weights_bytes,
                    "plan_kv": p.kv_bytes,
                    "plan_overhead": p.overhead_bytes,
                    "rss_delta": measured["rss_delta"],
                    "mlx_peak": measured["peak"],
                }
                row["ratio_plan_to_rss"] = p.total_bytes / max(measured["rss_delta"], 1)
                rows.append(row)
                mib = 2**20
                peak = f"  mlx peak {measured['peak'] / mib:7.1f} MiB" if measured["peak"] else ""
                print(
                    f"{size:5s} {backend:9s} ctx {ctx:6d}: plan {p.total_bytes / mib:7.1f} MiB "
                    f"(weights {p.weights_bytes / mib:.1f}, kv {p.kv_bytes / mib:.1f}, overhead "
                    f"{p.overhead_bytes / mib:.1f}); RSS +{measured['rss_delta'] / mib:7.1f} MiB{peak}; "
                    f"plan/RSS {row['ratio_plan_to_rss']:.2f}"
                )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
