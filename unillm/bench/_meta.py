"""The metadata every result carries: model, weights, engine, unillm, hardware, workload, date.

A result without any of ``REQUIRED`` is not written (``check_metadata`` raises
``IncompleteResult`` naming what is missing): a figure whose model, engine or machine is unknown
cannot be compared with anything, which is the field's first rule of benchmarking.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unillm._errors import UnillmError

if TYPE_CHECKING:
    from unillm._contract._engine import Engine
    from unillm._hardware import Hardware
    from unillm._inspect import ModelInfo

__all__ = ["REQUIRED", "BenchError", "IncompleteResult", "WorkloadMismatch", "check_metadata", "collect"]

#: Dotted paths every result's metadata must fill (not None, not empty).
REQUIRED = (
    "model.name",
    "model.architecture",
    "model.parameters",
    "weights.format",
    "weights.quantization",
    "weights.sha256",
    "engine.name",
    "engine.version",
    "unillm_version",
    "hardware.cpu_model",
    "hardware.ram_total_bytes",
    "workload",
    "date",
)


class BenchError(UnillmError):
    """A benchmark cannot run, or its result cannot be written or compared."""


class IncompleteResult(BenchError):
    """A result lacks metadata it must carry; it is not written."""

    def __init__(self, missing: list[str]) -> None:
        self.missing = tuple(missing)
        super().__init__(
            f"the result lacks {', '.join(missing)}, so it is not written: a benchmark must say what "
            "model, engine and machine it measured (for a --url run pass --model-path, --engine and "
            "--engine-version)"
        )


class WorkloadMismatch(BenchError):
    """Results compared side by side were measured under different workloads."""

    def __init__(self, differences: list[str]) -> None:
        self.differences = tuple(differences)
        super().__init__(
            "these results ran different workloads, so their figures do not compare: "
            + "; ".join(differences)
            + " (pass --force to compare them anyway)"
        )


def _sha256(paths: list[Path]) -> str | None:
    if not paths:
        return None
    h = hashlib.sha256()
    for p in sorted(paths):
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def weight_files(path: str | Path | None) -> list[Path]:
    """The files holding a model's weights: the GGUF itself, or a directory's safetensors/bins."""
    if not path:
        return []
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        return []
    found = sorted(p.glob("*.safetensors")) or sorted(p.glob("*.gguf")) or sorted(p.glob("*.bin"))
    return [f for f in found if f.is_file()]


def model_metadata(name: str, path: str | Path | None, info: ModelInfo | None) -> dict[str, Any]:
    """``model`` and ``weights`` from ``inspect_model``'s ``info`` and a hash of the weights."""
    files = weight_files(path)
    quant = info.quantization if info else None
    dtype = quant.lower() if quant and quant.lower() in ("f32", "f16", "bf16", "fp16", "float32") else None
    return {
        "model": {
            "name": name,
            "path": str(path) if path else None,
            "architecture": info.architecture if info else None,
            "parameters": info.parameters if info else None,
            "active_parameters": info.active_parameters if info else None,
            "layers": info.layers if info else None,
            "context_length": info.context_length if info else None,
        },
        "weights": {
            "format": info.format if info else None,
            "quantization": quant,
            "bits_per_weight": info.bits_per_weight if info else None,
            "group_size": info.group_size if info else None,
            "dtype": dtype,
            "bytes": sum(f.stat().st_size for f in files) or None,
            "files": [f.name for f in files],
            "sha256": _sha256(files),
        },
    }


def engine_metadata(engine: Engine[Any]) -> dict[str, Any]:
    """``engine``: name, version, options and capabilities of a loaded engine."""
    cls = type(engine)
    try:
        version = cls.available().version
    except Exception:  # a plugin's availability check failing must not lose the run
        version = None
    options = engine.options
    dump = options.model_dump(mode="json") if hasattr(options, "model_dump") else {}
    caps = engine.capabilities
    return {
        "name": engine.name,
        "version": version,
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "options": dump,
        "context_length": engine.context_length,
        "batching": caps.batching,
        "ignore_eos": "ignore_eos" in caps.sampling,
    }


def hardware_metadata(hardware: Hardware | None) -> dict[str, Any]:
    """The machine as ``detect_hardware`` saw it, plus the Python that ran the harness."""
    data: dict[str, Any] = dataclasses.asdict(hardware) if hardware is not None else {}
    data["python"] = sys.version.split()[0]
    data["platform"] = platform.platform()
    return data


def collect(
    *,
    model: dict[str, Any],
    engine: dict[str, Any],
    hardware: Hardware | None,
    workload: dict[str, Any],
) -> dict[str, Any]:
    """The whole metadata block of a result."""
    from unillm import __version__

    return {
        **model,
        "engine": engine,
        "unillm_version": __version__,
        "hardware": hardware_metadata(hardware),
        "workload": workload,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def missing_metadata(meta: dict[str, Any]) -> list[str]:
    """The ``REQUIRED`` paths ``meta`` leaves unset."""
    out = []
    for dotted in REQUIRED:
        value: Any = meta
        for part in dotted.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is None or value in ("", {}):
            out.append(dotted)
    return out


def check_metadata(meta: dict[str, Any]) -> None:
    """Raise ``IncompleteResult`` when ``meta`` lacks any of ``REQUIRED``."""
    missing = missing_metadata(meta)
    if missing:
        raise IncompleteResult(missing)
