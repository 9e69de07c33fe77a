"""The selector: a table of machines x model formats x workloads -> the backend and its reason."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

from unillm import GPU, Capabilities, Hardware, Plan, Registry, Workload, select
from unillm._choose._registry import BackendInfo
from unillm._types import Availability
from unillm.testing import MockEngine

GB = 10**9


def gpus(n: int, name: str, mem_gb: int, bw: float, vendor: str = "nvidia") -> tuple[GPU, ...]:
    return tuple(GPU(i, vendor, name, mem_gb * GB, bandwidth_gbps=bw) for i in range(n))  # type: ignore[arg-type]


def all_pairs(n: int) -> tuple[tuple[int, int], ...]:
    return tuple((i, j) for i in range(n) for j in range(i + 1, n))


MACHINES = {
    "laptop-8gb": Hardware("Linux", "x86_64", "Intel Core i5", 4, ("avx2",), 8 * GB),
    "m3-ultra": Hardware(
        "Darwin",
        "arm64",
        "Apple M3 Ultra",
        24,
        ("neon",),
        192 * GB,
        apple_chip="Apple M3 Ultra",
        gpu_usable_memory_bytes=144 * GB,
    ),
    "1x4090": Hardware(
        "Linux", "x86_64", "AMD Ryzen 9", 16, ("avx2",), 64 * GB, gpus=gpus(1, "RTX 4090", 24, 1008)
    ),
    "4x4090-pcie": Hardware(
        "Linux", "x86_64", "AMD EPYC", 64, ("avx2",), 256 * GB, gpus=gpus(4, "RTX 4090", 24, 1008)
    ),
    "8xH100": Hardware(
        "Linux",
        "x86_64",
        "Intel Xeon",
        112,
        ("avx512f", "amx"),
        2048 * GB,
        gpus=gpus(8, "H100 SXM", 80, 3350),
        nvlink=all_pairs(8),
    ),
    "8xB200": Hardware(
        "Linux",
        "x86_64",
        "Intel Xeon",
        112,
        ("avx512f", "amx"),
        2048 * GB,
        gpus=gpus(8, "B200", 192, 8000),
        nvlink=all_pairs(8),
    ),
    "mi300x": Hardware(
        "Linux", "x86_64", "AMD EPYC", 96, ("avx512f",), 1536 * GB, gpus=gpus(8, "MI300X", 192, 5300, "amd")
    ),
}

SINGLE = Workload(context_length=8192, concurrency=1)
MANY = Workload(context_length=8192, concurrency=64, goal="throughput")
LONG = Workload(context_length=131072, concurrency=1)


@dataclass(frozen=True)
class Model:
    format: str
    path: str = "model"
    quantization: str | None = None


class ExLlamaV3Double(MockEngine):
    """Stands in for an ExLlamaV3 plugin."""

    name: ClassVar[str] = "exllamav3"
    formats: ClassVar[frozenset[str]] = frozenset({"exl3"})
    capabilities: ClassVar[Capabilities] = Capabilities()


def backends(*extra: type) -> dict[str, BackendInfo]:
    reg = Registry(entry_points=False)
    for cls in extra:
        reg.register_backend(cls, source="test")
    return reg.backends()


def installed(b: dict[str, BackendInfo]) -> dict[str, Availability]:
    return {name: Availability(True) for name in b}


# machine, format, workload -> expected backend and a phrase of its first reason
TABLE = [
    ("laptop-8gb", "gguf", SINGLE, "llama.cpp", "GGUF is llama.cpp's own format"),
    ("m3-ultra", "gguf", SINGLE, "llama.cpp", "GGUF"),
    ("1x4090", "gguf", SINGLE, "llama.cpp", "GGUF"),
    ("8xH100", "gguf", SINGLE, "llama.cpp", "GGUF"),
    ("m3-ultra", "mlx", SINGLE, "mlx", "MLX-quantized"),
    ("laptop-8gb", "mlx", SINGLE, "mlx", "MLX-quantized"),
    ("1x4090", "exl2", SINGLE, "exllamav2", "EXL2 is ExLlamaV2's format"),
    ("4x4090-pcie", "exl2", SINGLE, "exllamav2", "EXL2"),
    ("4x4090-pcie", "exl3", SINGLE, "exllamav3", "EXL3 is ExLlamaV3's format"),
    ("1x4090", "awq", SINGLE, "vllm", "optimized kernels for awq"),
    ("8xH100", "fp8", MANY, "vllm", "optimized kernels for fp8"),
    ("8xB200", "fp8", MANY, "vllm", "fp8"),
    ("mi300x", "gptq", MANY, "vllm", "gptq"),
    ("1x4090", "gptq", SINGLE, "vllm", "gptq"),
    ("m3-ultra", "safetensors", SINGLE, "mlx", "Apple Silicon"),
    ("1x4090", "safetensors", SINGLE, "exllamav2", "one NVIDIA GPU, local use"),
    ("1x4090", "safetensors", MANY, "vllm", "several users"),
    ("8xH100", "safetensors", SINGLE, "vllm", "several users or GPUs"),
    ("mi300x", "safetensors", SINGLE, "vllm", "ROCm"),
    ("laptop-8gb", "safetensors", SINGLE, "mlx", "CPU only"),
    ("laptop-8gb", "safetensors", MANY, "vllm", "CPU, several users"),
    ("8xB200", "safetensors", LONG, "vllm", "several users or GPUs"),
]


@pytest.mark.parametrize(("machine", "fmt", "workload", "backend", "reason"), TABLE)
def test_the_decision_guide(machine: str, fmt: str, workload: Workload, backend: str, reason: str) -> None:
    b = backends(ExLlamaV3Double)
    s = select(MACHINES[machine], Model(fmt), workload, b, available=installed(b))
    assert s.backend == backend, s.explain()
    chosen = next(c for c in s.candidates if c.name == backend)
    assert reason in chosen.reasons[0], chosen.reasons
    assert s.recommendation is None
    assert len(s.answers) == 10


def test_candidates_reading_another_format_are_blocked() -> None:
    b = backends()
    s = select(MACHINES["1x4090"], Model("gguf"), SINGLE, b, available=installed(b))
    blocked = {c.name: c.blockers for c in s.candidates if not c.eligible}
    assert set(blocked) == {"mlx", "exllamav2", "vllm"}
    assert all("does not read gguf" in " ".join(v) for v in blocked.values())


def test_the_first_choice_missing_is_recommended_with_its_install_command() -> None:
    b = backends()  # the built-ins only: no ExLlamaV3
    missing = Availability(False, "vllm is not installed", "pip install 'unillm[vllm]'")
    avail = installed(b) | {"vllm": missing}
    s = select(MACHINES["8xH100"], Model("awq"), MANY, b, available=avail)
    assert s.backend == ""  # nothing installed reads AWQ
    assert s.recommendation is not None and "vllm" in s.recommendation and "pip install" in s.recommendation
    s3 = select(MACHINES["4x4090-pcie"], Model("exl3"), SINGLE, b, available=avail)
    assert s3.recommendation is not None and "ExLlamaV3" in s3.recommendation


def test_unavailable_backends_lose_with_the_reason() -> None:
    b = backends()
    avail = installed(b) | {"exllamav2": Availability(False, "no GPU", "pip install x")}
    s = select(MACHINES["1x4090"], Model("safetensors"), SINGLE, b, available=avail)
    assert s.backend == "vllm"  # the guide's second choice, since the first cannot run
    ex = next(c for c in s.candidates if c.name == "exllamav2")
    assert not ex.eligible and "unavailable: no GPU; install: pip install x" in ex.blockers


def test_never_llama_cpp_across_several_gpus() -> None:
    b = backends()
    big = Plan(140 * GB, 327680, 2 * GB, GB, 143 * GB, True, 10 * GB)
    s = select(MACHINES["4x4090-pcie"], Model("gguf"), SINGLE, b, available=installed(b), plan=big)
    llama = next(c for c in s.candidates if c.name == "llama.cpp")
    assert not llama.eligible
    assert "never splits a model across GPUs" in " ".join(llama.blockers)
    small = Plan(5 * GB, 131072, GB, GB, 7 * GB, True, 17 * GB)
    ok = select(MACHINES["4x4090-pcie"], Model("gguf"), SINGLE, b, available=installed(b), plan=small)
    assert ok.backend == "llama.cpp"


def test_pipeline_over_tensor_parallelism_without_nvlink() -> None:
    b = backends()
    pcie = select(MACHINES["4x4090-pcie"], Model("awq"), MANY, b, available=installed(b))
    vllm = next(c for c in pcie.candidates if c.name == "vllm")
    assert any("pipeline_parallel_size=4" in r for r in vllm.reasons)
    nv = select(MACHINES["8xH100"], Model("awq"), MANY, b, available=installed(b))
    assert not any("pipeline" in r for r in next(c for c in nv.candidates if c.name == "vllm").reasons)


def test_the_users_choice_wins_and_explains() -> None:
    b = backends()
    s = select(
        MACHINES["m3-ultra"], Model("safetensors"), SINGLE, b, available=installed(b), requested="vllm"
    )
    assert s.backend == "vllm" and s.chosen_by == "config"
    text = s.explain()
    assert "the ten questions:" in text and "interconnect: unified memory" in text


def test_a_broken_plugin_suitability_does_not_break_selection() -> None:
    class Broken(MockEngine):
        name: ClassVar[str] = "broken"

        @classmethod
        def suitability(cls, hardware: object, model: object, workload: object):  # type: ignore[no-untyped-def]
            raise RuntimeError("plugin bug")

    b = backends(Broken)
    s = select(MACHINES["laptop-8gb"], Model("gguf"), SINGLE, b, available=installed(b))
    assert s.backend == "llama.cpp"
    broken = next(c for c in s.candidates if c.name == "broken")
    assert "plugin bug" in broken.blockers[0]
