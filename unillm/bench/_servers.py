"""``unillm bench MODEL --servers PEERS``: ``unillm serve`` beside engines' own servers, over HTTP.

The same weights (each server reads its engine's format of them), the same settings on every side
(context per sequence, threads, sequences decoded together where the server batches), the same
prompts and one load generator; the servers are started once on loopback, and each level runs on
every server in turn, the order rotating by level, so that a shared machine's drift falls on all
alike. A result per server, as ``bench_url`` writes it, with the server's own resident memory (its
process tree), not this process's.

Peers, and the backend ``unillm serve`` runs beside them:

- ``llama-cpp-python``: ``python -m llama_cpp.server`` (llama.cpp, one request at a time; its
  ``[server]`` extra);
- ``xllamacpp``: llama.cpp's own ``llama-server`` in process through xllamacpp, with as many slots
  as ``unillm serve`` decodes sequences together (``--peer-python``: an environment that has it);
- ``mlx-lm``: ``python -m mlx_lm.server`` (MLX);
- ``vllm``: vLLM's OpenAI server (vLLM).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unillm.bench._meta import BenchError
from unillm.bench._runner import Bench, Progress
from unillm.bench._workload import BenchWorkload, load_workload

__all__ = ["PEERS", "bench_servers"]

ALIAS = "bench"  # the model name every server is told to answer to (where it can be told)

_XLLAMACPP = """
import signal, sys, threading
import xllamacpp
model, port, parallel, context, threads = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:6])
p = xllamacpp.CommonParams()
p.model.path = model
p.model_alias = sys.argv[6]
p.n_parallel = parallel
p.n_ctx = context * parallel  # llama-server splits n_ctx among its slots
p.cont_batching = True
p.cpuparams.n_threads = threads
p.cpuparams_batch.n_threads = threads
p.port = port
p.hostnames = ["127.0.0.1"]
p.warmup = False
server = xllamacpp.Server(p)
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: done.set())
done.wait()
"""


@dataclass(frozen=True)
class Launch:
    """What every server of one comparison is started with."""

    python: str
    model: Path
    port: int
    context: int
    threads: int
    parallel: int


@dataclass(frozen=True)
class Peer:
    """An engine's own server: the backend it is the peer of, the format it reads, its command."""

    name: str
    label: str
    dist: str  # its distribution, for the version each result records
    backend: str
    module: str  # what its Python must import
    install: str
    command: Callable[[Launch], list[str]]
    model_name: Callable[[Launch], str] = lambda launch: ALIAS
    start_timeout_s: float = 180.0
    #: it mishandles kept-alive connections (xllamacpp's server closes one after a stream while
    #: still answering Keep-Alive): every server of the comparison gets a connection per request
    fresh_connections: bool = False


def _llama_cpp_server(x: Launch) -> list[str]:
    return [
        x.python, "-m", "llama_cpp.server", "--model", str(x.model), "--host", "127.0.0.1",
        "--port", str(x.port), "--n_ctx", str(x.context), "--n_threads", str(x.threads),
        "--n_threads_batch", str(x.threads), "--model_alias", ALIAS,
        # by default a new request aborts the stream in progress: concurrent clients get nothing
        "--interrupt_requests", "False",
    ]  # fmt: skip


def _xllamacpp(x: Launch) -> list[str]:
    args = (x.model, x.port, x.parallel, x.context, x.threads, ALIAS)
    return [x.python, "-c", _XLLAMACPP, *map(str, args)]


def _mlx_lm(x: Launch) -> list[str]:
    return [
        x.python,
        "-m",
        "mlx_lm.server",
        "--model",
        str(x.model),
        "--host",
        "127.0.0.1",
        "--port",
        str(x.port),
    ]


def _vllm(x: Launch) -> list[str]:
    return [
        x.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(x.model),
        "--host", "127.0.0.1", "--port", str(x.port), "--max-model-len", str(x.context),
        "--served-model-name", ALIAS, "--max-num-seqs", str(x.parallel),
    ]  # fmt: skip


