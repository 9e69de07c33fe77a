"""Choosing a backend: a pure function over data (hardware, model, workload, backends).

``select()`` scores every registered backend through its own ``suitability()`` (where each
backend states its hard rules), adds the decision guide's bonus (unillm/_choose/_guide.py, data), and
returns every candidate ranked with its reasons and blockers. ``Selection.explain()`` answers the
field's ten questions for the case (docs/field.md). When the guide's first choice for a case is
not installed, the explanation says so and how to get it. Nothing here names an engine.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from unillm._choose._guide import GUIDE, MANY_USERS, GuideEntry, bonus, case_of, matching
from unillm._types import normalize_name

if TYPE_CHECKING:
    from unillm._choose._registry import BackendInfo
    from unillm._contract._engine import Engine
    from unillm._hardware import Hardware
    from unillm._inspect import ModelInfo
    from unillm._plan._estimate import Plan, Workload
    from unillm._types import Availability

__all__ = ["Candidate", "Selection", "guide", "select"]


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
    files: list[str] = field(default_factory=list)  # a model name: what it resolved to, quantizations weighed

    def explain(self) -> str:
        """A plain-text account: the choice, every candidate with its reasons, the ten questions."""
        lines = [
            f"model:   {self.model} (format: {self.format})",
            f"backend: {self.backend} (chosen by {self.chosen_by})",
        ]
        if self.workload:
            lines.append(f"workload: {self.workload}")
        if self.files:
            lines.append("files:")
            lines.extend(f"  {line}" for line in self.files)
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


def guide(
    hardware: Hardware | None,
    model: Any,
    workload: Workload | None,
    entries: Iterable[GuideEntry] = GUIDE,
) -> list[tuple[str, str]]:
    """The decision guide for this case: engines in order of preference, each with its reason."""
    return [(e.engine, e.reason) for e in matching(case_of(hardware, model, workload), entries)]


def select(
    hardware: Hardware | None,
    model: ModelInfo | Any,
    workload: Workload | None,
    backends: Mapping[str, BackendInfo],
    *,
    available: Mapping[str, Availability] | None = None,
    plan: Plan | None = None,
    requested: str | None = None,
    guide_entries: Iterable[GuideEntry] | None = None,
) -> Selection:
    """Rank ``backends`` for ``model`` on ``hardware`` under ``workload``; pure, no I/O.

    Every backend, built-in or plugin, is ranked by one rule: eligible (no blockers) first, then
    by score = its ``suitability()`` score + the guide's bonus for it in this case (2.0 - 0.5 x
    the rank of the best entry naming it; docs/selection.md), then in registration order.
    ``available`` gives each backend's availability (from ``BackendInfo.availability()``, which
    does I/O; missing entries count as available). ``plan`` adds fit and speed to the reasons and
    reaches each backend's ``suitability(..., plan=)``. ``requested`` names the user's backend,
    which always wins (its problems become reasons). ``guide_entries`` defaults to the built-in
    guide; ``Registry.guide()`` adds the plugins' entries.
    """
    entries = matching(case_of(hardware, model, workload), GUIDE if guide_entries is None else guide_entries)
    candidates = []
    for info in backends.values():
        try:
            fit = _suitability(info.cls, hardware, model, workload, plan)
            reasons, blockers, score = list(fit.reasons), list(fit.blockers), float(fit.score)
        except Exception as exc:  # a plugin's bug must not break selection
            reasons, blockers, score = [], [f"its suitability check failed: {exc!r}"], 0.0
        if (refused := task_refusal(info.cls, model, workload)) is not None:
            blockers.append(refused)
        extra, entry = bonus(info.name, entries)
        score += extra
        if entry is not None and entry.reason:
            reasons.insert(0, entry.reason)
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
    if entries:
        first = entries[0]
        have = {normalize_name(c.name): c for c in candidates}
        best = have.get(normalize_name(first.engine))
        if best is None or not best.eligible:
            registered = next(
                (i for i in backends.values() if normalize_name(i.name) == normalize_name(first.engine)), None
            )
            hint = (
                (registered.cls.install_hint if registered else None)
                or first.install
                or f"install a backend plugin for {first.engine}"
            )
            selection.recommendation = (
                f"the field's first choice here is {first.engine} ({first.reason}): {hint}"
            )
    selection.answers = _ten_questions(hardware, model, workload, plan, chosen)
    return selection


def task_refusal(cls: type[Engine[Any]], model: Any, workload: Workload | None) -> str | None:
    """Why ``cls`` cannot load for the workload's task (embed, rerank), or None."""
    task = getattr(workload, "task", "generate")
    caps = cls.capabilities
    if task == "embed" and not caps.embeddings:
        why = "the model is an embedding model" if getattr(model, "task", None) == "embed" else "task='embed'"
        return f"computes no embeddings ({why})"
    if task == "rerank" and not caps.rerank:
        return "runs no rerankers (task='rerank')"
    return None


def _suitability(cls: type[Engine[Any]], hardware: Any, model: Any, workload: Any, plan: Plan | None) -> Any:
    """``cls.suitability``, given the plan when its signature takes one (a plugin written before
    ``plan`` was passed still works)."""
    if _takes_plan(cls.suitability):
        return cls.suitability(hardware, model, workload, plan=plan)
    return cls.suitability(hardware, model, workload)


def _takes_plan(fn: Any) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "plan" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


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
        ("deployment", "production serving" if users > MANY_USERS else "local use"),
        ("quantization", f"{quant}: kernels on {chosen or 'no installed engine'}"),
        ("interconnect", link),
        ("goal", wl.goal if wl else "latency"),
    ]


def _size(n: int) -> str:
    """Bytes for people: GiB from 1 GiB up, MiB below."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
