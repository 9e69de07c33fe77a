"""Engine lifetime on the real engines: closing while streams are open, from the same thread and
from another one, 50 times each; 100 load/close cycles without thread, file-descriptor or memory
growth. Each runs in a subprocess, so a crash (llama.cpp used to segfault here) fails the test."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from unillm.testing import TinyModel

HAS = {
    "llama.cpp": importlib.util.find_spec("llama_cpp") is not None,
    "mlx": importlib.util.find_spec("mlx_lm") is not None,
    "exllamav2": True,  # on the faithful fake of its API (tests/fake_exllamav2): it needs CUDA
}
BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(not HAS[b], reason=f"{b} not installed")) for b in HAS]
FAKE_EXLLAMAV2 = Path(__file__).resolve().parent / "fake_exllamav2"

_OPEN = """
import gc, json, os, sys, threading
from unillm import EngineClosed

def open_engine():
    if sys.argv[1] == "llama.cpp":
        from unillm.engines.llamacpp import LlamaCppEngine
        return LlamaCppEngine(model=sys.argv[2], context_length=512).load()
    if sys.argv[1] == "exllamav2":
        from unillm.engines.exllamav2 import ExLlamaV2Engine
        return ExLlamaV2Engine(model=sys.argv[3], context_length=512).load()
    from unillm.engines.mlx import MLXEngine
    return MLXEngine(model=sys.argv[3], options={"batch_size": int(sys.argv[4])}).load()
"""

_CLOSE_WHILE_STREAMING = (
    _OPEN
    + """
outcomes = {"same": [], "other": []}
for _ in range(50):
    e = open_engine()
    it = e.stream("Hello", max_tokens=200, temperature=0, ignore_eos=True)
    next(it)
    e.close()
    try:
        list(it)
        outcomes["same"].append("finished")
    except EngineClosed:
        outcomes["same"].append("closed")
    e = open_engine()
    got = []
    streaming = threading.Event()
    def run():
        try:
            for c in e.stream("Hello", max_tokens=400, temperature=0, ignore_eos=True):
                got.append(c)
                streaming.set()
        except EngineClosed:
            got.append("closed")
        finally:
            streaming.set()
    t = threading.Thread(target=run)
    t.start()
    streaming.wait()  # the first token is out: closed mid-stream
    e.close()
    t.join(60)
    outcomes["other"].append("closed" if got[-1] == "closed" else got[-1].finish_reason)
    for call in (e.kv_stats, lambda: e.tokenize("a"), lambda: e.generate("a")):
        try:
            call()
            outcomes["same"].append("answered after close")
        except EngineClosed:
            pass
print(json.dumps(outcomes))
"""
)

_CYCLES = (
    _OPEN
    + """
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))
def threads():
    return len(os.listdir("/proc/self/task"))
def fds():
    return len(os.listdir("/proc/self/fd"))
marks = []
for i in range(100):
    e = open_engine()
    e.generate("Hello", max_tokens=4, temperature=0)
    e.close()
    gc.collect()
    if i in (0, 99):
        marks.append({"rss": rss(), "threads": threads(), "fds": fds()})
print(json.dumps(marks))
"""
)


def _run(script: str, backend: str, tiny: TinyModel, batch: int = 8) -> object:
    args = [sys.executable, "-c", script, backend, str(tiny.gguf_path), str(tiny.hf_dir), str(batch)]
    env = dict(os.environ)
    if backend == "exllamav2":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAKE_EXLLAMAV2), env.get("PYTHONPATH")]))
        env["UNILLM_EXLLAMAV2_ASSUME_GPU"] = "1"
    out = subprocess.run(args, check=False, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, f"exit {out.returncode}:\n{out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_close_while_streaming_fifty_times(backend: str, tiny: TinyModel) -> None:
    outcomes = _run(_CLOSE_WHILE_STREAMING, backend, tiny, batch=1)
    assert isinstance(outcomes, dict)
    # the same thread's open stream ends with EngineClosed; every call after close raises it
    assert outcomes["same"] == ["closed"] * 50
    # another thread's stream ends with EngineClosed at its next step (or had just finished)
    assert len(outcomes["other"]) == 50 and set(outcomes["other"]) <= {"closed", "length"}
    assert outcomes["other"].count("closed") >= 45


@pytest.mark.slow
def test_mlx_batched_close_while_streaming(tiny: TinyModel) -> None:
    if not HAS["mlx"]:
        pytest.skip("mlx not installed")
    outcomes = _run(_CLOSE_WHILE_STREAMING, "mlx", tiny, batch=8)
    assert isinstance(outcomes, dict)
    assert outcomes["same"] == ["closed"] * 50
    assert set(outcomes["other"]) <= {"closed", "length"}


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hundred_load_close_cycles_leak_nothing(backend: str, tiny: TinyModel) -> None:
    first, last = _run(_CYCLES, backend, tiny)  # type: ignore[misc]
    print(backend, first, last)
    assert last["threads"] <= first["threads"], (first, last)
    assert last["fds"] <= first["fds"], (first, last)
    assert last["rss"] - first["rss"] < 20 * 1024 * 1024, (first, last)
