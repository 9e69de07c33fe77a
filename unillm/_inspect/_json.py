"""JSON from untrusted files and bytes: bounded in size, digits and nesting."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from unillm._errors import ModelFormatError, UnillmError
from unillm._inspect._files import _open, _read

# ---- JSON -----------------------------------------------------------------------------------
# Parsed with hooks that refuse what json.loads would otherwise accept from a hostile file: a
# number of a million digits (quadratic to convert when sys.set_int_max_str_digits(0) lifts the
# default guard) and nesting deep enough to exhaust the recursion limit. NaN and Infinity are not
# JSON, but real config.json files hold them (Mamba2 and Nemotron-H write "time_step_limit":
# [0.0, Infinity], as transformers serializes it): accepted there, harmless to what is read (every
# number used is range-checked), and refused in safetensors headers, as safetensors itself does.

_MAX_NUMBER_CHARS = 1000  # real files hold ints like 10**30 and floats like 1e-05; the longest
# exact decimal expansion of a double has ~770 digits

_MAX_CONFIG_BYTES = 16 * 1024 * 1024


def _load_json(path: Path, limit: int) -> dict[str, Any]:
    """A JSON object from an untrusted file: at most ``limit`` bytes, strict UTF-8."""
    with _open(path) as f:
        size = os.fstat(f.fileno()).st_size
        data = b"" if size > limit else _read(f, size + 1, path)  # one more: a file that grew
    if size > limit or len(data) > limit:
        raise ModelFormatError(
            f"{str(path)!r} is larger than {limit >> 20} MiB, implausible for a {path.name}: the file "
            "is corrupt or not what its name says"
        )
    value = _parse_json(data, repr(str(path)))
    if not isinstance(value, dict):
        raise ModelFormatError(f"{str(path)!r} is not a JSON object (corrupt file)")
    return value


def advisory_json(path: Path) -> dict[str, Any]:
    """A JSON object a model declares as advice (its stop tokens, its chat template), or {} when the
    file is missing, too large, not JSON or not an object: such a file is never a reason to refuse
    the model. Read within the same bounds as every other config."""
    try:
        return _load_json(path, _MAX_CONFIG_BYTES) if path.is_file() else {}
    except (OSError, UnillmError):
        return {}


def _parse_json(data: bytes, what: str, *, strict: bool = False) -> Any:
    """JSON from untrusted bytes; ``strict`` also refuses NaN and infinities."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ModelFormatError(
            f"{what} is not UTF-8 text (byte {exc.start}: {exc.reason}): the file is corrupt or not JSON"
        ) from None
    try:
        return json.loads(
            text,
            parse_int=_json_int,
            parse_float=_json_finite_float if strict else _json_float,
            parse_constant=_json_constant if strict else None,
        )
    except RecursionError:  # json's C scanner recurses once per nesting level
        raise ModelFormatError(f"{what} is nested too deeply (corrupt or hostile file)") from None
    except ValueError as exc:
        raise ModelFormatError(f"{what} is not valid JSON: {exc} (corrupt or hostile file)") from None


def _json_int(text: str) -> int:
    if len(text) > _MAX_NUMBER_CHARS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _json_float(text: str) -> float:
    if len(text) > _MAX_NUMBER_CHARS:
        raise ValueError(f"a number of {len(text)} characters")
    return float(text)


def _json_finite_float(text: str) -> float:
    value = _json_float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} overflows a double")
    return value


def _json_constant(text: str) -> float:
    raise ValueError(f"{text} is not a JSON value")
