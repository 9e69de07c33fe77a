"""``unillm inspect``, ``unillm plan`` and ``unillm select``: what a model is, whether it fits,
and which backend should run it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from unillm.cli._common import (
    _EXIT_DOES_NOT_FIT,
    ConcurrencyOpt,
    ContextOpt,
    GoalOpt,
    HardwareOpt,
    JsonOpt,
    ModelArg,
    _bad,
    _dump,
    _reported,
)

if TYPE_CHECKING:
    from unillm._hardware import Hardware
    from unillm._types import Availability, EngineConfig

__all__ = ["inspect_cmd", "plan_cmd", "select_cmd"]


def _config(model: str, context: int | None, concurrency: int, goal: str) -> EngineConfig:
    """The flags as the config ``auto_engine`` would get, checked here so each refusal names the
    flag."""
    import typing

    from unillm._plan._estimate import Workload

    goals = typing.get_args(typing.get_type_hints(Workload)["goal"])
    if goal not in goals:
        raise _bad(f"unknown goal {goal!r}; use one of {', '.join(goals)}")
    if context is not None and context < 1:
        raise _bad(f"--context must be a positive number of tokens, not {context}")
    if concurrency < 1:
        raise _bad(f"--concurrency must be at least 1 (sequences at once), not {concurrency}")
    from unillm._types import EngineConfig

    return EngineConfig(model=model, context_length=context, concurrency=concurrency, goal=goal)  # type: ignore[arg-type]


def _hardware(profile: Path | None) -> Hardware:
    from unillm._hardware import detect_hardware, load_hardware

    return load_hardware(profile) if profile else detect_hardware()


def _profile_availability(profile: Path, registered: Iterable[str]) -> dict[str, Availability] | None:
    """The backends installed on a profile's machine, when the profile says (``doctor --json``
    lists them; one registered here but not listed there is not installed there); None for a
    hand-written profile, where every registered backend counts as installed."""
    import json

    from unillm._types import Availability

    data = json.loads(profile.read_text(encoding="utf-8"))  # load_hardware has read it already
    listed = data.get("backends") if "hardware" in data else None
    if listed is None:
        return None
    if not isinstance(listed, dict):
        raise _bad(f"{str(profile)!r}: backends must map each backend's name to its availability")
    out = {name: Availability(False, "not installed on the profile's machine") for name in registered}
    for name, entry in listed.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("available"), bool):
            raise _bad(f"{str(profile)!r}: backends.{name} is not an availability record")
        out[name] = Availability(
            entry["available"],
            str(entry.get("reason") or ""),
            entry.get("install_hint") or None,
            entry.get("version") or None,
        )
    return out


def inspect_cmd(
    model: ModelArg,
    as_json: JsonOpt = False,
) -> None:
    """Read a model's format, quantization, size and shape from its headers (never its weights)."""
    from unillm._choose._auto import model_info
    from unillm._types import EngineConfig

    with _reported():
        info = model_info(EngineConfig(model=model))  # a plugin's format, or a name, included
    if as_json:
        _dump(info)
        return
    for name, value in _fields(info):
        if value not in (None, (), False):
            print(f"{name:18s} {value}")
    kv = info.kv_bytes_per_token()
    if kv:
        print(f"{'kv bytes/token':18s} {kv} (f16)")


def _fields(obj: Any) -> list[tuple[str, Any]]:
    import dataclasses

    return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]


def plan_cmd(
    model: ModelArg,
    context: ContextOpt = None,
    concurrency: ConcurrencyOpt = 1,
    goal: GoalOpt = "latency",
    hardware: HardwareOpt = None,
    backend: Annotated[
        str | None,
        typer.Option(help="Plan with this backend's measured memory model (CPU-only machines)."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Will MODEL fit, where, and how fast can decode be? (memory and bandwidth math)

    Exit status: 0 when it fits, 1 when it does not, 2 on bad input.
    """
    from unillm._choose._auto import model_info, workload_for
    from unillm._choose._registry import default_registry
    from unillm._plan._estimate import plan

    cfg = _config(model, context, concurrency, goal)
    with _reported():
        registry = default_registry()
        memory = getattr(registry.get(backend), "memory", None) if backend else None
        machine = _hardware(hardware)
        info = model_info(cfg, registry, machine)  # a name: the quantization that fits, headers only
        result = plan(info, machine, workload_for(cfg, info), engine=memory)
    if as_json:
        _dump(result)
    else:
        _print_plan(result)
    if not result.fits:
        raise typer.Exit(_EXIT_DOES_NOT_FIT)


def _print_plan(result: Any) -> None:
    gib = 2**30
    print(f"weights   {result.weights_bytes / gib:8.2f} GiB")
    print(f"kv cache  {result.kv_bytes / gib:8.2f} GiB ({result.kv_bytes_per_token} bytes/token)")
    print(f"overhead  {result.overhead_bytes / gib:8.2f} GiB")
    print(
        f"total     {result.total_bytes / gib:8.2f} GiB: {'fits' if result.fits else 'does NOT fit'}, "
        f"headroom {result.headroom_bytes / gib:.2f} GiB"
    )
    if result.resident_bytes is not None and result.resident_bytes != result.total_bytes:
        print(f"resident  {result.resident_bytes / gib:8.2f} GiB once loaded (total: at a full context)")
    for p in result.placements:
        print(f"  {p.device}: weights {p.weights_bytes / gib:.2f} GiB, kv {p.kv_bytes / gib:.2f} GiB")
    if result.gpu_layers is not None:
        print(f"gpu layers {result.gpu_layers}")
    if result.decode_tokens_per_s_ceiling:
        print(f"decode ceiling {result.decode_tokens_per_s_ceiling:.0f} tok/s per sequence")
    for note in result.notes:
        print(f"note: {note}")


def select_cmd(
    model: ModelArg,
    context: ContextOpt = None,
    concurrency: ConcurrencyOpt = 1,
    goal: GoalOpt = "latency",
    hardware: HardwareOpt = None,
    explain: Annotated[bool, typer.Option(help="Print every candidate and the ten questions.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Which backend should run MODEL here (or on the --hardware machine), and why.

    With --hardware the choice is the profile machine's: the backends a `doctor --json` profile
    lists as installed, or every registered backend for a hand-written profile, as
    `unillm.select()` does; without it, this machine and the backends installed here.
    """
    from unillm._choose._auto import choose
    from unillm._choose._registry import default_registry
    from unillm._types import Availability

    cfg = _config(model, context, concurrency, goal)
    with _reported():
        registered = default_registry().backends()
        if hardware is not None:  # the profile's machine, and what it has installed
            listed = _profile_availability(hardware, registered)
            available = listed if listed is not None else {n: Availability(True) for n in registered}
            result = choose(cfg, hardware=_hardware(hardware), available=available).selection
        else:
            result = choose(cfg).selection
    if as_json:
        _dump(result)
    elif explain:
        print(result.explain())
    else:
        print(result.backend or f"none installed; {result.recommendation}")
