"""What an engine's ``probe_build`` needs to find its installed build without importing it: where
a package is installed, a distribution's version, which GPU vendors the machine has. Only the
standard library is imported here; each built-in engine's own rules live in its ``_build.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from unillm._hardware import Hardware

__all__ = ["dist_version", "gpu_vendors", "package_dir"]


def package_dir(module: str) -> Path | None:
    """Where the top-level package ``module`` is installed (found without running it), or None."""
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


def gpu_vendors(hardware: Hardware) -> tuple[bool, bool]:
    """Whether ``hardware`` has an NVIDIA GPU, and whether it has an AMD one."""
    vendors = {g.vendor for g in hardware.gpus}
    return "nvidia" in vendors, "amd" in vendors


def dist_version(*dists: str) -> str | None:
    """The version of the first of ``dists`` that is installed, or None."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in dists:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None
