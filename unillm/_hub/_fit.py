"""The quantization that fits: of a repo's GGUF files (the same model at several precisions), the
highest-precision one the planner says fits this machine at the workload asked for, margin and
all. A pure function over data, like the planner it asks: a hardware profile is a literal in a
test.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from unillm._hub._files import GgufFile, pick_gguf
from unillm._inspect import ModelInfo
from unillm._plan._estimate import Workload, plan

if TYPE_CHECKING:
    from unillm._hardware import Hardware

__all__ = ["QuantChoice", "QuantOption", "choose_gguf", "human"]


@dataclass(frozen=True)
class QuantOption:
    """One GGUF file weighed: its size, whether it fits, the memory left over (``headroom_bytes``,
    negative when short) and the plan's total."""

    file: GgufFile
    fits: bool | None
    total_bytes: int | None
    headroom_bytes: int | None
    note: str = ""

    def line(self, chosen: bool) -> str:
        name = self.file.quant or self.file.path
        parts = f", {len(self.file.parts)} parts" if len(self.file.parts) > 1 else ""
        head = f"{'*' if chosen else ' '} {name} ({human(self.file.size)}{parts}, {self.file.path})"
        if self.fits is None:
            return f"{head}: not planned (no hardware)"
        assert self.total_bytes is not None and self.headroom_bytes is not None
        verdict = (
            "fits"
            if self.fits
            else f"does not fit{' in fast memory (' + self.note + ')' if self.note else ''}"
        )
        return f"{head}: needs {human(self.total_bytes)}, {verdict}, headroom {human(self.headroom_bytes)}"


def human(n: int) -> str:
    """Bytes for people: GiB from 1 GiB up, MiB below."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class QuantChoice:
    """The file chosen, every option weighed (highest precision first) and why the chosen one won."""

    chosen: GgufFile
    options: tuple[QuantOption, ...]
    why: str

    def lines(self) -> list[str]:
        """The options as ``explain()`` lists them, the chosen one marked ``*``, then why."""
        return [o.line(o.file == self.chosen) for o in self.options] + [f"  {self.why}"]


def choose_gguf(
    repo: str,
    files: list[GgufFile],
    base: ModelInfo,
    hardware: Hardware | None,
    workload: Workload,
    tag: str | None = None,
) -> QuantChoice:
    """The file to load: with ``tag``, the one it names (said when it does not fit); without, the
    largest (highest precision) whose plan fits ``hardware`` at ``workload``, else the smallest.
    ``base`` is the model's shape (any one file's header: they are the same model); each option
    is planned with its own size and quantization. With no hardware known, llama.cpp's default
    rule decides (``pick_gguf``)."""
    ranked = sorted(files, key=lambda f: (f.size, f.bits or 0), reverse=True)
    options = tuple(_weigh(f, base, hardware, workload) for f in ranked)
    where = f"{workload.context_length} tokens x {workload.concurrency}"
    if tag is not None:
        chosen = pick_gguf(repo, files, tag)
        mine = next(o for o in options if o.file == chosen)
        why = f"{tag} was asked for" + ("" if mine.fits in (True, None) else f"; it does NOT fit at {where}")
        return QuantChoice(chosen, options, why)
    if hardware is None:
        chosen = pick_gguf(repo, files, None)
        return QuantChoice(
            chosen, options, "no hardware known: llama.cpp's default (Q4_K_M, else Q8_0, else the first)"
        )
    fitting = [o for o in options if o.fits]
    if fitting:
        best = fitting[0]
        bigger = [o for o in options if o.file.size > best.file.size]
        why = f"the highest precision that fits at {where}" + (
            f" (larger ones do not: {', '.join(o.file.quant or o.file.path for o in bigger)})"
            if bigger
            else ""
        )
        return QuantChoice(best.file, options, why)
    smallest = options[-1]
    return QuantChoice(
        smallest.file,
        options,
        f"none fits at {where}: the smallest, which may still load with a smaller context",
    )


def _weigh(f: GgufFile, base: ModelInfo, hardware: Hardware | None, workload: Workload) -> QuantOption:
    if hardware is None:
        return QuantOption(f, None, None, None)
    info = replace(
        base,
        weights_bytes=f.size,
        quantization=f.quant or base.quantization,
        bits_per_weight=f.bits or base.bits_per_weight,
        estimated=(),
    )
    try:
        p = plan(info, hardware, workload)
    except Exception:  # a plan is advice: an option it cannot weigh is not a failure
        return QuantOption(f, None, None, None)
    # fast memory: on a machine with GPUs, a file that fits only by leaving layers in system RAM
    # (partial offload, or the CPU) does not count as fitting
    slow = bool(hardware.gpus) and (
        p.gpu_layers is not None or any(pl.device == "cpu" for pl in p.placements)
    )
    return QuantOption(
        f,
        p.fits and not slow,
        p.total_bytes,
        p.headroom_bytes,
        "only with layers in system RAM" if p.fits and slow else "",
    )