_PEERS = (
    Peer(
        name="llama-cpp-python", label="llama_cpp.server", dist="llama-cpp-python", backend="llama.cpp",
        module="llama_cpp.server", install="pip install 'llama-cpp-python[server]'",
        command=_llama_cpp_server,
    ),
    Peer(
        name="xllamacpp", label="xllamacpp (llama-server)", dist="xllamacpp", backend="llama.cpp",
        module="xllamacpp",
        install="pip install xllamacpp (or give --peer-python an environment that has it)",
        command=_xllamacpp, fresh_connections=True,
    ),
    Peer(
        name="mlx-lm", label="mlx_lm.server", dist="mlx-lm", backend="mlx", module="mlx_lm",
        install="pip install mlx-lm", command=_mlx_lm, model_name=lambda launch: str(launch.model),
    ),
    Peer(
        name="vllm", label="vllm serve", dist="vllm", backend="vllm", module="vllm",
        install="pip install vllm", command=_vllm, start_timeout_s=900.0,
    ),
)  # fmt: skip
PEERS: dict[str, Peer] = {p.name: p for p in _PEERS}


def _unillm(x: Launch, backend: str) -> list[str]:
    cmd = [
        x.python, "-m", "unillm", "serve", str(x.model), "--backend", backend, "--alias", ALIAS,
        "--host", "127.0.0.1", "--port", str(x.port), "--context", str(x.context),
    ]  # fmt: skip
    if backend == "llama.cpp":
        cmd += ["--option", f"n_threads={x.threads}", "--option", f"n_threads_batch={x.threads}"]
        cmd += ["--option", f"parallel={x.parallel}"]
    elif backend in ("mlx", "vllm"):
        cmd += ["--max-running", str(x.parallel)]
    return cmd


@dataclass
class _Server:
    label: str
    url: str
    model_name: str
    process: subprocess.Popen[bytes]
    log: Path
    path: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _can_import(python: str, module: str) -> bool:
    # llama_cpp.server: the [server] extra's packages too, not only llama_cpp
    code = "import llama_cpp.server.app" if module == "llama_cpp.server" else f"import {module}"
    return subprocess.run([python, "-c", code], capture_output=True, check=False).returncode == 0


def _python_for(peer: Peer, other: str | None) -> str:
    """This interpreter when it can run ``peer``, else ``other`` (``--peer-python``) when that can."""
    for python in (sys.executable, other):
        if python is not None and _can_import(python, peer.module):
            return python
    where = sys.executable + (f" or {other}" if other else "")
    raise BenchError(f"{peer.label} cannot start: {peer.module} is not importable by {where}; {peer.install}")


def _version(python: str, dist: str) -> str | None:
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def _tail(log: Path, lines: int = 15) -> str:
    try:
        text = log.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "".join(f"\n  {line}" for line in text)


