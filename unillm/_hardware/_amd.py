"""AMD GPUs: ``amd-smi``, else ``rocm-smi``; xGMI links from ``rocm-smi --showtopotype``."""

from __future__ import annotations

import json
import re
import shutil
from typing import Any, Literal

from unillm._hardware._bandwidth import bandwidth_from_table
from unillm._hardware._model import _GIB, _MIB, GPU
from unillm._hardware._run import _run


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
