"""Real servers on loopback for the plugin's tests: each started in a process group of its own on
a port chosen here, waited for by polling (never by sleeping), and killed with its group."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import httpx

__all__ = ["Proc", "free_port", "on_one_cpu", "unillm_serve", "wait_until"]

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(check: Callable[[], T], timeout_s: float, what: str, every_s: float = 0.05) -> T:
    """``check()``'s first truthy value, polled until ``timeout_s``; AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


def on_one_cpu(cmd: Sequence[str]) -> list[str]:
    """``cmd`` under ``taskset`` on the last CPU this process may use, children included (as is,
    where there is no taskset or one CPU). vLLM's CPU build binds its worker to the other cores and
    its engine core spin-waits for the worker: on 2 cores that starves the HTTP front end beside it,
    which then answers nothing (tokens, /metrics) until the engine is idle. All on one core, the
    spinning hands the core over and the front end streams token by token (measured on the tiny
    model: stalls of about a second per 480-token request before, none after)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    taskset = shutil.which("taskset")
    return [taskset, "-c", str(cpus[-1]), *cmd] if taskset and len(cpus) > 1 else list(cmd)


class Proc:
    """One server process: ``url`` is its root (``url + '/v1'`` the OpenAI base)."""

    def __init__(
        self,
        cmd: Sequence[str],
        port: int,
        log: Path,
        env: Mapping[str, str] | None = None,
        drop: Sequence[str] = (),
    ) -> None:
        """``env`` is added to this process's environment, less ``UNILLM_*`` and the ``drop`` names."""
        self.port, self.log_path = port, log
        environ = {k: v for k, v in os.environ.items() if not k.startswith("UNILLM_") and k not in drop}
        environ.update({"PYTHONUNBUFFERED": "1", **(env or {})})
        self._log = open(log, "w")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            list(cmd), stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env=environ, start_new_session=True,
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(
        self, path: str, timeout_s: float = 120.0, headers: Mapping[str, str] | None = None
    ) -> Proc:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.log()}")
            try:
                return httpx.get(self.url + path, headers=headers, timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        try:
            wait_until(ready, timeout_s, f"{self.url}{path} to answer 200", every_s=0.1)
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self) -> None:
        """SIGKILL: gone at once, mid-answer, the way a crash looks to a client."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(15)
        if not self._log.closed:
            self._log.close()


def unillm_serve(model: Path, port: int, log: Path, *extra: str) -> Proc:
    """``unillm serve`` on llama.cpp, alias ``tiny``, on ``port`` (not yet waited for)."""
    cmd = [sys.executable, "-m", "unillm", "serve", str(model), "--backend", "llama.cpp", "--alias", "tiny"]
    return Proc([*cmd, "--port", str(port), "--grace", "1", *extra], port, log)