def _wait_ready(server: _Server, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise BenchError(
                f"{server.label} exited ({server.process.returncode}) before it answered:{_tail(server.log)}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url + "/v1/models", timeout=2.0).status_code == 200:
                return
        time.sleep(0.2)
    raise BenchError(f"{server.label} did not answer within {timeout_s:.0f} s:{_tail(server.log)}")


def _stop(server: _Server) -> None:
    if server.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGTERM)
        try:
            server.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()
    server.log.unlink(missing_ok=True)


@contextlib.contextmanager
def _started(
    label: str, launch: Launch, command: list[str], model_name: str, timeout_s: float
) -> Iterator[_Server]:
    fd, log_name = tempfile.mkstemp(prefix="unillm-bench-server-", suffix=".log")
    with os.fdopen(fd, "wb") as log:
        # a session of its own: the whole tree (vLLM's engine processes) is stopped at the end
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = _Server(
        label, f"http://127.0.0.1:{launch.port}", model_name, process, Path(log_name), launch.model
    )
    try:
        _wait_ready(server, timeout_s)
        yield server
    finally:
        _stop(server)


def tree_rss_bytes(pid: int) -> int | None:
    """Resident memory of ``pid`` and its children (a server's engine processes), or None."""
    try:
        import psutil

        proc = psutil.Process(pid)
        return sum(int(p.memory_info().rss) for p in [proc, *proc.children(recursive=True)])
    except Exception:  # no psutil, the process gone, or a platform it cannot read
        return None


def bench_servers(
    model: str | Path,
    peers: Sequence[str],
    workload: BenchWorkload | dict[str, Any] | str | Path,
    *,
    context_length: int | None = None,
    parallel: int = 8,
    threads: int | None = None,
    peer_python: str | None = None,
    price_per_hour: float | None = None,
    progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """``unillm serve`` and each of ``peers`` (names in ``PEERS``) on ``model`` under
    ``workload``, levels interleaved; a result per server, ``unillm serve`` first for each backend.

    ``context_length``: tokens per sequence on every server (default: the workload's longest request,
    at least 1,024); ``parallel``: sequences decoded together where a server batches; ``threads``:
    CPU threads for every engine (default: the cores); ``peer_python``: the interpreter the peers run
    under when this one cannot run them (xllamacpp in an environment of its own)."""
    from unillm._inspect._paths import hf_dir_in
    from unillm.bench._api import model_path_for, run_interleaved, url_bench, url_result

    wl = load_workload(workload)
    unknown = [p for p in peers if p not in PEERS]
    if unknown or not peers:
        raise BenchError(
            f"unknown server {', '.join(unknown)!r}; peers: {', '.join(PEERS)}"
            if unknown
            else f"--servers names the peers to compare unillm serve with: {', '.join(PEERS)}"
        )
    pythons = {name: _python_for(PEERS[name], peer_python) for name in peers}
    context = context_length or max(1024, wl.input_len.upper + wl.output_len.upper)
    threads = threads or os.cpu_count() or 1
    # one unillm serve per backend the peers need, named for it, then its peers
    plan: list[tuple[str, str | None, Launch, list[str], str, float]] = []
    ours_version = _version(sys.executable, "unillm")
    for backend in dict.fromkeys(PEERS[p].backend for p in peers):
        path = model_path_for(model, backend)
        ours = Launch(sys.executable, path, _free_port(), context, threads, parallel)
        plan.append((f"unillm serve ({backend})", ours_version, ours, _unillm(ours, backend), ALIAS, 900.0))
        for peer in (PEERS[p] for p in peers if PEERS[p].backend == backend):
            theirs = Launch(pythons[peer.name], path, _free_port(), context, threads, parallel)
            version = _version(pythons[peer.name], peer.dist)
            command, name = peer.command(theirs), peer.model_name(theirs)
            plan.append((peer.label, version, theirs, command, name, peer.start_timeout_s))

    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(_started(label, launch, command, model_name, timeout_s))
            for label, _, launch, command, model_name, timeout_s in plan
        ]
        benches: list[Bench] = []
        # the model's tokenizer sizes the prompts exactly (an HF directory beside the GGUF)
        tokenizer = hf_dir_in(model)
        for server in servers:
            bench = url_bench(
                server.url, wl, model=server.model_name, model_path=server.path, tokenizer=tokenizer,
                progress=progress,
                keepalive=not any(PEERS[p].fresh_connections for p in peers),
            )  # fmt: skip
            bench.target.process = server.process.pid
            bench.target.rss = tree_rss_bytes
            benches.append(bench)

        interrupted = run_interleaved(benches, wl, rotate=True)  # who goes first rotates by level
        return [
            url_result(
                bench, server.url, bench.interrupted() if interrupted else bench.levels, interrupted,
                model_path=server.path, engine_name=server.label, engine_version=version,
                price_per_hour=price_per_hour,
            )
            for server, bench, (_, version, *_) in zip(servers, benches, plan, strict=True)
        ]  # fmt: skip


def ratios(results: Sequence[dict[str, Any]]) -> list[str]:
    """Lines of ``unillm serve`` / peer per level: output tok/s and TTFT p50 (results in the order
    ``bench_servers`` returns them: each backend's unillm serve, then its peers)."""
    lines = []
    base: dict[str, Any] | None = None
    for result in results:
        name = str(result["metadata"]["engine"]["name"])
        if name.startswith("unillm serve"):
            base = result
            continue
        if base is None:
            continue
        for ours, theirs in zip(base["levels"], result["levels"], strict=False):
            a, b = ours["summary"], theirs["summary"]
            tps = _ratio(a["output_tokens_per_s"], b["output_tokens_per_s"])
            ttft = _ratio(a["ttft"]["p50"], b["ttft"]["p50"])
            lines.append(
                f"{base['metadata']['engine']['name']} / {name} at {_level(ours)}: output tok/s {tps}, "
                f"TTFT p50 {ttft} (lower is better)"
            )
    return lines


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def _level(level: dict[str, Any]) -> str:
    return f"c={level['value']:g}" if level["kind"] == "concurrency" else f"{level['value']:g} req/s"
