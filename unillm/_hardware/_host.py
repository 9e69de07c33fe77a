"""The host: CPU model, features and cores, and memory (Linux, macOS with Apple Silicon's unified
memory, Windows)."""

from __future__ import annotations

import os
import platform
import re
import sys
from collections.abc import Iterable
from typing import Any

from unillm._hardware._bandwidth import apple_bandwidth
from unillm._hardware._model import _GIB, _gib
from unillm._hardware._run import _read, _run

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
