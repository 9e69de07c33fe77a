"""The hardware data model: ``GPU``, ``EngineBuild`` and ``Hardware``, frozen values that read
and write JSON, and ``load_hardware`` to read a profile from a file."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import MISSING, asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any, Literal

Vendor = Literal["nvidia", "amd", "apple", "intel", "other"]

_GIB = 2**30
_MIB = 2**20


@dataclass(frozen=True)
class GPU:
    """One accelerator. Bytes are bytes; bandwidth is peak GB/s (10^9 bytes per second)."""

    index: int
    vendor: Vendor
    name: str
    memory_total_bytes: int
    memory_free_bytes: int | None = None
    compute_capability: str | None = None  # NVIDIA "8.9"; AMD "gfx942"
    bandwidth_gbps: float | None = None
    bandwidth_source: Literal["nvml", "table", "rocm", "unknown"] = "unknown"
    pcie_gen: int | None = None


@dataclass(frozen=True)
class EngineBuild:
    """An installed engine and the devices its build can use ("cpu", "cuda", "metal", "rocm",
    "vulkan"), found without importing it."""

    name: str  # "llama.cpp", "mlx", "exllamav2", "exllamav3", "vllm"
    version: str | None = None
    devices: tuple[str, ...] = ("cpu",)


@dataclass(frozen=True)
class Hardware:
    """A machine: CPU, memory, accelerators and the links between them, plus findings
    (engine builds that cannot use the accelerator, probes that failed).

    ``cpu_cores`` is the logical CPUs this process may run on; ``ram_bandwidth_gbps`` is the peak
    bandwidth of system memory (on Apple Silicon: of the unified memory), ``None`` when unknown.
    """

    os: str
    arch: str
    cpu_model: str = ""
    cpu_cores: int = 1
    cpu_features: tuple[str, ...] = ()  # "avx2", "avx512f", "amx", "neon", ...
    ram_total_bytes: int = 0
    ram_available_bytes: int | None = None
    ram_bandwidth_gbps: float | None = None
    apple_chip: str | None = None  # "Apple M3 Ultra"
    gpu_usable_memory_bytes: int | None = None  # Apple: Metal's recommended working set
    gpus: tuple[GPU, ...] = ()
    # GPU index pairs joined by a fast GPU-to-GPU link: NVLink/NVSwitch, or AMD xGMI (Infinity Fabric)
    nvlink: tuple[tuple[int, int], ...] = ()
    findings: tuple[str, ...] = field(default=())
    cpu_physical_cores: int | None = None
    engines: tuple[EngineBuild, ...] = ()

    @property
    def apple_silicon(self) -> bool:
        return self.apple_chip is not None

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    def nvlinked(self, indices: Iterable[int]) -> bool:
        """Whether the GPUs ``indices`` are joined pair by pair by NVLink (or AMD xGMI); the one
        statement of the rule. An index this machine has no GPU for counts as unlinked."""
        chosen = list(dict.fromkeys(indices))
        if len(chosen) < 2:
            return True
        pairs = {(min(a, b), max(a, b)) for a, b in self.nvlink}
        return all((min(a, b), max(a, b)) in pairs for i, a in enumerate(chosen) for b in chosen[i + 1 :])

    def all_nvlinked(self) -> bool:
        """Every pair of GPUs joined by NVLink (trivially true with fewer than two)."""
        return self.nvlinked(range(len(self.gpus)))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Hardware:
        from unillm._errors import ConfigError

        problem = _key_problem(data, cls, "the profile")
        for list_key, item_cls in (("gpus", GPU), ("engines", EngineBuild)):
            items = data.get(list_key, [])
            if problem is None and not isinstance(items, list):
                problem = f"{list_key!r} must be a list, not {items!r}"
            for i, item in enumerate(items if isinstance(items, list) else ()):
                problem = problem or _key_problem(item, item_cls, f"{list_key}[{i}]")
        if problem:
            raise ConfigError(f"not a hardware profile: {problem}")
        try:
            gpus = tuple(GPU(**g) for g in data.get("gpus", ()))
            nvlink = tuple(tuple(p) for p in data.get("nvlink", ()))
            engines = tuple(
                EngineBuild(**{**e, "devices": tuple(e.get("devices", ("cpu",)))})
                for e in data.get("engines", ())
            )
            rest = {k: v for k, v in data.items() if k not in ("gpus", "nvlink", "engines")}
            for key in ("cpu_features", "findings"):
                if key in rest:
                    rest[key] = tuple(rest[key])
            hw = cls(gpus=gpus, nvlink=nvlink, engines=engines, **rest)  # type: ignore[arg-type]
        except (TypeError, AttributeError) as exc:
            raise ConfigError(f"not a hardware profile: {exc}") from exc
        problem = hw._problem()
        if problem:
            raise ConfigError(f"not a hardware profile: {problem}")
        return hw

    def _problem(self) -> str | None:
        """What makes this profile unusable (a typo'd number, a link to a GPU that is not there)."""
        if not isinstance(self.os, str) or not isinstance(self.arch, str):
            return "'os' and 'arch' must be strings"
        if not _is_int(self.cpu_cores) or self.cpu_cores < 1:
            return f"cpu_cores must be a positive integer, not {self.cpu_cores!r}"
        if not _is_int(self.ram_total_bytes) or self.ram_total_bytes < 0:
            return f"ram_total_bytes must be a non-negative integer, not {self.ram_total_bytes!r}"
        for g in self.gpus:
            if g.vendor not in ("nvidia", "amd", "apple", "intel", "other"):
                return f"GPU {g.index}: vendor {g.vendor!r} is not one of nvidia, amd, apple, intel, other"
        indices = [g.index for g in self.gpus]
        if indices != list(range(len(indices))):
            return f"GPU indices must be 0, 1, ... in order, not {indices}"
        for g in self.gpus:
            if not _is_int(g.memory_total_bytes) or g.memory_total_bytes < 0:
                return f"GPU {g.index}: memory_total_bytes must be a non-negative integer"
        for pair in self.nvlink:
            if len(pair) != 2 or not all(_is_int(i) and 0 <= i < len(self.gpus) for i in pair):
                return f"nvlink pair {list(pair)!r} does not name two of the GPUs"
        return None

    def summary_lines(self) -> list[str]:
        """Human-readable lines for ``unillm doctor``, each a label padded to 9 characters and a
        value: system, cpu, memory, unified (Apple), gpu N, links, engine, finding."""
        rows = [("system", f"{self.os} {self.arch}")]
        cores = f"{self.cpu_cores} logical CPUs"
        if self.cpu_physical_cores:
            cores += f", {self.cpu_physical_cores} cores"
        features = f"; {', '.join(self.cpu_features)}" if self.cpu_features else ""
        rows.append(("cpu", f"{self.cpu_model or 'unknown model'} ({cores}{features})"))
        ram = f"{_gib(self.ram_total_bytes)} RAM"
        if self.ram_available_bytes is not None:
            ram += f", {_gib(self.ram_available_bytes)} available"
        if self.ram_bandwidth_gbps is not None:
            ram += f", {self.ram_bandwidth_gbps:g} GB/s"
        rows.append(("memory", ram))
        if self.apple_chip:
            usable = self.gpu_usable_memory_bytes
            rows.append(
                (
                    "unified",
                    self.apple_chip + (f", {_gib(usable)} usable by the GPU" if usable is not None else ""),
                )
            )
        for g in self.gpus:
            mem = _gib(g.memory_total_bytes)
            if g.memory_free_bytes is not None:
                mem += f" ({_gib(g.memory_free_bytes)} free)"
            extra = [f"compute {g.compute_capability}"] if g.compute_capability else []
            if g.bandwidth_gbps is not None:
                extra.append(f"{g.bandwidth_gbps:.0f} GB/s ({g.bandwidth_source})")
            if g.pcie_gen:
                extra.append(f"PCIe gen {g.pcie_gen}")
            rows.append((f"gpu {g.index}", ", ".join([g.name, mem, *extra])))
        if len(self.gpus) > 1:
            if self.all_nvlinked():
                rows.append(("links", f"NVLink/xGMI between all {len(self.gpus)} GPUs"))
            elif self.nvlink:
                pairs = ", ".join(f"{a}-{b}" for a, b in self.nvlink)
                rows.append(("links", f"NVLink/xGMI between {pairs}; the rest over PCIe"))
            else:
                rows.append(("links", "PCIe only (no NVLink)"))
        if not self.gpus and not self.apple_chip:
            rows.append(("gpus", "none found"))
        for e in self.engines:
            version = f" {e.version}" if e.version else ""
            rows.append(("engine", f"{e.name}{version} ({', '.join(e.devices)})"))
        rows.extend(("finding", f) for f in self.findings)
        return [f"{label:<9}{value}" for label, value in rows]


def _key_problem(data: object, cls: type, where: str) -> str | None:
    """An unknown or missing key in one JSON object of a profile, named, with the keys it takes
    (a typo'd key would otherwise surface as a constructor's "unexpected keyword argument")."""
    if not isinstance(data, dict):
        return f"{where} must be a JSON object, not {data!r}"
    fields = dataclass_fields(cls)
    known = [f.name for f in fields]
    unknown = [k for k in data if k not in known]
    if unknown:
        return f"unknown key {unknown[0]!r} in {where}; the keys are {', '.join(known)}"
    required = [f.name for f in fields if f.default is MISSING and f.default_factory is MISSING]
    missing = [k for k in required if k not in data]
    if missing:
        return f"{where} is missing the key {missing[0]!r} (required: {', '.join(required)})"
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _gib(n: int) -> str:
    return f"{n / _GIB:.1f} GiB"


#: The top-level keys of ``unillm doctor --json``; ``load_hardware`` reads its ``hardware``.
_DOCTOR_KEYS = frozenset({"python", "hardware", "backends", "plugins", "plugin_failures"})


def load_hardware(path: str | Path) -> Hardware:
    """A hardware profile from a JSON file: what ``Hardware.to_json`` writes, or the whole output
    of ``unillm doctor --json`` (its ``hardware`` object is the profile)."""
    from unillm._errors import ConfigError

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"hardware profile not found: {str(path)!r}") from None
    except ValueError as exc:  # UnicodeDecodeError is one too
        raise ConfigError(f"{str(path)!r} is not valid JSON: {exc}") from exc
    except OSError as exc:  # a directory, no permission, a path too long
        raise ConfigError(f"hardware profile {str(path)!r} cannot be read: {exc.strerror or exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{str(path)!r} is not a hardware profile (a JSON object)")
    if isinstance(data.get("hardware"), dict) and set(data) <= _DOCTOR_KEYS:
        data = data["hardware"]
    return Hardware.from_dict(data)
