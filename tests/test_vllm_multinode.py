"""vLLM's own multi-node path without Ray, through unillm, on two loopback "nodes": node 1 is a
``unillm serve --headless`` subprocess in its own process group; node 0 is ``unillm serve`` over
HTTP (tensor parallel 2) or an engine in this process (``load_engine``, pipeline parallel 2); each
node's rank runs on a core of its own. Both give the greedy answers of the session's
single-process engine (tests/conftest.py).

Each layout is a start of its own (two starts, one per layout): vLLM fixes the layout when it
starts, and pipeline stages on vLLM's CPU build need the compiled model (enforce_eager refused),
while tensor parallelism runs eager like the shared engine. Node 1 stops on SIGTERM while node 0
closes, so that the two shutdowns overlap. Deselect with ``-m 'not vllm'``; CI runs them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from unillm import ConfigError, SamplingParams, load_engine
from unillm.cli import app
from unillm.testing import TinyModel

from ._server_util import free_port, start_server, stop_group
from .conftest import VLLM_CONTEXT, VLLM_OPTIONS

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
PROMPTS = ["The quick brown fox", "Once upon a time", "0 1 2 3 4 5 6 7 8 9"]
#: Bounds on waits that end early when things go right: node 0's start (which waits for node 1's
#: rank) and node 1's exit after SIGTERM (vLLM gives a stuck worker 5 s, then SIGTERM, then SIGKILL).
START_BOUND_S = 900
EXIT_BOUND_S = 120
runner = CliRunner()
#: vLLM's compilation config for the pipeline-parallel test (CompilationMode.DYNAMO_TRACE_ONCE, the
#: CPU build's own mode, with the "eager" backend its CI uses): compiled, as pipeline stages need on
#: CPU (the warm-up run gives the later stage its buffer), but traced into plain torch rather than
#: built by inductor. Measured here: node 0 started in 76 s with inductor against tp=2's 32 s eager;
#: traced, the pp=2 test takes about as long as the tp=2 one (64 s and 62 s).
TRACED = {"compilation_config": {"mode": 2, "backend": "eager"}}


def cli_options(options: dict[str, Any]) -> list[str]:
    """``options`` as ``unillm serve`` flags, each value in JSON (as ``--option`` reads it)."""
    return [arg for key, value in options.items() for arg in ("--option", f"{key}={json.dumps(value)}")]


@contextlib.contextmanager
def headless_node(tiny: TinyModel, options: dict[str, Any], core: int, log: Path) -> Iterator[Any]:
    """Node 1: ``unillm serve --headless`` on ``core``, in a process group of its own, which is
    killed whatever happens. The block sends it SIGTERM; on a clean exit from the block it must
    then exit 0 and leave no process of its group behind."""
    serve = ["serve", str(tiny.hf_dir), "--backend", "vllm", "--context", str(VLLM_CONTEXT), "--headless"]
    cmd = [sys.executable, "-m", "unillm", *serve, *cli_options({**options, "node_rank": 1})]
    with log.open("wb") as out, on_core(core):  # the child inherits the affinity
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: its vLLM workers go with it
        )
    try:
        yield proc
        try:
            code = proc.wait(EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node 1 still runs {EXIT_BOUND_S} s after SIGTERM:\n{tail(log)}")
        assert code == 0, f"node 1 exited {code} on SIGTERM:\n{tail(log)}"
        left = group_left(proc.pid)
        assert not left, f"node 1's processes still run after it exited: {left}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def on_core(core: int) -> Iterator[None]:
    """This process, and so the engine processes it spawns meanwhile, on ``core`` only."""
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


@contextlib.contextmanager
def bounded_start(node1: Any, log: Path) -> Iterator[None]:
    """Node 0's start waits for node 1's rank and has no bound of its own: when node 1 exits first,
    or START_BOUND_S pass, node 1 and node 0's engine processes are killed, so that the start
    fails, with the reason and node 1's output."""
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    lock, loaded, why = threading.Lock(), threading.Event(), []

    def watch() -> None:
        try:
            code = node1.wait(START_BOUND_S)
            reason = f"node 1 exited ({code}) while node 0 started"
        except subprocess.TimeoutExpired:
            reason = f"node 0 did not start within {START_BOUND_S} s"
        with lock:
            if loaded.is_set():
                return
            why.append(reason)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node1.pid, signal.SIGKILL)
        for child in psutil.Process().children(recursive=True):
            if child.pid not in before:
                with contextlib.suppress(psutil.Error):
                    child.kill()

    watcher = threading.Thread(target=watch, name="node-1-watch", daemon=True)
    watcher.start()
    try:
        yield
    except Exception as exc:
        with lock:
            reason = why[0] if why else "node 0 failed to start"
        pytest.fail(f"{reason}: {exc}\nnode 1's output:\n{tail(log)}")
    finally:
        with lock:
            loaded.set()


def group_left(pgid: int) -> list[str]:
    """The processes of group ``pgid`` still running EXIT_BOUND_S after it is asked (multiprocessing's
    resource tracker ends a moment after the process that started it)."""
    import psutil

    def member(p: Any) -> bool:
        with contextlib.suppress(OSError):
            return os.getpgid(p.pid) == pgid
        return False

    members = [p for p in psutil.process_iter() if member(p)]
    _, alive = psutil.wait_procs(members, timeout=EXIT_BOUND_S)
    return [f"{p.pid} {p.name()}" for p in alive]


