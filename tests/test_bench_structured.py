"""benchmarks/structured_output.py at its smallest (one round, llama.cpp only), so the script cannot
rot: it runs, the three contenders generate the same number of tokens from the same grammar, and
its result file holds every figure docs/benchmarks.md quotes. No timing is asserted (the machine is
shared); the figures themselves come from the full run in benchmarks/results/."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.slow,
    pytest.mark.llamacpp,
    pytest.mark.skipif(
        importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"
    ),
]


def test_the_structured_output_benchmark_runs_on_llama_cpp(tmp_path: Path) -> None:
    out = tmp_path / "so.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "structured_output.py")]
    cmd += ["--backends", "llama.cpp", "--rounds", "1", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert set(result["backends"]) == {"llama.cpp"}
    llama = result["backends"]["llama.cpp"]
    n = llama["tokens_constrained"]
    assert n > 1
    # the unconstrained run is held to the constrained count, and the engine's call runs the same
    # llguidance grammar greedily: all three generate exactly n tokens, the constrained ones the same
    # text; llama.cpp's own grammar (another compiler) is timed beside them
    tokens = {name: row["tokens"] for name, row in llama["contenders"].items()}
    assert tokens.pop("create_completion(grammar=)")[0] > 1
    assert tokens == {
        "unillm unconstrained": [n],
        "unillm constrained": [n],
        "create_completion + llguidance": [n],
    }
    assert llama["same_text_unillm_and_engine"] is True
    for key in (
        "constrained_vs_unconstrained_speed", "unillm_vs_engine_constrained_speed",
        "llguidance_vs_llama_cpp_grammar_speed",
    ):  # fmt: skip
        assert llama[key]["median"] > 0
    assert all(sec > 0 for sec in llama["compile"].values())
    assert len(llama["loadavg_per_round"]) == 1
    assert result["machine"]["cores"] and "llama-cpp-python" in result["machine"]
    assert "unillm constrained" in proc.stdout
    assert "[met]" in proc.stdout or "[MISSED]" in proc.stdout
