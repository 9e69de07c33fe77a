"""Whether ExLlamaV2 is installed and can run here (without importing it):
``ExLlamaV2Engine.probe_build``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from unillm.backend import EngineBuild, builds

if TYPE_CHECKING:
    from unillm import Hardware

__all__ = ["build"]


def build(hardware: Hardware, findings: list[str]) -> EngineBuild | None:
    """ExLlamaV2: CUDA (or ROCm) only."""
    if builds.package_dir("exllamav2") is None:
        return None
    nvidia, amd = builds.gpu_vendors(hardware)
    if not (nvidia or amd):
        findings.append("exllamav2 is installed but there is no CUDA or ROCm GPU: it cannot run here")
    return EngineBuild("exllamav2", builds.dist_version("exllamav2"), ("cuda",))
