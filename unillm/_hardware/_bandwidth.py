"""Peak memory bandwidth figures: GPUs by name, from NVML's clocks, and Apple chips."""

from __future__ import annotations

import re

from unillm._hardware._model import _GIB

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
