"""Which llama-cpp-python is installed and what it offloads to, read from the libraries it ships
(without importing it): ``LlamaCppEngine.probe_build`` for ``unillm doctor``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from unillm.backend import EngineBuild, builds

if TYPE_CHECKING:
    from unillm import Hardware

__all__ = ["build", "llama_cpp_devices"]


def llama_cpp_devices(package_dir: Path) -> tuple[tuple[str, ...], bool]:
    """The devices a llama-cpp-python build can use, from the ggml libraries it ships, and whether
    that is certain (older builds link every backend into one library, which says nothing)."""
    names: list[str] = []
    for folder in (package_dir, package_dir / "lib", package_dir / "lib64"):
        try:
            names += [p.name.lower() for p in folder.iterdir()]
        except OSError:
            continue
    devices = ["cpu"]
    for marker, device in (
        ("ggml-cuda", "cuda"),
        ("ggml-metal", "metal"),
        ("ggml-hip", "rocm"),
        ("ggml-vulkan", "vulkan"),
        ("ggml-sycl", "sycl"),
    ):
        if any(marker in n for n in names):
            devices.append(device)
    certain = any("ggml-cpu" in n or "ggml-base" in n for n in names)
    return tuple(devices), certain


def build(hardware: Hardware, findings: list[str]) -> EngineBuild | None:
    """llama-cpp-python: the devices its ggml libraries offload to."""
    where = builds.package_dir("llama_cpp")
    if where is None:
        return None
    nvidia, amd = builds.gpu_vendors(hardware)
    devices, certain = llama_cpp_devices(where)
    gpu_build = len(devices) > 1
    if nvidia and "cuda" not in devices and certain:
        findings.append(
            "llama-cpp-python is built without CUDA: reinstall with CMAKE_ARGS=-DGGML_CUDA=on "
            "(pip install --force-reinstall --no-cache-dir llama-cpp-python)"
            + (" (it has Vulkan, which is slower)" if "vulkan" in devices else "")
        )
    elif amd and not gpu_build and certain:
        findings.append(
            "llama-cpp-python is built without GPU offload: reinstall with CMAKE_ARGS=-DGGML_HIP=on"
        )
    elif hardware.apple_silicon and "metal" not in devices and certain:
        findings.append("llama-cpp-python is built without Metal: reinstall with CMAKE_ARGS=-DGGML_METAL=on")
    elif (nvidia or amd) and not certain:
        findings.append("could not tell whether llama-cpp-python was built with GPU offload")
    return EngineBuild("llama.cpp", builds.dist_version("llama_cpp_python", "llama-cpp-python"), devices)
