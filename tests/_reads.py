"""Reads of model files counted rather than timed: inspection opens each file through
``unillm._inspect._files._open``, which wraps its descriptor in ``_files.FileIO``."""

from __future__ import annotations

from dataclasses import dataclass
from io import FileIO
from typing import Any

import pytest

from unillm import _inspect


@dataclass
class Reads:
    """The read calls made on the model's files and the bytes they returned."""

    calls: int = 0
    bytes: int = 0


def count_reads(monkeypatch: pytest.MonkeyPatch) -> Reads:
    """Every read of a model file from here to the end of the test, counted."""
    counted = Reads()

    class Counted(FileIO):
        def read(self, size: int | None = -1, /) -> bytes:
            data = super().read(size) or b""
            counted.calls, counted.bytes = counted.calls + 1, counted.bytes + len(data)
            return data

        def readinto(self, buffer: Any, /) -> int:
            got = super().readinto(buffer) or 0
            counted.calls, counted.bytes = counted.calls + 1, counted.bytes + got
            return got

    monkeypatch.setattr(_inspect._files, "FileIO", Counted)
    return counted
