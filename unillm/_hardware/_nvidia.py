"""NVIDIA GPUs: through NVML when ``pynvml`` is at hand, else ``nvidia-smi``; and the GPUs
CUDA_VISIBLE_DEVICES lets this process see."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

from unillm._hardware._bandwidth import bandwidth_from_table, nvml_bandwidth
from unillm._hardware._model import _MIB, GPU
from unillm._hardware._run import _T, _bounded, _run


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
