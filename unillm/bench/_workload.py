"""A benchmark workload as data: what to send, how much of it, and how fast.

A ``BenchWorkload`` is a validated pydantic model, built in Python or read from a TOML file (or a
Python file defining ``WORKLOAD``) with ``load_workload``. Every mistake in one is a
``ConfigError`` naming the field. It is recorded whole in every result, so two results can be
compared only when their workloads are equal (``unillm bench compare`` checks).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from unillm._errors import ConfigError
from unillm._params import Validated

__all__ = ["SLO", "Arrival", "BenchWorkload", "EmbedWorkload", "Lengths", "Workload", "load_workload"]


class Lengths(Validated):
    """A distribution of token counts: ``fixed`` (``mean``), ``uniform`` (``min``..``max``,
    inclusive) or ``normal`` (``mean``, ``std``, clipped to ``min``..``max``)."""

    kind: Literal["fixed", "uniform", "normal"] = "fixed"
    mean: int = Field(default=128, ge=1, description="The fixed length, or the normal's mean.")
    std: float = Field(default=0.0, ge=0.0, description="The normal's standard deviation.")
    min: int = Field(default=1, ge=1, description="Lower bound (uniform, normal).")
    max: int | None = Field(default=None, ge=1, description="Upper bound (uniform; normal's clip).")

    @model_validator(mode="after")
    def _bounds(self) -> Lengths:
        if self.kind == "uniform" and self.max is None:
            raise ValueError("a uniform length needs max (and min)")
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")
        return self

    def sample(self, rng: Any) -> int:
        """One length, drawn from ``rng`` (a ``random.Random``)."""
        if self.kind == "fixed":
            return self.mean
        hi = self.max if self.max is not None else 1 << 30
        if self.kind == "uniform":
            return int(rng.randint(self.min, hi))
        return int(min(hi, max(self.min, round(rng.gauss(self.mean, self.std)))))

    @property
    def upper(self) -> int:
        """The longest length this distribution can give (mean + 4 sd for an unbounded normal)."""
        if self.max is not None and self.kind != "fixed":
            return self.max
        return self.mean + int(4 * self.std) if self.kind == "normal" else self.mean


def _lengths(value: Any) -> Any:
    return (
        {"kind": "fixed", "mean": value} if isinstance(value, int) and not isinstance(value, bool) else value
    )


class Arrival(Validated):
    """When requests are sent. ``closed``: each of ``concurrency`` clients sends its next request
    when its last one ends. ``poisson``: at ``rate`` requests per second, exponential gaps.
    ``gamma``: gamma-distributed gaps with mean 1/rate and shape ``burstiness`` (1 is Poisson,
    below 1 burstier), as vLLM's ``bench serve`` draws them."""

    process: Literal["closed", "poisson", "gamma"] = "closed"
    burstiness: float = Field(default=1.0, gt=0.0, description="Gamma shape (gamma process only).")


class SLO(Validated):
    """Bounds a request must meet to count toward goodput; unset bounds are not checked."""

    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    e2e_ms: float | None = Field(default=None, gt=0)


