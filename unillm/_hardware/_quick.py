"""Quick probes an engine makes at load or in ``available()``, without the full hardware probe:
whether a CUDA or ROCm GPU is there, and how much RAM this process can still take now."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from unillm._hardware._host import _linux_memory

__all__ = ["available_ram_bytes", "gpu_present", "gpu_probe"]


def gpu_present(override_env: str | None = None) -> bool:
    """A CUDA or ROCm GPU is there. ``override_env`` names a variable that, set to "1" or "0",
    replaces the probe (for tests, and machines whose GPU the probe cannot see)."""
    forced = os.environ.get(override_env, "").strip() if override_env else ""
    if forced in ("0", "1"):
        return forced == "1"
    return gpu_probe()


@functools.lru_cache(maxsize=1)
def gpu_probe() -> bool:
    """A CUDA or ROCm device, seen without importing torch: driver nodes first, nvidia-smi last
    (WSL2 has no /dev/nvidia*)."""
    if Path("/dev/nvidia0").exists() or any(Path("/proc/driver/nvidia/gpus").glob("*")):
        return True
    if Path("/dev/kfd").exists():
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def available_ram_bytes() -> int | None:
    """RAM this process can still take now (a cgroup's limit counted), None when unknown."""
    if Path("/proc/meminfo").exists():
        info: dict[str, Any] = {}
        _linux_memory(info, [])
        return info.get("ram_available_bytes")
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
