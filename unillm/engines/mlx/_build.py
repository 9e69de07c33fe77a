"""Which MLX is installed and what it runs on (without importing it): ``MLXEngine.probe_build``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from unillm.backend import EngineBuild, builds

if TYPE_CHECKING:
    from unillm import Hardware

__all__ = ["build"]


def build(hardware: Hardware, findings: list[str]) -> EngineBuild | None:
    """MLX: Metal on Apple Silicon, CUDA with an mlx-cuda wheel, else the CPU."""
    if builds.package_dir("mlx") is None:
        return None
    nvidia, _ = builds.gpu_vendors(hardware)
    cuda = builds.dist_version("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda")
    if hardware.os == "Darwin" and hardware.arch == "arm64":
        devices: tuple[str, ...] = ("cpu", "metal")
    elif cuda:
        devices = ("cpu", "cuda")
    else:
        devices = ("cpu",)
    if hardware.os == "Linux" and not cuda:
        hint = ": `pip install mlx[cuda12]` for the NVIDIA GPU" if nvidia else ""
        findings.append(f"mlx on Linux runs on the CPU only here (no Metal){hint}")
    elif hardware.os == "Darwin" and hardware.arch != "arm64":
        findings.append("mlx needs Apple Silicon: on this Mac it cannot use a GPU")
    return EngineBuild("mlx", builds.dist_version("mlx"), devices)
