#!/usr/bin/env bash
# Fuzz the model-header readers by hand, far past what CI runs (tests/test_fuzz_headers.py).
#
# The mutators of tests/test_fuzz_headers.py rewrite the tiny model's GGUF header, safetensors
# header and config.json, and every reader runs on each result. Inputs run in subprocesses, a chunk
# at a time, under RLIMIT_AS = what the worker already maps + FUZZ_MEMORY_MIB: an allocation past
# that is a MemoryError, reported as an untyped exception like any other non-UnillmError, and a
# crash or hang of the interpreter is caught by the parent and reported with its input range.
#
#   scripts/fuzz.sh [EXECUTIONS]         default 100000 inputs
#   scripts/fuzz.sh --repro NAME:INDEX   rerun one input (from a report) with its traceback
#
# Environment: FUZZ_SEED (0), FUZZ_JOBS (1 worker at a time), FUZZ_CHUNK (2000 inputs a worker),
# FUZZ_MEMORY_MIB (64), FUZZ_TRACE_EVERY (25: trace allocations of every 25th input; 1 for all),
# FUZZ_HYPOTHESIS (0: else also run the hypothesis tests with this many examples each), PYTHON.
# Prints executions, untyped exceptions (must be 0), the slowest input, the largest traced
# allocation and any file descriptors left open; exits 1 if anything is wrong.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

if [ "${FUZZ_HYPOTHESIS:-0}" != 0 ]; then
    UNILLM_FUZZ_EXAMPLES=$FUZZ_HYPOTHESIS "$PYTHON" -m pytest tests/test_fuzz_headers.py -q -x -p no:cacheprovider
fi

# the driver runs from a file: its workers are the same script, started again with --worker
DRIVER=$(mktemp "${TMPDIR:-/tmp}/unillm-fuzz-XXXXXX.py")
trap 'rm -f "$DRIVER"' EXIT
cat > "$DRIVER" <<'PY'
from __future__ import annotations

import json
import os
import pickle
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, os.getcwd())
from tests import test_fuzz_headers as fuzz  # the mutators and targets

NAMES = list(fuzz.TARGETS)


def one_input(seeds: fuzz.Seeds, base: int, i: int) -> tuple[str, bytes]:
    """Input ``i``: the same bytes for the same (FUZZ_SEED, i) on every run."""
    rng = random.Random(base * 1_000_003 + i)
    name = NAMES[i % len(NAMES)]
    fields = seeds.gguf_fields if name == "gguf" else ()
    data = fuzz.TARGETS[name][1](seeds)
    for _ in range(1 + (rng.random() < 0.25)):  # sometimes a mutant of a mutant
        data = fuzz.mutate(data, rng, fields, fuzz.JSON_AT[name])
    return name, data