class BenchWorkload(Validated):
    """One benchmark workload. Its levels: one run per ``concurrency`` value (closed loop), or one
    per ``rates`` value (open loop, at most ``max_concurrency`` requests in flight when set)."""

    name: str = Field(default="default", description="A label for reports.")
    input_len: Lengths = Field(default_factory=lambda: Lengths(mean=128))
    output_len: Lengths = Field(default_factory=lambda: Lengths(mean=128))
    prompts_jsonl: str | None = Field(
        default=None,
        description="A JSONL file of real prompts ({'prompt': ...} per line) instead of synthetic ones.",
    )
    requests: int | None = Field(default=16, ge=1, description="Requests per level.")
    duration_s: float | None = Field(
        default=None, gt=0, description="Seconds per level (instead of requests)."
    )
    concurrency: tuple[int, ...] = Field(
        default=(1,), min_length=1, description="Concurrency levels (a sweep)."
    )
    rates: tuple[float, ...] = Field(default=(), description="Request rates per second (open loop levels).")
    max_concurrency: int | None = Field(
        default=None, ge=1, description="Cap on requests in flight (open loop)."
    )
    arrival: Arrival = Field(default_factory=Arrival)
    stream: bool = True
    shared_prefix_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    shared_prefix_len: int = Field(default=0, ge=0, description="Tokens of the shared prefix.")
    mode: Literal["completion", "chat"] = "completion"
    structured: bool = Field(default=False, description="Ask for JSON output under a small schema.")
    warmup: int = Field(default=1, ge=0, description="Unmeasured requests before each level.")
    seed: int = 0
    temperature: float = Field(default=0.0, ge=0.0)
    slo: SLO = Field(default_factory=SLO)
    price_per_hour: float | None = Field(default=None, ge=0, description="$/hour of the machine, for cost.")

    @model_validator(mode="before")
    @classmethod
    def _shorthands(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            for key in ("input_len", "output_len"):
                if key in data:
                    data[key] = _lengths(data[key])
            if isinstance(data.get("concurrency"), int):
                data["concurrency"] = (data["concurrency"],)
            if isinstance(data.get("rates"), (int, float)):
                data["rates"] = (data["rates"],)
            if data.get("duration_s") is not None and "requests" not in data:
                data["requests"] = None
            if isinstance(data.get("arrival"), str):
                data["arrival"] = {"process": data["arrival"]}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> BenchWorkload:
        if self.requests is None and self.duration_s is None:
            raise ValueError("give requests (a count) or duration_s (seconds) per level")
        if self.requests is not None and self.duration_s is not None:
            raise ValueError("give requests or duration_s, not both")
        if any(c < 1 for c in self.concurrency):
            raise ValueError("concurrency levels must be at least 1")
        if any(r <= 0 for r in self.rates):
            raise ValueError("rates must be positive requests per second")
        if self.arrival.process == "closed" and self.rates:
            raise ValueError("rates need an open-loop arrival process (poisson or gamma)")
        if self.arrival.process != "closed" and not self.rates:
            raise ValueError(f"a {self.arrival.process} arrival process needs rates (requests per second)")
        if self.shared_prefix_fraction > 0:
            if self.shared_prefix_len < 1:
                raise ValueError("shared_prefix_fraction needs shared_prefix_len (tokens) of at least 1")
            if self.input_len.kind == "fixed" and self.shared_prefix_len >= self.input_len.mean:
                raise ValueError("shared_prefix_len must be shorter than input_len")
        return self

    def levels(self) -> list[tuple[str, float]]:
        """The levels this workload runs: ``("concurrency", n)`` or ``("rate", r)`` each."""
        if self.rates:
            return [("rate", r) for r in self.rates]
        return [("concurrency", float(c)) for c in self.concurrency]

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able data, the form results record and compare."""
        return json.loads(self.model_dump_json())


class EmbedWorkload(Validated):
    """An embedding benchmark: ``requests`` calls of each batch size, texts of ``input_len`` tokens."""

    name: str = Field(default="embed", description="A label for reports.")
    task: Literal["embed"] = "embed"
    input_len: Lengths = Field(default_factory=lambda: Lengths(mean=128))
    batch_sizes: tuple[int, ...] = Field(default=(1, 8, 32), min_length=1, description="Texts per call.")
    requests: int = Field(default=16, ge=1, description="Calls per batch size.")
    warmup: int = Field(default=1, ge=0, description="Unmeasured calls before each batch size.")
    seed: int = 0
    normalize: bool = True

    @model_validator(mode="before")
    @classmethod
    def _shorthands(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            if "input_len" in data:
                data["input_len"] = _lengths(data["input_len"])
            if isinstance(data.get("batch_sizes"), int):
                data["batch_sizes"] = (data["batch_sizes"],)
        return data

    @model_validator(mode="after")
    def _consistent(self) -> EmbedWorkload:
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError("batch sizes must be at least 1")
        return self

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able data, the form results record and compare."""
        return dict(json.loads(self.model_dump_json()))

    def prompt_workload(self) -> BenchWorkload:
        """The generate workload whose prompts are this one's texts (``Prompts`` draws them)."""
        return BenchWorkload(input_len=self.input_len, output_len=Lengths(mean=1), seed=self.seed)


#: The name ``unillm.bench`` gave it first, kept: ``unillm.Workload`` is the planner's (context,
#: concurrency, goal), this one a benchmark's (arrivals, lengths, levels, SLOs).
Workload = BenchWorkload


def load_workload(source: str | Path | dict[str, Any] | BenchWorkload) -> BenchWorkload:
    """A ``BenchWorkload`` from a TOML file, a Python file defining ``WORKLOAD`` (a ``BenchWorkload`` or a
    dict), a dict, or a ``BenchWorkload`` itself. Raises ``ConfigError`` for a bad one."""
    if isinstance(source, BenchWorkload):
        return source
    if isinstance(source, dict):
        return BenchWorkload(**source)
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"workload file {str(path)!r} does not exist")
    if path.suffix == ".py":
        namespace: dict[str, Any] = {"__name__": "unillm_bench_workload", "__file__": str(path)}
        exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), namespace)
        value = namespace.get("WORKLOAD")
        if value is None:
            raise ConfigError(f"{str(path)!r} defines no WORKLOAD (a unillm.bench.Workload or a dict)")
        return load_workload(value)
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: the tomli backport (a core dependency there)
        import tomli as tomllib

    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{str(path)!r} is not valid TOML: {exc}") from exc
    table = data.get("workload", data)
    if not isinstance(table, dict):
        raise ConfigError(f"{str(path)!r}: [workload] must be a table")
    return BenchWorkload(**table)
