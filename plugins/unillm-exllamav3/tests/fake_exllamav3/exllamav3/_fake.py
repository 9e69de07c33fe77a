"""Knobs and bookkeeping of the fake: simulated GPUs and step time. Tests set these; the real
exllamav3 has no such module."""

from __future__ import annotations

import os
import time

#: bytes of memory on each fake GPU (cuda:0, cuda:1, ...)
GPU_MEMORY: list[int] = [24 * 2**30]
#: seconds one forward pass takes (simulated GPU time; lets concurrent callers meet in a batch)
STEP_SECONDS = float(os.environ.get("FAKE_EXLLAMAV3_STEP_SECONDS", "0"))
#: a message to raise from the next ``Generator.iterate()`` (a failing step), then cleared
FAIL_NEXT_STEP: str | None = None
#: a message to raise from the next prompt chunk a job evaluates (exllamav3 1.6.5 contains that
#: failure to the job: an ``error`` result for it, the others carry on), then cleared
FAIL_NEXT_PREFILL: str | None = None
#: bytes allocated now on each fake GPU
_used: dict[int, int] = {}


class OutOfMemoryError(RuntimeError):
    """Named like ``torch.cuda.OutOfMemoryError`` (also a RuntimeError), with torch's message."""


def free_bytes(device: int) -> int:
    return GPU_MEMORY[device] - _used.get(device, 0)


def allocate(device: int, nbytes: int) -> None:
    if device >= len(GPU_MEMORY):
        raise RuntimeError("CUDA error: invalid device ordinal")
    if nbytes > free_bytes(device):
        raise OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {nbytes / 2**20:.2f} MiB. GPU {device} has a total "
            f"capacity of {GPU_MEMORY[device] / 2**30:.2f} GiB of which {free_bytes(device) / 2**20:.2f} MiB "
            "is free."
        )
    _used[device] = _used.get(device, 0) + nbytes


def release(device: int, nbytes: int) -> None:
    _used[device] = max(0, _used.get(device, 0) - nbytes)


def step() -> None:
    global FAIL_NEXT_STEP
    if FAIL_NEXT_STEP is not None:
        msg, FAIL_NEXT_STEP = FAIL_NEXT_STEP, None
        raise RuntimeError(msg)
    if STEP_SECONDS:
        time.sleep(STEP_SECONDS)


def prefill_step() -> None:
    global FAIL_NEXT_PREFILL
    if FAIL_NEXT_PREFILL is not None:
        msg, FAIL_NEXT_PREFILL = FAIL_NEXT_PREFILL, None
        raise RuntimeError(msg)