def worker(seeds_file: str, work: str, base: int, start: int, end: int, memory_mib: int, every: int) -> None:
    seeds = pickle.loads(Path(seeds_file).read_bytes())
    work_dir = Path(work)
    for name in NAMES:
        (work_dir / name).mkdir(exist_ok=True)
    with open("/proc/self/status") as f:  # what this interpreter already maps, plus the headroom
        mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = mapped + memory_mib * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    fds = len(os.listdir("/proc/self/fd"))
    stats = {"inputs": 0, "calls": 0, "slowest_s": 0.0, "slowest": None, "peak_bytes": 0, "peak": None}
    untyped = []
    for i in range(start, end):
        name, data = one_input(seeds, base, i)
        calls = fuzz.TARGETS[name][0](work_dir / name, data, seeds)
        traced = i % every == 0
        if traced:
            tracemalloc.start()
        try:
            seconds = fuzz.check(calls)
        except Exception as exc:  # MemoryError included: an allocation over the limit
            seconds = 0.0
            untyped.append({"input": f"{name}:{i}", "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
        if traced:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            if peak > stats["peak_bytes"]:
                stats["peak_bytes"], stats["peak"] = peak, f"{name}:{i}"
        if seconds > stats["slowest_s"]:
            stats["slowest_s"], stats["slowest"] = seconds, f"{name}:{i}"
        stats["inputs"] += 1
        stats["calls"] += len(calls)
    stats["leaked_fds"] = len(os.listdir("/proc/self/fd")) - fds
    stats["untyped"] = untyped
    print(json.dumps(stats))


def repro(seeds_file: str, work: str, base: int, which: str) -> None:
    seeds = pickle.loads(Path(seeds_file).read_bytes())
    name, index = which.split(":")
    got, data = one_input(seeds, base, int(index))
    assert got == name, f"input {index} is a {got} input"
    (Path(work) / name).mkdir(parents=True, exist_ok=True)
    for call in fuzz.TARGETS[name][0](Path(work) / name, data, seeds):
        t0 = time.perf_counter()
        try:
            call()
            print(f"returned in {time.perf_counter() - t0:.3f} s")
        except fuzz.UnillmError as exc:
            print(f"{type(exc).__name__} in {time.perf_counter() - t0:.3f} s: {exc}")
        except BaseException:
            traceback.print_exc()
    print(f"the input ({len(data)} bytes) is in {Path(work) / name}")


def main() -> int:
    args = sys.argv[1:]
    base = int(os.environ.get("FUZZ_SEED", "0"))
    if args and args[0] == "--worker":  # started by run(): the seeds are in FUZZ_DIR
        seeds_file = Path(os.environ["FUZZ_DIR"]) / "seeds.pickle"
        work, *numbers = args[1:]
        worker(str(seeds_file), work, *map(int, numbers))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still clean up (the finally below)
    shm = Path("/dev/shm")  # the inputs are written to files: a RAM disk where there is one
    root = Path(tempfile.mkdtemp(prefix="unillm-fuzz-", dir=shm if shm.is_dir() else None))
    seeds_file = root / "seeds.pickle"
    seeds_file.write_bytes(pickle.dumps(fuzz.load_seeds(root / "tiny")))
    if args and args[0] == "--repro":
        repro(str(seeds_file), str(root / "repro"), base, args[1])
        return 0
    try:
        return run(root, base, int(args[0]) if args else int(os.environ.get("FUZZ_EXECUTIONS", "100000")))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(root: Path, base: int, total: int) -> int:
    jobs, chunk = int(os.environ.get("FUZZ_JOBS", "1")), int(os.environ.get("FUZZ_CHUNK", "2000"))
    memory_mib, every = (
        int(os.environ.get("FUZZ_MEMORY_MIB", "64")),
        int(os.environ.get("FUZZ_TRACE_EVERY", "25")),
    )
    env = {**os.environ, "FUZZ_DIR": str(root)}
    pending = [(s, min(s + chunk, total)) for s in range(0, total, chunk)]
    running: list[tuple[subprocess.Popen[str], tuple[int, int], float]] = []
    results, problems = [], []
    t0 = time.time()
    try:
        supervise(root, base, pending, running, results, problems, memory_mib, every, env, jobs, t0)
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C or SIGTERM: report what was done
        problems.append("interrupted: the figures above cover the finished chunks only")
    finally:
        for proc, _, _ in running:
            proc.kill()
    return report(results, problems, base, every, memory_mib, t0)


def supervise(
    root: Path,
    base: int,
    pending: list[tuple[int, int]],
    running: list[tuple[subprocess.Popen[str], tuple[int, int], float]],
    results: list[dict[str, Any]],
    problems: list[str],
    memory_mib: int,
    every: int,
    env: dict[str, str],
    jobs: int,
    t0: float,
) -> None:
    """Start a worker per chunk of inputs, ``jobs`` at a time; collect what each reports."""
    while pending or running:
        while pending and len(running) < jobs:
            start, end = pending.pop(0)
            work = root / f"w{start}"
            work.mkdir(exist_ok=True)
            cmd = [sys.executable, __file__, "--worker", str(work), str(base), str(start), str(end)]
            cmd += [str(memory_mib), str(every)]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
            running.append((proc, (start, end), time.time()))
        for item in list(running):
            proc, (start, end), began = item
            if proc.poll() is None:
                if time.time() - began > 1.0 * (end - start) + 60:  # a second an input is a hang
                    proc.kill()
                    problems.append(f"inputs {start}..{end}: a worker hung; rerun them with --repro")
                    running.remove(item)
                continue
            running.remove(item)
            out = proc.stdout.read() if proc.stdout else ""
            shutil.rmtree(root / f"w{start}", ignore_errors=True)
            if proc.returncode != 0:
                problems.append(f"inputs {start}..{end}: the worker died (exit {proc.returncode})")
                continue
            results.append(json.loads(out.strip().splitlines()[-1]))
            done = sum(r["inputs"] for r in results)
            print(f"  {done} inputs, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        time.sleep(0.05)


def report(
    results: list[dict[str, Any]], problems: list[str], base: int, every: int, memory_mib: int, t0: float
) -> int:
    inputs, calls = sum(r["inputs"] for r in results), sum(r["calls"] for r in results)
    untyped = [u for r in results for u in r["untyped"]]
    slowest = max(results, key=lambda r: r["slowest_s"], default=None)
    peak = max(results, key=lambda r: r["peak_bytes"], default=None)
    leaked = sum(r["leaked_fds"] for r in results)
    print(f"inputs: {inputs} ({calls} reader calls) in {time.time() - t0:.0f} s, FUZZ_SEED={base}")
    print(f"untyped exceptions: {len(untyped)}")
    for u in untyped[:20]:
        print(f"  {u['input']}: {u['error']}")
    if slowest:
        print(f"slowest input: {slowest['slowest_s'] * 1000:.1f} ms ({slowest['slowest']})")
    if peak:
        mib = peak["peak_bytes"] / 2**20
        print(f"largest traced allocation: {mib:.2f} MiB ({peak['peak']}; one input in {every} traced)")
    print(
        f"memory limit: {memory_mib} MiB over each worker's own mapping; file descriptors left open: {leaked}"
    )
    for p in problems:
        print(p)
    return 1 if untyped or problems or leaked or (slowest and slowest["slowest_s"] > 1.0) else 0


if __name__ == "__main__":
    sys.exit(main())
PY
"$PYTHON" "$DRIVER" "$@"
