"""Small pieces every backend needs the same way: availability checks that import nothing (the
package, a GPU), prompt validation, and the shared-prefix count for KV-cache reuse."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from unillm._errors import ConfigError, ContextLengthExceeded
from unillm._types import Availability

__all__ = [
    "available_ram_bytes",
    "check_prompt",
    "gpu_present",
    "gpu_probe",
    "installed",
    "shared_prefix",
]


class _Tokens(Protocol):
    """A list of token ids, or the numpy array an engine keeps them in."""

    def __len__(self) -> int: ...
    def __getitem__(self, i: int, /) -> Any: ...


def installed(*packages: tuple[str, str], hint: str) -> Availability:
    """Available when every ``(module, distribution)`` is importable, without importing it; the
    version is the distribution's, or each one named when there are several."""
    versions = []
    for module, dist in packages:
        if importlib.util.find_spec(module) is None:
            return Availability(False, f"{dist} is not installed", hint)
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions.append((dist, importlib.metadata.version(dist)))
    if not versions:
        return Availability(True)
    if len(packages) == 1:
        return Availability(True, version=versions[0][1])
    # several packages (mlx and mlx-lm): name each, or "0.32.2" reads as the wrong one's
    return Availability(True, version=", ".join(f"{d} {v}" for d, v in versions))


def check_prompt(ids: Sequence[int], context: int | None, max_tokens: int) -> None:
    """Refuse an empty prompt, and one that fills ``context`` (None: the cache rotates)."""
    if not ids:
        raise ConfigError("the prompt is empty: give at least one token")
    if context is not None and len(ids) >= context:
        raise ContextLengthExceeded(len(ids), context, max_tokens)


def shared_prefix(held: _Tokens, ids: Sequence[int]) -> int:
    """How many leading tokens ``ids`` shares with what a cache holds, leaving at least one token
    of ``ids`` to evaluate (so the next token's logits are fresh)."""
    limit = min(len(held), len(ids) - 1)
    n = 0
    while n < limit and held[n] == ids[n]:
        n += 1
    return n


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
        from unillm._hardware import _linux_memory

        info: dict[str, Any] = {}
        _linux_memory(info, [])
        return info.get("ram_available_bytes")
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
