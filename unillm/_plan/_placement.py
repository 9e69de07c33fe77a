"""Where a plan puts the weights and the KV cache: the placements the planner tries, in order
(one GPU, the fewest GPUs that fit, partial layer offload, unified memory, the CPU), and the
tensor-parallel head rule. Pure functions over data; unillm/_plan/_estimate.py documents the formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from unillm._hardware import GPU, Hardware
    from unillm._inspect import ModelInfo

__all__ = ["Placement", "Strategy", "tensor_parallel_ok"]

RESERVE_FRACTION = 0.05
"""Share of every device's capacity the planner keeps free (fragmentation, other processes)."""
APPLE_DEFAULT_WORKING_SET = 0.75
"""Metal's recommended working set as a share of unified memory when the profile does not say."""

Strategy = Literal["single_gpu", "multi_gpu", "partial_offload", "unified", "cpu"]


@dataclass(frozen=True)
class Placement:
    """Where the weights and KV cache go on one device ("gpu:0", "cpu", "unified").

    ``overhead_bytes`` is that device's runtime overhead, ``capacity_bytes`` its budget (capacity
    less the reserve); ``layers`` is how many whole layers it holds (None under tensor parallelism,
    where every GPU holds a slice of every layer).
    """

    device: str
    weights_bytes: int
    kv_bytes: int
    layers: int | None = None
    capacity_bytes: int | None = None
    overhead_bytes: int = 0
    bandwidth_gbps: float | None = None


@dataclass(frozen=True)
class _Device:
    name: str
    budget: int
    bandwidth_gbps: float | None
    index: int = 0


@dataclass(frozen=True)
class _Attempt:
    strategy: Strategy
    placements: tuple[Placement, ...]
    fits: bool
    headroom: int
    gpu_layers: int | None = None
    parallelism: Literal["tensor", "pipeline"] | None = None
    notes: tuple[str, ...] = ()


# ---- placements ----------------------------------------------------------------------------------


def _budget(capacity: int) -> int:
    return int(capacity * (1 - RESERVE_FRACTION))


def _ram_capacity(hardware: Hardware) -> int:
    return (
        hardware.ram_available_bytes if hardware.ram_available_bytes is not None else hardware.ram_total_bytes
    )


def _gpu_capacity(gpu: GPU) -> int:
    return gpu.memory_free_bytes if gpu.memory_free_bytes is not None else gpu.memory_total_bytes


def _attempts(
    model: ModelInfo, hardware: Hardware, weights: int, kv: int, overhead: int, notes: list[str]
) -> list[_Attempt]:
    ram = _Device("cpu", _budget(_ram_capacity(hardware)), hardware.ram_bandwidth_gbps)
    attempts: list[_Attempt] = []
    if hardware.apple_silicon:
        usable = hardware.gpu_usable_memory_bytes
        if usable is None:
            usable = int(hardware.ram_total_bytes * APPLE_DEFAULT_WORKING_SET)
            notes.append(
                f"Apple GPU working set unknown: assumed {APPLE_DEFAULT_WORKING_SET:.0%} of unified memory"
            )
        if hardware.ram_available_bytes is not None and hardware.ram_available_bytes < usable:
            usable = hardware.ram_available_bytes
            notes.append("less unified memory is free than the GPU working set: planned against what is free")
        bandwidths = [g.bandwidth_gbps for g in hardware.gpus if g.bandwidth_gbps]
        unified = _Device(
            "unified", _budget(usable), bandwidths[0] if bandwidths else hardware.ram_bandwidth_gbps
        )
        attempts.append(_on_one(unified, "unified", weights, kv, overhead))
        partial = _partial(model, unified, ram, weights, kv, overhead, shared=True)
        if partial is not None:
            attempts.append(partial)
    else:
        gpus = sorted(
            (
                _Device(f"gpu:{g.index}", _budget(_gpu_capacity(g)), g.bandwidth_gbps, g.index)
                for g in hardware.gpus
                if g.vendor != "apple"
            ),
            key=lambda d: -d.budget,
        )
        if gpus:
            attempts.append(_on_one(gpus[0], "single_gpu", weights, kv, overhead))
            linked = _nvlinked(hardware, [g.index for g in gpus])
            for k in range(2, len(gpus) + 1):
                split = _split(model, gpus[:k], linked[k], weights, kv, overhead)
                if split is not None:
                    attempts.append(split)
                    if split.fits:
                        break
            partial = _partial(model, gpus[0], ram, weights, kv, overhead, shared=False)
            if partial is not None:
                if len(gpus) > 1:
                    one = "partial offload uses one GPU (layer offload is not run across several)"
                    partial = replace(partial, notes=(*partial.notes, one))
                attempts.append(partial)
    attempts.append(_on_one(ram, "cpu", weights, kv, overhead))
    if hardware.ram_available_bytes is None:
        ram_note = (
            "system RAM unknown: no RAM budget"
            if hardware.ram_total_bytes == 0
            else "RAM available unknown: planned against total RAM"
        )
        attempts = [
            replace(a, notes=(*a.notes, ram_note)) if a.strategy in ("cpu", "partial_offload") else a
            for a in attempts
        ]
    return attempts


