"""A real ``unillm serve`` process for tests: started on a free port (``--port 0``, the port read
from its stderr), waited for until ``/ready`` answers, and killed with its process group.

Also the polling and ``/metrics`` reading the server tests share: no test sleeps to let
something happen, it polls for it with a deadline.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import httpx

__all__ = ["Server", "metric", "metrics", "parse_metrics", "start_server", "wait_until"]

T = TypeVar("T")
_LISTENING = re.compile(r"unillm serve: listening on http://127\.0\.0\.1:(\d+)/v1")


class Server:
    """One ``unillm serve`` subprocess; ``url`` is its root (the Anthropic base), ``v1`` the OpenAI one."""

    def __init__(self, proc: subprocess.Popen[str], lines: list[str], bound: threading.Event) -> None:
        self.proc = proc
        self.lines = lines  # its stderr, line by line, as read so far
        self._bound = bound
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    @property
    def log(self) -> str:
        return "".join(self.lines[-60:])

    def stop(self) -> int:
        """SIGTERM to the whole group, SIGKILL if it has not gone in 15 s; the exit status."""
        return stop_group(self.proc)


def start_server(
    args: Sequence[str], *, env: Mapping[str, str] | None = None, timeout_s: float = 120.0
) -> Server:
    """``unillm serve ARGS --port 0`` in a new process group, returned once ``/ready`` says 200.

    ``UNILLM_API_KEY`` is taken out of the environment unless ``env`` sets it: a developer's key
    must not turn every test server into a guarded one.
    """
    environ = {k: v for k, v in os.environ.items() if k != "UNILLM_API_KEY"}
    environ.update(env or {})
    environ["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "unillm", "serve", *args, "--port", "0", "--grace", "1"]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=environ, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    bound = threading.Event()
    server = Server(proc, lines, bound)

    def read() -> None:  # drain stderr all along: a full pipe would block the server's logging
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            found = _LISTENING.search(line)
            if found and not bound.is_set():
                server.port = int(found.group(1))
                bound.set()

    threading.Thread(target=read, name="unillm-serve-stderr", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    try:
        while not bound.wait(0.1):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`unillm serve` did not start (exit {proc.poll()}):\n{server.log}")
        wait_until(lambda: _ready(server.url), deadline - time.monotonic(), "/ready to answer 200")
    except BaseException:
        server.stop()
        raise
    return server


def stop_group(proc: subprocess.Popen[Any], grace_s: float = 15.0) -> int:
    """Stop a process started with ``start_new_session=True`` and all of its group: SIGTERM, then
    SIGKILL to whatever is left after ``grace_s`` (children that outlived it too); its exit status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):  # the group is gone already
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait(30)


def free_port() -> int:
    """A port free now (for a program that takes no ``--port 0``; one that loses the race to another
    process fails to bind, and its start fails with its log)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=5).status_code == 200
    except httpx.TransportError:  # bound, not yet listening
        return False


def wait_until(check: Callable[[], T], timeout_s: float, what: str, every_s: float = 0.05) -> T:
    """``check()``'s first truthy value, polled until ``timeout_s``; AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what} (last: {value!r})")
        time.sleep(every_s)


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def metrics(url: str, headers: Mapping[str, str] | None = None) -> Samples:
    """Every sample of the server's ``/metrics``."""
    r = httpx.get(url + "/metrics", headers=headers, timeout=10)
    r.raise_for_status()
    return parse_metrics(r.text)


def parse_metrics(text: str) -> Samples:
    """Every sample of a Prometheus exposition, parsed by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def metric(samples: Samples, name: str, **labels: str) -> float:
    """The sample ``name`` with exactly ``labels``; 0 when absent (a counter not yet touched)."""
    return samples.get((name, frozenset(labels.items())), 0.0)