def tail(log: Path, n: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


# ---- two loopback nodes through unillm ----


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_pipeline_parallel_over_two_loopback_nodes_gives_the_tokens_of_one_process(
    vllm_engine: Any, tiny: TinyModel, tmp_path: Path
) -> None:
    """Node 0 is ``load_engine`` in this process; each node runs one of the two pipeline stages,
    compiled (TRACED): vLLM's CPU build runs pipeline stages only so, and unillm refuses eager."""
    layout = {"pipeline_parallel_size": 2, "enforce_eager": False, "engine_args": TRACED}
    note = "each node runs 1 of the 2 ranks"
    alone = [vllm_engine.generate(p, GREEDY).token_ids for p in PROMPTS]
    cores = sorted(os.sched_getaffinity(0))
    node = {"nnodes": 2, "master_addr": "127.0.0.1", "master_port": free_port()}
    options = {**VLLM_OPTIONS, **layout, **node}
    log = tmp_path / "node1.log"
    with headless_node(tiny, options, cores[-1], log) as node1:
        with bounded_start(node1, log), on_core(cores[0]):
            engine: Any = load_engine(
                {
                    "model": str(tiny.hf_dir),
                    "backend": "vllm",
                    "context_length": VLLM_CONTEXT,
                    "options": options,
                }
            )
        try:
            assert engine.engine_args["nnodes"] == 2 and engine.engine_args["node_rank"] == 0
            assert engine.engine_args["distributed_executor_backend"] == "mp"
            assert any(note in n for n in engine.load_notes), engine.load_notes
            got = [engine.generate(p, GREEDY).token_ids for p in PROMPTS]
            # node 1 stops while node 0 closes: its stuck workers take vLLM's grace period, in parallel
            node1.send_signal(signal.SIGTERM)
        finally:
            engine.close()
    assert got == alone
    assert "node 1 of 2, 1 vLLM rank(s) here" in log.read_text(errors="replace")


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_node_0_served_with_tensor_parallel_over_two_nodes_answers_as_one_process(
    vllm_engine: Any, tiny: TinyModel, tmp_path: Path
) -> None:
    """The commands docs/scaling-out.md gives: node 0 is ``unillm serve`` (HTTP), node 1
    ``unillm serve --headless``, tensor parallel 2 across them; the official client's greedy
    completions are the single-process engine's, and both nodes stop on SIGTERM."""
    import openai

    alone = [vllm_engine.generate(p, GREEDY).text for p in PROMPTS]
    cores = sorted(os.sched_getaffinity(0))
    node = {"nnodes": 2, "master_addr": "127.0.0.1", "master_port": free_port()}
    options = {**VLLM_OPTIONS, "tensor_parallel_size": 2, **node}
    log = tmp_path / "node1.log"
    args = [str(tiny.hf_dir), "--backend", "vllm", "--alias", "tiny", "--context", str(VLLM_CONTEXT),
            *cli_options({**options, "node_rank": 0})]  # fmt: skip
    with headless_node(tiny, options, cores[-1], log) as node1:
        with bounded_start(node1, log), on_core(cores[0]):
            server = start_server(args, timeout_s=START_BOUND_S)
        try:
            oai = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)
            got = [oai.completions.create(model="tiny", prompt=p, max_tokens=GREEDY.max_tokens,
                                          temperature=0).choices[0].text for p in PROMPTS]  # fmt: skip
            # both stop on SIGTERM, as a service manager stops them; the two shutdowns overlap
            node1.send_signal(signal.SIGTERM)
            server.proc.send_signal(signal.SIGTERM)
            code = server.proc.wait(EXIT_BOUND_S)  # within vLLM's own grace for stuck workers
            left = group_left(server.proc.pid)
        finally:
            stop_group(server.proc)
    assert got == alone
    # uvicorn ends by the signal it was stopped by, once it has shut down
    assert code in (0, -signal.SIGTERM), server.log
    assert not left, f"node 0's processes still run after it exited: {left}"
    assert "node 1 of 2, 1 vLLM rank(s) here" in log.read_text(errors="replace")


# ---- what is refused, before anything starts ----


def test_headless_needs_the_vllm_backend_and_a_worker_rank(tiny: TinyModel) -> None:
    model = str(tiny.hf_dir)
    out = runner.invoke(app, ["serve", model, "--backend", "llama.cpp", "--headless"])
    assert out.exit_code == 2 and "ConfigError" in out.output and "add --backend vllm" in out.output
    out = runner.invoke(app, ["serve", model, "--backend", "vllm", "--option", "nnodes=2", "--headless"])
    assert out.exit_code == 2 and "node_rank=0 of nnodes=2: node 0 serves" in out.output, out.output
    out = runner.invoke(app, ["serve", model, "--backend", "vllm", "--headless", "--option", "node_rank=1"])
    assert out.exit_code == 2 and "node_rank=1 with nnodes=1" in out.output, out.output
    out = runner.invoke(app, ["serve", "--config", "x.toml", "--headless"])
    assert out.exit_code == 2 and "--headless goes with MODEL" in out.output


@needs_vllm
def test_a_worker_rank_is_no_engine(tiny: TinyModel) -> None:
    config = {"model": str(tiny.hf_dir), "backend": "vllm", "options": {"nnodes": 2, "node_rank": 1}}
    with pytest.raises(ConfigError, match=r"node_rank=1 runs only vLLM workers.*--headless"):
        load_engine(config)
