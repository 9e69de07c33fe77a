"""``unillm serve`` shuts down gracefully: on SIGTERM it stops accepting, lets the request in
flight finish, closes the engines and exits 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import needs_llama_cpp

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")


def _start(gguf: Path, *flags: str) -> tuple[subprocess.Popen[str], str, list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "unillm", "serve", str(gguf), "--alias", "tiny", "--port", "0", *flags],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        return _wait_ready(proc)
    except BaseException:  # no server left running for the next test
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def _wait_ready(proc: subprocess.Popen[str]) -> tuple[subprocess.Popen[str], str, list[str]]:
    assert proc.stderr is not None
    deadline = time.monotonic() + 120
    for line in proc.stderr:
        found = re.search(r"listening on (http://\S+)/v1", line)
        if found:
            url = found.group(1)
            break
        assert time.monotonic() < deadline, "the server did not start"
    else:
        pytest.fail(f"the server exited with {proc.wait()} before listening")
    # keep draining stderr (a full pipe would block the server's logging), keeping the lines
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stderr or ()), daemon=True).start()
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.TransportError:
            pass
        time.sleep(0.1)  # polling, bounded by the deadline
    pytest.fail("the server never became ready")


@needs_llama_cpp
def test_sigterm_lets_the_request_in_flight_finish_then_exits(tiny_gguf: Path) -> None:
    proc, url, log = _start(tiny_gguf, "--grace", "60", "--context", "4096")
    try:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        texts, usage = [], None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            for i, line in enumerate(response.iter_lines()):
                if i == 4:  # a few tokens in: the request is in flight
                    os.kill(proc.pid, signal.SIGTERM)
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                texts.extend(c["text"] for c in event["choices"])
        assert usage is not None and usage["completion_tokens"] == 3000, "the stream was cut by the shutdown"
        # uvicorn re-raises the signal once it has shut down, the conventional status for it
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        deadline = time.monotonic() + 10  # the drain thread reads the last lines after the exit
        while "Application shutdown complete" not in "".join(log) and time.monotonic() < deadline:
            time.sleep(0.05)
        text = "".join(log)
        assert "unloading tiny (shutdown)" in text and "Application shutdown complete" in text, text
        with pytest.raises(httpx.TransportError):  # no longer listening
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
