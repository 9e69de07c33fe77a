"""The field's decision guide, as data: which engine serves a case best, in order (docs/field.md).

Each ``GuideEntry`` names an engine for a case (model formats, kind of machine, number of GPUs,
local use or serving) with a rank (0: the first choice) and a reason. The selector gives every
candidate the bonus of the best-ranked entry that names it for the case (``bonus()``), on top of
the backend's own ``suitability()`` score. Entries may name engines that are not installed, or not
registered at all: the selector then recommends them with ``install``. Plugins add entries through
the ``unillm_guide_entries`` hook; they are ranked by the same rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from unillm._types import normalize_name

if TYPE_CHECKING:
    from unillm._hardware import Hardware
    from unillm._plan._estimate import Workload

__all__ = ["GUIDE", "GuideEntry", "Case", "bonus", "case_of", "matching"]

Machine = Literal["cpu", "apple", "nvidia", "amd"]
MANY_USERS = 4
"""Above this many concurrent requests the case is serving: batching decides."""


@dataclass(frozen=True)
class Case:
    """What the guide looks at: the model's format, the kind of machine, how many of its GPUs,
    and whether it serves several users (or is asked for throughput)."""

    format: str
    machine: Machine
    gpus: int
    serving: bool


@dataclass(frozen=True)
class GuideEntry:
    """One line of the guide: ``engine`` for the case these fields describe (None: any).

    - ``formats``: model formats (``{"gguf"}``); ``machines``: ``cpu``, ``apple``, ``nvidia``,
      ``amd`` (the machine's kind: Apple Silicon, else the vendor of its GPUs, else cpu).
    - ``gpus``: ``"one"`` or ``"several"`` GPUs of that kind; ``workload``: ``"local"`` (a few
      users, latency) or ``"serving"`` (more than four at once, or goal throughput).
    - ``rank``: 0 for the first choice, 1 for the next; the bonus is ``2.0 - 0.5 x rank``.
    - ``install``: how to get the engine, shown when it is the first choice and not installed
      (registered backends' own ``install_hint`` is used first).
    """

    engine: str
    reason: str = ""
    formats: frozenset[str] | None = None
    machines: frozenset[str] | None = None
    gpus: Literal["one", "several"] | None = None
    workload: Literal["local", "serving"] | None = None
    rank: int = 0
    install: str | None = None

    def matches(self, case: Case) -> bool:
        return (
            (self.formats is None or case.format in self.formats)
            and (self.machines is None or case.machine in self.machines)
            and (self.gpus is None or ((self.gpus == "one") == (case.gpus == 1) and case.gpus > 0))
            and (self.workload is None or (self.workload == "serving") == case.serving)
        )


def _e(engine: str, reason: str, **where: Any) -> GuideEntry:
    for key in ("formats", "machines"):
        if key in where:
            where[key] = frozenset(where[key])
    return GuideEntry(engine, reason, **where)


_QUANT_SERVING = ("awq", "gptq", "fp8", "compressed-tensors", "bitsandbytes", "mxfp4")
_PLAIN = ("safetensors",)

#: The built-in guide. Read a case's entries top to bottom within each rank.
GUIDE: tuple[GuideEntry, ...] = (
    # formats that only one engine reads
    _e("llama.cpp", "GGUF is llama.cpp's own format", formats=["gguf"]),
    _e("mlx", "MLX-quantized weights have kernels only in MLX", formats=["mlx"]),
    _e("exllamav2", "EXL2 is ExLlamaV2's format", formats=["exl2"]),
    _e("exllamav3", "EXL3 is ExLlamaV3's format", formats=["exl3"],
       install="pip install exllamav3 and a unillm ExLlamaV3 plugin (docs/plugins.md)"),
    # quantized serving formats
    *(_e("vllm", f"vLLM has optimized kernels for {fmt}", formats=[fmt]) for fmt in _QUANT_SERVING),
    _e("exllamav2", "ExLlamaV2 also runs 4-bit GPTQ on one NVIDIA GPU", formats=["gptq"],
       machines=["nvidia"], gpus="one", workload="local", rank=1),
    _e("sglang", "SGLang serves quantized models with RadixAttention prefix sharing",
       formats=_QUANT_SERVING, machines=["nvidia", "amd"], workload="serving", rank=1,
       install="run an SGLang server and use unillm's OpenAI-compatible backend plugin"),
    # plain (unquantized) safetensors
    _e("mlx", "Apple Silicon: MLX runs on the unified memory's GPU", formats=_PLAIN, machines=["apple"]),
    _e("vllm", "", formats=_PLAIN, machines=["apple"], rank=1),
    _e("vllm", "several users or GPUs: vLLM's continuous batching and parallelism", formats=_PLAIN,
       machines=["nvidia"], workload="serving"),
    _e("vllm", "several users or GPUs: vLLM's continuous batching and parallelism", formats=_PLAIN,
       machines=["nvidia"], gpus="several", workload="local"),
    _e("exllamav2", "ExLlamaV2 loads FP16/BF16 too", formats=_PLAIN, machines=["nvidia"],
       workload="serving", rank=1),
    _e("exllamav2", "ExLlamaV2 loads FP16/BF16 too", formats=_PLAIN, machines=["nvidia"],
       gpus="several", workload="local", rank=1),
    _e("exllamav2", "one NVIDIA GPU, local use: ExLlamaV2", formats=_PLAIN, machines=["nvidia"],
       gpus="one", workload="local"),
    _e("vllm", "vLLM if several users share it", formats=_PLAIN, machines=["nvidia"], gpus="one",
       workload="local", rank=1),
    _e("sglang", "SGLang: continuous batching with prefix sharing", formats=_PLAIN,
       machines=["nvidia", "amd"], workload="serving", rank=1,
       install="run an SGLang server and use unillm's OpenAI-compatible backend plugin"),
    _e("vllm", "AMD GPUs: vLLM on ROCm", formats=_PLAIN, machines=["amd"]),
    _e("vllm", "CPU, several users: vLLM's CPU build batches", formats=_PLAIN, machines=["cpu"],
       workload="serving"),
    _e("mlx", "mlx's CPU build", formats=_PLAIN, machines=["cpu"], workload="serving", rank=1),
    _e("mlx", "CPU only: mlx's CPU build reads HF weights", formats=_PLAIN, machines=["cpu"],
       workload="local"),
    _e("vllm", "vLLM's CPU build", formats=_PLAIN, machines=["cpu"], workload="local", rank=1),
)  # fmt: skip


def case_of(hardware: Hardware | None, model: Any, workload: Workload | None) -> Case:
    """The guide's view of a model on a machine under a workload."""
    users = workload.concurrency if workload else 1
    serving = bool(workload and workload.goal == "throughput") or users > MANY_USERS
    gpus = hardware.gpus if hardware else ()
    machine: Machine = "cpu"
    count = 0
    if hardware is not None and hardware.apple_silicon:
        machine = "apple"
    else:
        for vendor in ("nvidia", "amd"):
            count = sum(1 for g in gpus if g.vendor == vendor)
            if count:
                machine = vendor  # type: ignore[assignment]
                break
    return Case(str(getattr(model, "format", "unknown")), machine, count, serving)


def matching(case: Case, entries: Iterable[GuideEntry]) -> list[GuideEntry]:
    """The entries for ``case``, best rank first (table order within a rank)."""
    return sorted((e for e in entries if e.matches(case)), key=lambda e: e.rank)


def bonus(name: str, entries: Sequence[GuideEntry]) -> tuple[float, GuideEntry | None]:
    """The guide's bonus for backend ``name`` among a case's ``entries``: 2.0 - 0.5 x the rank
    of the best entry naming it (never below 0), and that entry; 0 and None when none names it."""
    key = normalize_name(name)
    for entry in entries:  # best rank first
        if normalize_name(entry.engine) == key:
            return max(0.0, 2.0 - 0.5 * entry.rank), entry
    return 0.0, None
