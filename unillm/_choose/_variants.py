"""Variants of one model: the same weights in several copies (the HF-format repo, its AWQ and GPTQ
quantizations, an MLX conversion, a GGUF repo, a local path), named by the user in
``EngineConfig.variants``, and the one ``auto_engine`` loads: the highest precision that an
installed backend runs and that fits this machine at the workload asked for, the planner's margin
and all; when none fits, the smallest one that runs.

Each variant is weighed as ``auto_engine`` weighs one model (``choose``: headers only, nothing
downloaded), so its format, its quantization and its plan are the ones a load would use.
``Selection.explain()`` lists every variant with its precision, size, the backend that would run
it and its fit, and says why the chosen one won. A pure function over those weighings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unillm._hub._fit import human
from unillm._inspect import ModelInfo

__all__ = ["Weighed", "pick", "weigh"]


@dataclass(frozen=True)
class Weighed:
    """One variant weighed: the ``backend`` that would run it here (None: none would, ``why_not``
    says why), what it is, and whether its plan fits (None: not planned)."""

    name: str
    backend: str | None
    info: ModelInfo | None
    fits: bool | None
    total_bytes: int | None = None
    headroom_bytes: int | None = None
    why_not: str = ""

    @property
    def precision(self) -> tuple[float, int]:
        """Bits per weight, then the weights' size: the order variants are ranked in."""
        info = self.info
        return (info.bits_per_weight or 0.0, info.weights_bytes or 0) if info is not None else (0.0, 0)

    def line(self, chosen: bool) -> str:
        head = f"{'*' if chosen else ' '} {self.name}"
        if self.info is not None:
            bits = self.info.bits_per_weight
            quant = self.info.quantization or "?"
            size = human(self.info.weights_bytes) if self.info.weights_bytes else "size unknown"
            head += f" ({self.info.format}, {quant}{f', {bits:.1f} bits' if bits else ''}, {size})"
        if self.backend is None:
            return f"{head}: no installed backend runs it ({self.why_not or 'not readable here'})"
        if self.fits is None:
            return f"{head}: {self.backend}, not planned (no hardware)"
        assert self.total_bytes is not None and self.headroom_bytes is not None
        verdict = "fits" if self.fits else "does not fit"
        return (
            f"{head}: {self.backend}, needs {human(self.total_bytes)}, {verdict}, "
            f"headroom {human(self.headroom_bytes)}"
        )


def weigh(name: str, choice: Any) -> Weighed:
    """``name`` as ``choice`` (``auto_engine``'s ``Choice`` for it) stands: its first backend that
    runs it, and that backend's plan."""
    selection = choice.selection
    runs = [c for c in selection.candidates if c.eligible]
    if not runs:
        blockers = [b for c in selection.candidates for b in c.blockers]
        info = next((m for m, _, _ in choice.facts.values() if isinstance(m, ModelInfo)), None)
        return Weighed(name, None, info, None, why_not=blockers[0] if blockers else "")
    model, _, the_plan = choice.facts[runs[0].name]
    info = model if isinstance(model, ModelInfo) else None
    if the_plan is None:
        return Weighed(name, runs[0].name, info, None)
    return Weighed(name, runs[0].name, info, the_plan.fits, the_plan.total_bytes, the_plan.headroom_bytes)


def _order(weighed: list[Weighed]) -> list[int]:
    """The variants' indices, highest precision first."""
    return sorted(range(len(weighed)), key=lambda i: weighed[i].precision, reverse=True)


def pick(weighed: list[Weighed], where: str) -> tuple[int, str]:
    """The index of the variant to load, and why it won. ``where`` is the workload in words."""
    order = _order(weighed)
    runnable = [i for i in order if weighed[i].backend is not None]
    if not runnable:
        return 0, "no installed backend runs any of them: the first, whose selection says why"
    fitting = [i for i in runnable if weighed[i].fits is not False]
    if fitting:
        best = fitting[0]
        unplanned = weighed[best].fits is None
        return best, (
            "the highest precision an installed backend runs"
            + (" (no hardware known: fit not weighed)" if unplanned else f" that fits at {where}")
        )
    smallest = min(runnable, key=lambda i: weighed[i].total_bytes or 0)
    return (
        smallest,
        f"none that runs here fits at {where}: the smallest, which may still load with a smaller context",
    )


def ranked_lines(weighed: list[Weighed], chosen: int, why: str) -> list[str]:
    """The variants as ``explain()`` lists them, highest precision first, the chosen one marked."""
    order = _order(weighed)
    return (
        ["variants (highest precision first, * chosen):"]
        + [f"  {weighed[i].line(i == chosen)}" for i in order]
        + [f"  {why}"]
    )
