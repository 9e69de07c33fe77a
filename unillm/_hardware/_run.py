"""Running things without getting stuck: tools as subprocesses killed whole on timeout, calls in
a thread abandoned when they hang, files read without raising."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

_T = TypeVar("_T")


def _run(cmd: list[str], timeout: float, findings: list[str], *, check: bool = True) -> str | None:
    """``cmd``'s stdout, or ``None`` (with a finding) when it cannot run, fails or times out.

    The tool runs in its own process group, killed whole on timeout: a wrapper script's children
    would otherwise hold the pipe open and the wait would outlive the timeout.
    """
    posix = os.name == "posix"
    shown = " ".join(arg if "\n" not in arg else "..." for arg in cmd)
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=posix,
        )
    except OSError as exc:
        findings.append(f"`{cmd[0]}` could not run: {exc}")
        return None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc, posix)
        findings.append(f"`{shown}` did not answer within {timeout:g} s")
        return None
    except Exception as exc:
        _kill(proc, posix)
        findings.append(f"`{shown}` failed: {exc}")
        return None
    if check and proc.returncode != 0:
        detail = (err or out).strip().splitlines()
        findings.append(
            f"`{shown}` exited with {proc.returncode}" + (f": {detail[-1][:200]}" if detail else "")
        )
        return None
    return out


def _kill(proc: subprocess.Popen[str], posix: bool) -> None:
    try:
        if posix:
            os.killpg(proc.pid, 9)
        else:
            proc.kill()
    except OSError:
        pass
    with contextlib.suppress(Exception):
        proc.communicate(timeout=1)


def _bounded(fn: Callable[[], _T], timeout: float) -> tuple[str, _T | None, BaseException | None]:
    """Run ``fn`` in a daemon thread for at most ``timeout`` seconds: ("ok", value, None),
    ("error", None, exc) or ("timeout", None, None). A hung call (a stuck driver) is abandoned."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # a probe must never take detection down
            box["error"] = exc

    thread = threading.Thread(target=target, name="unillm-hardware-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return "timeout", None, None
    if "error" in box:
        return "error", None, box["error"]
    return "ok", box.get("value"), None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