def _on_one(device: _Device, strategy: Strategy, weights: int, kv: int, overhead: int) -> _Attempt:
    headroom = device.budget - (weights + kv + overhead)
    placement = Placement(
        device=device.name,
        weights_bytes=weights,
        kv_bytes=kv,
        capacity_bytes=device.budget,
        overhead_bytes=overhead,
        bandwidth_gbps=device.bandwidth_gbps,
    )
    return _Attempt(strategy, (placement,), headroom >= 0, headroom)


def _nvlinked(hardware: Hardware, indices: list[int]) -> dict[int, bool]:
    """For each k, whether the first k GPUs of ``indices`` are all joined pairwise by NVLink."""
    return {k: hardware.nvlinked(indices[:k]) for k in range(2, len(indices) + 1)}


def _split(
    model: ModelInfo, gpus: list[_Device], nvlink: bool, weights: int, kv: int, overhead: int
) -> _Attempt | None:
    k = len(gpus)
    if nvlink and not tensor_parallel_ok(model.heads, model.kv_heads, k):
        return None
    room = [max(0, g.budget - overhead) for g in gpus]
    total_room = sum(room)
    if total_room == 0:
        return None
    shares = [r / total_room for r in room]
    layers = _distribute(model.layers, shares) if not nvlink and model.layers else [None] * k
    w_parts = _apportion(weights, shares)
    kv_parts = _apportion(kv, shares)
    placements = tuple(
        Placement(
            device=g.name,
            weights_bytes=w,
            kv_bytes=c,
            layers=n,
            capacity_bytes=g.budget,
            overhead_bytes=overhead,
            bandwidth_gbps=g.bandwidth_gbps,
        )
        for g, w, c, n in zip(gpus, w_parts, kv_parts, layers, strict=True)
    )
    headroom = sum(g.budget for g in gpus) - (weights + kv + k * overhead)
    if nvlink:
        note = f"split over {k} GPUs joined by NVLink: tensor parallelism, bandwidths add"
    else:
        note = (
            f"split over {k} GPUs without NVLink: pipeline parallelism (layers split), since tensor "
            "parallelism's all-reduce over PCIe limits it; one sequence runs at one GPU's bandwidth"
        )
    parallelism: Literal["tensor", "pipeline"] = "tensor" if nvlink else "pipeline"
    return _Attempt("multi_gpu", placements, headroom >= 0, headroom, parallelism=parallelism, notes=(note,))


def tensor_parallel_ok(heads: int | None, kv_heads: int | None, k: int) -> bool:
    """Whether ``k``-way tensor parallelism can shard a model with these attention heads: the
    heads split evenly, and the KV heads split or are replicated (when fewer than ``k``, ``k``
    must be a multiple of them). Unknown counts do not block. The one statement of the rule."""
    if heads and heads % k:
        return False
    return not (kv_heads and kv_heads % k and k % kv_heads)


def _apportion(total: int, shares: list[float]) -> list[int]:
    """``total`` bytes in proportion to ``shares``, the last part taking the rounding remainder."""
    parts = [round(total * s) for s in shares[:-1]]
    return [*parts, total - sum(parts)]


def _distribute(total: int, shares: list[float]) -> list[int | None]:
    """Whole layers in proportion to ``shares`` (largest remainder)."""
    raw = [total * s for s in shares]
    counts = [math.floor(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: counts[i] - raw[i])
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return list(counts)


def _partial(
    model: ModelInfo, gpu: _Device, ram: _Device, weights: int, kv: int, overhead: int, *, shared: bool
) -> _Attempt | None:
    """Partial (layer) offload: whole layers (their weights and KV) on the GPU, the rest in RAM.

    ``shared``: the GPU's memory is part of RAM (Apple unified memory), so RAM's budget shrinks by
    what the GPU holds.
    """
    layers = model.layers
    if not layers or weights == 0:
        return None
    per_layer = (weights + kv) / layers
    n = math.floor(max(0, gpu.budget - overhead) / per_layer) if per_layer else layers
    n = min(n, layers - 1)  # all layers on the GPU is the single-device attempt
    if n <= 0:
        return None
    gpu_w, gpu_kv = round(weights * n / layers), round(kv * n / layers)
    ram_w, ram_kv = weights - gpu_w, kv - gpu_kv
    ram_budget = ram.budget - (gpu_w + gpu_kv + overhead if shared else 0)
    headroom = (gpu.budget - (gpu_w + gpu_kv + overhead)) + (ram_budget - (ram_w + ram_kv + overhead))
    placements = (
        Placement(gpu.name, gpu_w, gpu_kv, n, gpu.budget, overhead, gpu.bandwidth_gbps),
        Placement(ram.name, ram_w, ram_kv, layers - n, ram_budget, overhead, ram.bandwidth_gbps),
    )
    note = (
        f"partial offload: {n} of {layers} layers (weights and their KV) on {gpu.name}, "
        f"{layers - n} in system RAM; layers counted as equal shares of weights + KV"
    )
    fits = ram_budget - (ram_w + ram_kv + overhead) >= 0
    return _Attempt("partial_offload", placements, fits, headroom, gpu_layers=n, notes=(note,))
