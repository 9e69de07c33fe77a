"""A ``unillm serve`` subprocess for the server tests that need a real process: its own process
group (killed at the end, whatever happened), its log in a file, its port read from the line it
prints once bound, ready once ``/health`` answers."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from ._server_util import stop_group

_LISTENING = re.compile(r"unillm serve: listening on (http://\S+)/v1 \(models: ")


@dataclass(frozen=True)
class Served:
    """A running server: where it listens and what it logs."""

    proc: subprocess.Popen[bytes]
    url: str  # http://127.0.0.1:PORT, without /v1
    alias: str
    log: Path

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def log_tail(self, chars: int = 4000) -> str:
        return _tail(self.log, chars)

    def rss_kib(self) -> int:
        """The server process's resident set (VmRSS), in KiB."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        assert match, status
        return int(match.group(1))

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {sample name with labels: value}."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when there are none)."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


@contextlib.contextmanager
def serve(
    model: str | os.PathLike[str], *args: str, log: Path, alias: str = "tiny", start_timeout_s: float = 120
) -> Iterator[Served]:
    """``unillm serve MODEL --alias ALIAS --port 0 ARGS...`` until the block ends."""
    cmd = [sys.executable, "-m", "unillm", "serve", str(model), "--alias", alias, "--port", "0", *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = _wait_listening(proc, log, start_timeout_s)
        yield Served(proc, url, alias, log)
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes], grace_s: float = 30) -> None:
    """SIGTERM to the server's process group (vLLM's engine core and workers are in it), then
    SIGKILL to whatever is left once ``grace_s`` has passed."""
    stop_group(proc, grace_s)


def _wait_listening(proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    url = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"unillm serve exited with {proc.returncode}:\n{_tail(log, 4000)}")
        if url is None:
            match = _LISTENING.search(log.read_text(errors="replace"))
            url = match.group(1) if match else None
        if url is not None:
            # the line comes once the socket is bound; uvicorn listens a moment later
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/ready", timeout=5).status_code == 200:
                    return url
        time.sleep(0.2)  # polling, bounded by the deadline
    raise AssertionError(f"unillm serve was not ready within {timeout_s:.0f} s:\n{_tail(log, 4000)}")


def _tail(path: Path, chars: int) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"(no log: {exc})"
