"""Hardware detection on this machine (and with lying or hanging tools), the parsers on captured
outputs, the bandwidth tables, and the hardware profiles the selector tests plan against."""

from __future__ import annotations

import errno
import json
import os
import platform
import shutil
import stat
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest

from unillm import _hardware
from unillm._choose._doctor import with_engine_builds
from unillm._choose._registry import Registry
from unillm._errors import ConfigError
from unillm._hardware import (
    GPU,
    EngineBuild,
    Hardware,
    apple_bandwidth,
    bandwidth_from_table,
    cpu_features_from_flags,
    detect_hardware,
    load_hardware,
    nvml_bandwidth,
    parse_amd_smi_static,
    parse_nvidia_smi_csv,
    parse_nvidia_smi_topo,
    parse_rocm_smi,
    parse_rocm_smi_topotype,
)
from unillm.backend import builds
from unillm.engines.exllamav2 import _build as exllamav2_build
from unillm.engines.llamacpp import _build as llamacpp_build
from unillm.engines.llamacpp._build import llama_cpp_devices
from unillm.engines.mlx import _build as mlx_build
from unillm.engines.vllm import _build as vllm_build
from unillm.testing import MockEngine

PROFILES = Path(__file__).parent / "profiles"
PROFILE_NAMES = sorted(p.stem for p in PROFILES.glob("*.json"))
GIB = 2**30
MIB = 2**20
CAT = shutil.which("cat") or "/bin/cat"
posix_only = pytest.mark.skipif(os.name != "posix", reason="fake tools are shell scripts")


def profile(name: str) -> Hardware:
    return load_hardware(PROFILES / f"{name}.json")


# -- this machine -------------------------------------------------------------------------------


def test_detect_hardware_on_this_machine_is_sane() -> None:
    hw = detect_hardware()
    assert hw.os == platform.system()
    assert hw.arch == platform.machine()
    assert hw.cpu_cores >= 1
    assert hw.ram_total_bytes > 0
    if hw.ram_available_bytes is not None:
        assert 0 <= hw.ram_available_bytes <= hw.ram_total_bytes
    if not shutil.which("nvidia-smi") and not shutil.which("rocm-smi") and not shutil.which("amd-smi"):
        assert hw.gpus == ()
        assert hw.nvlink == ()
    assert Hardware.from_dict(json.loads(hw.to_json())) == hw
    assert all(isinstance(line, str) and line for line in hw.summary_lines())


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="Linux only")
def test_cpu_features_are_what_proc_cpuinfo_says() -> None:
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[1].split())
            break
    expected = {
        "avx2": "avx2",
        "avx512f": "avx512f",
        "avx512_bf16": "avx512_bf16",
        "asimd": "neon",
        "sve": "sve",
    }
    expected |= {f: "amx" for f in ("amx_tile", "amx_bf16", "amx_int8")}
    hw = detect_hardware()
    for flag, name in expected.items():
        assert (name in hw.cpu_features) == (
            flag in flags or (name == "amx" and bool(flags & {"amx_tile", "amx_bf16", "amx_int8"}))
        ), name


def test_cpu_feature_names() -> None:
    assert cpu_features_from_flags(
        ["fpu", "avx", "avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_int8"]
    ) == (
        "avx",
        "avx2",
        "avx512f",
        "avx512_bf16",
        "amx",
    )
    assert cpu_features_from_flags(["fp", "asimd", "asimddp", "sve", "sve2", "i8mm"]) == (
        "neon",
        "dotprod",
        "i8mm",
        "sve",
        "sve2",
    )


def test_detect_hardware_imports_nothing_heavy() -> None:
    code = (
        "import sys, json\nfrom unillm import detect_hardware\ndetect_hardware()\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('pynvml', 'torch', 'mlx', 'llama_cpp', 'exllamav2', 'vllm', 'numpy'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


# -- probes that hang, lie or are missing -------------------------------------------------------


@pytest.fixture
def no_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError


def fake_tool(folder: Path, name: str, script: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def fake_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH holding only the fake tools a test writes (so no real GPU tool answers)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", str(folder))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return folder


HANG_S = 60  # how long a test waits for a detection whose probe hangs: only a broken bound gets there


def _detect_while_hung(timeout: float) -> Hardware:
    """``detect_hardware(timeout=timeout)`` while a fake probe hangs until the test releases it,
    which it does only after this returns: detection must come back on its own. It runs in a thread
    so that one that waits for the probe fails here (after HANG_S) instead of hanging the test."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["hw"] = detect_hardware(timeout=timeout)
        except BaseException as exc:
            box["error"] = exc

    worker = threading.Thread(target=run, name="detect-hardware", daemon=True)
    worker.start()
    worker.join(HANG_S)
    assert not worker.is_alive(), f"detect_hardware(timeout={timeout}) waited for the hung probe"
    if "error" in box:
        raise box["error"]
    hw: Hardware = box["hw"]
    return hw


def _release(fifo: Path) -> bool:
    """Open ``fifo`` for writing and close it: a process blocked reading it reads its end and goes
    on. Whether one was (a reader waiting to open it counts)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # no reader
            return False
        raise
    os.close(fd)
    return True


@posix_only
@pytest.mark.usefixtures("no_pynvml")
def test_a_hanging_nvidia_smi_costs_one_timeout(fake_path: Path, tmp_path: Path) -> None:
    # The fake's child (`cat` of a FIFO no one writes to until the end) hangs, and keeps the pipe
    # open after the shell is killed: the whole group must go. (`echo late` keeps `sh` from
    # exec'ing `cat` in its place.)
    fifo, runs = tmp_path / "hang", tmp_path / "runs"
    os.mkfifo(fifo)
    fake_tool(fake_path, "nvidia-smi", f'echo run >> "{runs}"\n{CAT} "{fifo}"\necho late')
    try:
        hw = _detect_while_hung(timeout=0.5)  # back while the fake still hangs
    finally:
        survivor = _release(fifo)  # wakes the fake's child, if it outlived the kill
    assert not survivor, "nvidia-smi's child outlived the timeout: its process group was not killed"
    assert runs.read_text().splitlines() == ["run"]  # one timeout: not asked again without compute_cap
    assert hw.gpus == ()
    assert any("did not answer within 0.5 s" in f for f in hw.findings)


@posix_only
@pytest.mark.usefixtures("no_pynvml")
def test_garbage_from_nvidia_smi_is_a_finding(fake_path: Path) -> None:
    fake_tool(fake_path, "nvidia-smi", "echo 'NVIDIA-SMI has failed because it could not communicate'")
    hw = detect_hardware(timeout=2)
    assert hw.gpus == ()
    assert any("nothing unillm could read" in f for f in hw.findings)


@posix_only
@pytest.mark.usefixtures("no_pynvml")
def test_failing_nvidia_smi_is_a_finding(fake_path: Path) -> None:
    fake_tool(
        fake_path, "nvidia-smi", "echo 'Failed to initialize NVML: Driver/library mismatch' >&2; exit 18"
    )
    hw = detect_hardware(timeout=2)
    assert hw.gpus == ()
    assert any("exited with 18" in f and "mismatch" in f for f in hw.findings)


@posix_only
@pytest.mark.usefixtures("no_pynvml")
def test_nvidia_smi_fallback_reads_gpus_and_links(fake_path: Path) -> None:
    fake_tool(
        fake_path,
        "nvidia-smi",
        f"""if [ "$1" = topo ]; then {CAT} <<'EOF'
{TOPO_H100_4}
EOF
else {CAT} <<'EOF'
{CSV_H100_4}
EOF
fi""",
    )
    hw = detect_hardware(timeout=2)
    assert [g.name for g in hw.gpus] == ["NVIDIA H100 80GB HBM3"] * 4
    assert hw.gpus[0].bandwidth_source == "table" and hw.gpus[0].bandwidth_gbps == 3350
    assert hw.all_nvlinked()
    assert any("nvidia-ml-py is not installed" in f for f in hw.findings)


@pytest.mark.usefixtures("no_pynvml")
def test_no_nvidia_anything_is_no_gpu_and_no_noise(fake_path: Path) -> None:
    hw = detect_hardware(timeout=1)
    assert hw.gpus == ()
    assert not any("NVML" in f or "nvidia" in f.lower() for f in hw.findings)


def test_a_probe_that_blows_up_is_a_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object) -> None:
        raise RuntimeError("kaboom")

    monkeypatch.setattr(_hardware, "_probe_host", boom)
    hw = with_engine_builds(detect_hardware(timeout=1), registry(("boom", boom)))
    assert hw.cpu_cores >= 1
    assert sum("kaboom" in f for f in hw.findings) == 2


class FakeNVML(types.ModuleType):
    """Just enough of pynvml: ``n`` GPUs of one model, NVLink as the test says."""

    NVML_CLOCK_MEM = 2
    NVML_P2P_CAPS_INDEX_NVLINK = 3
    NVML_P2P_STATUS_OK = 0
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 4

    def __init__(
        self,
        n: int,
        *,
        name: bytes = b"NVIDIA H100 80GB HBM3",
        clock: int | None = 2619,
        bus: int = 5120,
        p2p: set[tuple[int, int]] | None = None,
        links: dict[int, list[str]] | None = None,
        init: Any = None,
    ) -> None:
        super().__init__("pynvml")
        self.n, self.name, self.clock, self.bus = n, name, clock, bus
        self.p2p, self.links = p2p, links or {}
        self._init = init

    def nvmlInit(self) -> None:
        if self._init:
            self._init()

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return self.n

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return self.name

    def nvmlDeviceGetMemoryInfo(self, h: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(total=81559 * MIB, free=81000 * MIB, used=559 * MIB)

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        return (9, 0)

    def nvmlDeviceGetMaxClockInfo(self, h: int, kind: int) -> int:
        if self.clock is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return self.clock

    def nvmlDeviceGetMemoryBusWidth(self, h: int) -> int:
        return self.bus

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:
        return 5

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, cap: int) -> int:
        if self.p2p is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 0 if (min(a, b), max(a, b)) in self.p2p else 4

    def nvmlDeviceGetPciInfo(self, h: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(busId=f"00000000:{0x18 + h:02X}:00.0".encode())

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        if link >= len(self.links.get(h, [])):
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(busId=self.links[h][link])


def test_nvml_probe_reads_gpus_bandwidth_and_nvlink(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML(4, p2p={(0, 1), (2, 3)}))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    hw = detect_hardware(timeout=2)
    assert len(hw.gpus) == 4
    gpu = hw.gpus[0]
    assert (gpu.vendor, gpu.name, gpu.compute_capability, gpu.pcie_gen) == (
        "nvidia",
        "NVIDIA H100 80GB HBM3",
        "9.0",
        5,
    )
    assert gpu.memory_total_bytes == 81559 * MIB and gpu.memory_free_bytes == 81000 * MIB
    assert (gpu.bandwidth_gbps, gpu.bandwidth_source) == (3352.3, "nvml")
    assert hw.nvlink == ((0, 1), (2, 3))
    assert not hw.all_nvlinked()


def test_nvml_without_clocks_falls_back_to_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML(1, name=b"NVIDIA GeForce RTX 4090", clock=None))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpu = detect_hardware(timeout=2).gpus[0]
    assert (gpu.bandwidth_gbps, gpu.bandwidth_source) == (1008, "table")


def test_nvlink_from_link_remote_ends_and_nvswitch(monkeypatch: pytest.MonkeyPatch) -> None:
    # P2P status unsupported: GPU 0 and 1 link to each other directly, 2 and 3 to an NVSwitch.
    links = {
        0: ["0000:19:00.0"],
        1: ["00000000:18:00.0"],
        2: ["00000000:c0:00.0", "00000000:c1:00.0"],
        3: ["00000000:c0:00.0"],
    }
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML(4, links=links))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert detect_hardware(timeout=2).nvlink == ((0, 1), (2, 3))


@pytest.mark.usefixtures("fake_path")
def test_a_hanging_nvml_costs_one_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    release, inits = threading.Event(), []

    def hang() -> None:  # nvmlInit on a stuck driver: returns only once the test is done
        inits.append(1)
        release.wait()

    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML(1, init=hang))
    try:
        hw = _detect_while_hung(timeout=0.3)  # back while nvmlInit still hangs
    finally:
        release.set()
    assert inits == [1]  # one timeout: NVML is not tried again
    assert hw.gpus == ()
    assert [f for f in hw.findings if "NVML did not answer" in f] == [
        "NVML did not answer within 0.3 s (a stuck driver?)"
    ]


@pytest.mark.usefixtures("fake_path")
def test_a_failing_nvml_is_a_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> None:
        raise RuntimeError("NVML_ERROR_UNKNOWN")

    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML(1, init=fail))
    hw = detect_hardware(timeout=1)
    assert hw.gpus == ()
    assert any("NVML failed" in f for f in hw.findings)


def test_cuda_visible_devices_renumbers_gpus_and_links(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML(4, p2p={(0, 1), (2, 3)}))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,2")
    hw = detect_hardware(timeout=2)
    assert [g.index for g in hw.gpus] == [0, 1]
    assert hw.nvlink == ((0, 1),)
    assert any("2 of 4 GPUs" in f for f in hw.findings)


SYSCTL_M3_ULTRA = """\
machdep.cpu.brand_string: Apple M3 Ultra
hw.memsize: 206158430208
hw.physicalcpu: 28
sysctl.proc_translated: 0
hw.optional.arm.FEAT_BF16: 1
hw.optional.arm.FEAT_I8MM: 1
hw.optional.arm.FEAT_DotProd: 1
hw.optional.arm.FEAT_SME: 0
hw.optional.neon: 1
hw.optional.AdvSIMD: 1
"""
VM_STAT = """\
Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                               1000000.
Pages active:                             4000000.
Pages inactive:                           2000000.
Pages speculative:                          50000.
Pages throttled:                                0.
Pages wired down:                          700000.
Pages purgeable:                            10000.
"""


@pytest.fixture
def fake_mac(fake_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An M3 Ultra as sysctl and vm_stat describe it, and no mlx to ask."""
    fake_tool(fake_path, "sysctl", f"{CAT} <<'EOF'\n{SYSCTL_M3_ULTRA}EOF\necho 'unknown oid' >&2; exit 1")
    fake_tool(fake_path, "vm_stat", f"{CAT} <<'EOF'\n{VM_STAT}EOF")
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    monkeypatch.setitem(sys.modules, "mlx", None)  # find_spec("mlx") is None


@posix_only
@pytest.mark.usefixtures("fake_mac")
def test_apple_silicon_from_sysctl_and_vm_stat() -> None:
    hw = detect_hardware(timeout=2)
    assert (hw.os, hw.arch, hw.apple_chip, hw.cpu_model) == (
        "Darwin",
        "arm64",
        "Apple M3 Ultra",
        "Apple M3 Ultra",
    )
    assert hw.apple_silicon and hw.gpus == ()
    assert hw.cpu_physical_cores == 28
    assert hw.cpu_features == ("neon", "dotprod", "i8mm", "bf16")
    assert hw.ram_total_bytes == 192 * GIB
    assert hw.ram_available_bytes == (1000000 + 2000000 + 50000 + 10000) * 16384
    assert hw.ram_bandwidth_gbps == 819
    assert hw.gpu_usable_memory_bytes == int(192 * GIB * 0.75)
    assert any("GPU-usable memory is an estimate: 75% of RAM" in f for f in hw.findings)


@posix_only
@pytest.mark.usefixtures("fake_mac")
def test_apple_working_set_from_an_imported_mlx(monkeypatch: pytest.MonkeyPatch) -> None:
    core = types.ModuleType("mlx.core")
    core.device_info = lambda: {"max_recommended_working_set_size": 150 * GIB}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mlx.core", core)
    hw = detect_hardware(timeout=2)
    assert hw.gpu_usable_memory_bytes == 150 * GIB
    assert any("Metal's recommended working set (read through mlx)" in f for f in hw.findings)


# -- nvidia-smi outputs -------------------------------------------------------------------------

CSV_4090_2 = """\
0, NVIDIA GeForce RTX 4090, 24564, 23975, 8.9
1, NVIDIA GeForce RTX 4090, 24564, 24209, 8.9
"""
CSV_H100_4 = "\n".join(f"{i}, NVIDIA H100 80GB HBM3, 81559, 81008, 9.0" for i in range(4))
CSV_OLD_DRIVER = "0, Tesla T4, 15360, [N/A]\n"

TOPO_H100_4 = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tNV18\tNV18\tPXB\tSYS\t0-55,112-167\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tSYS\tPXB\t0-55,112-167\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tSYS\tSYS\t56-111,168-223\t1\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tSYS\tSYS\t56-111,168-223\t1\t\tN/A
NIC0\tPXB\tSYS\tSYS\tSYS\t X \tSYS
NIC1\tSYS\tPXB\tSYS\tSYS\tSYS\t X

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
  NIC1: mlx5_1
"""

TOPO_4090_4 = """\
        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity   GPU NUMA ID
GPU0     X      PHB     PHB     PHB     0-63    0               N/A
GPU1    PHB      X      PHB     PHB     0-63    0               N/A
GPU2    PHB     PHB      X      PHB     0-63    0               N/A
GPU3    PHB     PHB     PHB      X      0-63    0               N/A

Legend:

  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""

TOPO_3090_BRIDGED = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV4\tSYS\tSYS\t0-31\tN/A
GPU1\tNV4\t X \tSYS\tSYS\t0-31\tN/A
GPU2\tSYS\tSYS\t X \tNV4\t0-31\tN/A
GPU3\tSYS\tSYS\tNV4\t X \t0-31\tN/A
"""


def test_parse_nvidia_smi_csv() -> None:
    gpus = parse_nvidia_smi_csv(CSV_4090_2)
    assert [g.index for g in gpus] == [0, 1]
    assert gpus[0] == GPU(
        index=0,
        vendor="nvidia",
        name="NVIDIA GeForce RTX 4090",
        memory_total_bytes=24564 * MIB,
        memory_free_bytes=23975 * MIB,
        compute_capability="8.9",
        bandwidth_gbps=1008,
        bandwidth_source="table",
    )


def test_parse_nvidia_smi_csv_tolerates_old_drivers_and_noise() -> None:
    (t4,) = parse_nvidia_smi_csv("No devices were found\n" + CSV_OLD_DRIVER + "\n")
    assert (t4.name, t4.memory_free_bytes, t4.compute_capability, t4.bandwidth_gbps) == (
        "Tesla T4",
        None,
        None,
        320,
    )
    assert parse_nvidia_smi_csv("garbage, more garbage\n\x00\x01") == []


@pytest.mark.parametrize(
    ("text", "pairs"),
    [
        (TOPO_H100_4, [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]),
        (TOPO_4090_4, []),
        (TOPO_3090_BRIDGED, [(0, 1), (2, 3)]),
        ("", []),
        ("GPU0\tNV12\n", []),
    ],
    ids=["h100-nvswitch", "4090-pcie", "3090-bridges", "empty", "garbage"],
)
def test_parse_nvidia_smi_topo(text: str, pairs: list[tuple[int, int]]) -> None:
    assert parse_nvidia_smi_topo(text) == pairs


# -- AMD tool outputs ---------------------------------------------------------------------------

AMD_SMI_STATIC = json.dumps(
    [
        {
            "gpu": i,
            "asic": {"market_name": "AMD Instinct MI300X", "target_graphics_version": "gfx942"},
            "bus": {"bdf": f"0000:{0x11 + i:02x}:00.0", "pcie_interface_version": "Gen 5"},
            "vram": {"type": "HBM", "size": {"value": 196592, "unit": "MB"}, "bit_width": 8192},
        }
        for i in range(2)
    ]
)
AMD_SMI_METRIC = json.dumps(
    {
        "gpu_data": [
            {"gpu": i, "mem_usage": {"free_vram": {"value": 195000, "unit": "MB"}, "total_vram": "196592 MB"}}
            for i in range(2)
        ]
    }
)
ROCM_SMI = json.dumps(
    {
        "card0": {
            "Card Series": "AMD Instinct MI300X OAM",
            "Card Model": "0x74a1",
            "GFX Version": "gfx942",
            "VRAM Total Memory (B)": str(192 * GIB),
            "VRAM Total Used Memory (B)": str(GIB),
        },
        "card1": {
            "Card Series": "AMD Radeon RX 7900 XTX",
            "GFX Version": "gfx1100",
            "VRAM Total Memory (B)": str(24 * GIB),
        },
    }
)
ROCM_TOPO = json.dumps(
    {
        "system": {
            "(Topology) Link type between DRM devices 0 and 1": "XGMI",
            "(Topology) Link type between DRM devices 0 and 2": "PCIE",
            "(Topology) Link type between DRM devices 1 and 0": "XGMI",
        }
    }
)


def test_parse_amd_smi() -> None:
    gpus = parse_amd_smi_static(AMD_SMI_STATIC, AMD_SMI_METRIC)
    assert len(gpus) == 2
    assert gpus[1] == GPU(
        index=1,
        vendor="amd",
        name="AMD Instinct MI300X",
        memory_total_bytes=196592 * MIB,
        memory_free_bytes=195000 * MIB,
        compute_capability="gfx942",
        bandwidth_gbps=5300,
        bandwidth_source="table",
        pcie_gen=5,
    )


def test_parse_rocm_smi() -> None:
    mi300x, navi = parse_rocm_smi(ROCM_SMI)
    assert (mi300x.name, mi300x.memory_total_bytes, mi300x.memory_free_bytes) == (
        "AMD Instinct MI300X OAM",
        192 * GIB,
        191 * GIB,
    )
    assert (mi300x.bandwidth_gbps, mi300x.compute_capability) == (5300, "gfx942")
    assert (navi.index, navi.bandwidth_gbps, navi.memory_free_bytes) == (1, 960, None)
    assert parse_rocm_smi_topotype(ROCM_TOPO) == [(0, 1)]


@posix_only
@pytest.mark.usefixtures("no_pynvml")
def test_amd_probe_through_amd_smi(fake_path: Path) -> None:
    fake_tool(
        fake_path,
        "amd-smi",
        f"""if [ "$1" = static ]; then {CAT} <<'EOF'
{AMD_SMI_STATIC}
EOF
else {CAT} <<'EOF'
{AMD_SMI_METRIC}
EOF
fi""",
    )
    hw = detect_hardware(timeout=2)
    if platform.system() != "Linux":
        pytest.skip("AMD GPUs are probed on Linux")
    assert [g.vendor for g in hw.gpus] == ["amd", "amd"]
    assert hw.gpus[0].memory_free_bytes == 195000 * MIB


# -- bandwidth ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "gbps"),
    [
        ("NVIDIA H100 80GB HBM3", 3350),
        ("NVIDIA H100 PCIe", 2000),
        ("NVIDIA H100 NVL", 3900),
        ("NVIDIA H200", 4800),
        ("NVIDIA B200", 8000),
        ("NVIDIA A100-SXM4-80GB", 2039),
        ("NVIDIA A100 80GB PCIe", 1935),
        ("NVIDIA A100-SXM4-40GB", 1555),
        ("NVIDIA A100-PCIE-40GB", 1555),
        ("NVIDIA L40S", 864),
        ("NVIDIA L4", 300),
        ("Tesla T4", 320),
        ("NVIDIA RTX A6000", 768),
        ("NVIDIA GeForce RTX 5090", 1792),
        ("NVIDIA GeForce RTX 4090", 1008),
        ("NVIDIA GeForce RTX 4080", 717),
        ("NVIDIA GeForce RTX 3090 Ti", 1008),
        ("NVIDIA GeForce RTX 3090", 936),
        ("AMD Instinct MI300X", 5300),
        ("AMD Instinct MI250X", 3277),
        ("Some GPU from the future", None),
    ],
)
def test_bandwidth_table(name: str, gbps: float | None) -> None:
    assert bandwidth_from_table(name) == gbps


def test_bandwidth_table_tells_a100s_apart_by_memory() -> None:
    assert bandwidth_from_table("NVIDIA A100-SXM4", 80 * GIB) == 2039
    assert bandwidth_from_table("NVIDIA A100-SXM4", 40 * GIB) == 1555


def test_nvml_bandwidth_formula() -> None:
    assert nvml_bandwidth(10501, 384) == 1008.1  # RTX 4090
    assert nvml_bandwidth(2619, 5120) == 3352.3  # H100 SXM
    assert nvml_bandwidth(1593, 5120) == 2039.0  # A100 80GB
    assert nvml_bandwidth(None, 384) is None
    assert nvml_bandwidth(1, 8) is None  # implausible: the table is used instead


def test_apple_bandwidth() -> None:
    assert apple_bandwidth("Apple M3 Ultra") == 819
    assert apple_bandwidth("Apple M2 Max") == 400
    assert apple_bandwidth("Apple M3 Max", 14) == 300
    assert apple_bandwidth("Apple M3 Max", 16) == 400
    assert apple_bandwidth("Apple M3 Max") is None  # binned: unknown without the core count
    assert apple_bandwidth("Apple M1") == 68.25
    assert apple_bandwidth("Apple M42 Hyper") is None


def test_docs_bandwidth_table_matches_the_code() -> None:
    text = (Path(__file__).parent.parent / "docs" / "hardware.md").read_text(encoding="utf-8")
    rows = text.split("\n## Bandwidth table\n", 1)[1].split("\n\n", 2)[1].splitlines()[2:]
    assert len(rows) > 20
    for row in rows:
        name, gbps = (c.strip() for c in row.strip("|").split("|")[:2])
        assert bandwidth_from_table(name) == float(gbps), name


# -- engines ------------------------------------------------------------------------------------

Probe = Any  # (hardware, findings) -> EngineBuild | None


def registry(*probes: tuple[str, Probe]) -> Registry:
    """A registry of test backends, each ``probe_build`` the probe the test names."""
    reg = Registry(builtins=False, entry_points=False)
    for name, probe in probes:
        cls = type(
            name,
            (MockEngine,),
            {"name": name, "probe_build": classmethod(lambda cls, hw, f, p=probe: p(hw, f))},
        )
        reg.register_backend(cls)
    return reg


def built_in_probes() -> Registry:
    """Test backends probing as the built-ins do (each engine's ``_build.build``), whether or not
    the built-in classes delegate to it yet."""
    return registry(
        ("llama.cpp", llamacpp_build.build),
        ("mlx", mlx_build.build),
        ("exllamav2", exllamav2_build.build),
        ("vllm", vllm_build.build),
    )


def test_detect_hardware_probes_no_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(builds, "package_dir", lambda module: tmp_path)  # every engine "installed"
    hw = detect_hardware(timeout=1)
    assert hw.engines == ()
    assert not any(
        name in f for f in hw.findings for name in ("llama-cpp-python", "mlx", "vLLM", "exllamav2")
    )


def test_engine_builds_come_from_the_backends_each_finding_once() -> None:
    def one(hw: Hardware, findings: list[str]) -> EngineBuild:
        findings += ["shared", "one needs a GPU"]
        return EngineBuild("one", "1.0", ("cpu",))

    def two(hw: Hardware, findings: list[str]) -> EngineBuild:
        findings.append("shared")
        return EngineBuild("two", None, ("cuda",))

    def absent(hw: Hardware, findings: list[str]) -> None:
        return None

    def odd(hw: Hardware, findings: list[str]) -> str:
        return "a string"

    base = Hardware(os="Linux", arch="x86_64", findings=("shared", "from the probes"))
    reg = registry(("one", one), ("absent", absent), ("odd", odd), ("two", two))
    hw = with_engine_builds(base, reg)
    assert [e.name for e in hw.engines] == ["one", "two"]
    assert hw.findings[:3] == ("shared", "from the probes", "one needs a GPU")
    assert len(hw.findings) == 4 and "odd backend's probe_build returned 'a string'" in hw.findings[3]
    assert with_engine_builds(hw, reg) == hw  # asking again changes nothing
    assert (hw.os, hw.arch) == (base.os, base.arch)


def test_the_built_ins_that_probe_their_build_report_what_the_builds_module_says() -> None:
    from unillm._choose._registry import default_registry
    from unillm._contract._engine import Engine

    probes = {
        "llama.cpp": llamacpp_build.build,
        "mlx": mlx_build.build,
        "exllamav2": exllamav2_build.build,
        "vllm": vllm_build.build,
    }
    hw = detect_hardware(timeout=1)
    for name, info in default_registry().backends().items():
        if name not in probes or info.cls.probe_build.__func__ is Engine.probe_build.__func__:  # type: ignore[attr-defined]
            continue  # a plugin, or a built-in that does not report its build yet
        got: list[str] = []
        want: list[str] = []
        assert info.cls.probe_build(hw, got) == probes[name](hw, want), name
        assert got == want, name


def test_the_hardware_layer_knows_no_engine() -> None:
    import ast

    root = Path(_hardware.__file__).parent
    modules = {
        p: ast.parse(p.read_text(encoding="utf-8"))
        for p in [
            *root.glob("*.py"),
            *(Path(m.__file__) for m in (builds, exllamav2_build, llamacpp_build, mlx_build, vllm_build)),
        ]
    }

    def imported(tree: ast.Module) -> set[str]:
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
        return names

    for path, tree in modules.items():
        names = imported(tree)
        if path.parent == root:
            assert not {n for n in names if n.startswith(("unillm.engines", "unillm._choose._registry"))}, (
                path
            )
        else:  # the build probes: the standard library, the kit and the hardware data types
            own = {n for n in names if n.split(".")[0] not in sys.stdlib_module_names and n != "__future__"}
            assert own <= {"unillm", "unillm.backend", "unillm._hardware"}, (path, own)


def fake_llama_cpp(tmp_path: Path, *libs: str) -> Path:
    pkg = tmp_path / "llama_cpp"
    (pkg / "lib").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for lib in libs:
        (pkg / "lib" / lib).write_text("")
    return pkg


def test_llama_cpp_devices_from_its_libraries(tmp_path: Path) -> None:
    cpu = fake_llama_cpp(tmp_path / "a", "libggml-base.so", "libggml-cpu.so", "libllama.so")
    cuda = fake_llama_cpp(tmp_path / "b", "libggml-base.so", "libggml-cpu.so", "libggml-cuda.so")
    old = fake_llama_cpp(tmp_path / "c", "libllama.so")
    assert llama_cpp_devices(cpu) == (("cpu",), True)
    assert llama_cpp_devices(cuda) == (("cpu", "cuda"), True)
    assert llama_cpp_devices(old) == (("cpu",), False)


H100 = GPU(0, "nvidia", "NVIDIA H100 80GB HBM3", 80 * GIB)


def with_engines(monkeypatch: pytest.MonkeyPatch, gpus: list[GPU], packages: dict[str, Path]) -> Hardware:
    monkeypatch.setattr(_hardware, "_probe_nvidia", lambda timeout, findings: (gpus, []))
    monkeypatch.setattr(_hardware, "_probe_amd", lambda timeout, findings: ([], []))
    monkeypatch.setattr(builds, "package_dir", packages.get)  # where the build probes look
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return with_engine_builds(detect_hardware(timeout=1), built_in_probes())


def test_llama_cpp_without_cuda_on_an_nvidia_machine_is_a_finding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = fake_llama_cpp(tmp_path, "libggml-base.so", "libggml-cpu.so")
    hw = with_engines(monkeypatch, [H100], {"llama_cpp": pkg})
    if platform.system() not in ("Linux", "Windows"):
        pytest.skip("NVIDIA GPUs are probed on Linux and Windows")
    assert any(
        f.startswith("llama-cpp-python is built without CUDA: reinstall with CMAKE_ARGS=-DGGML_CUDA=on")
        for f in hw.findings
    )
    assert [e.name for e in hw.engines] == ["llama.cpp"]


def test_llama_cpp_with_cuda_is_no_finding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = fake_llama_cpp(tmp_path, "libggml-base.so", "libggml-cpu.so", "libggml-cuda.so")
    hw = with_engines(monkeypatch, [H100], {"llama_cpp": pkg})
    assert not any("llama-cpp-python" in f for f in hw.findings)


def test_gpu_engines_without_a_gpu_are_findings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu_vllm = {"vllm": "0.32.0", "exllamav2": "0.3.2"}  # whatever vLLM build this machine has
    monkeypatch.setattr(
        builds,
        "dist_version",
        lambda *dists: next((gpu_vllm[d] for d in dists if d in gpu_vllm), None),
    )
    monkeypatch.setattr(vllm_build, "vllm_build", lambda: ("0.32.0", False))  # the vLLM backend's rule
    hw = with_engines(monkeypatch, [], {"exllamav2": tmp_path, "mlx": tmp_path, "vllm": tmp_path})
    assert any(f.startswith("exllamav2 is installed but there is no CUDA or ROCm GPU") for f in hw.findings)
    assert any("vLLM (GPU build) is installed but there is no GPU" in f for f in hw.findings)
    if platform.system() == "Linux":
        assert any(f.startswith("mlx on Linux runs on the CPU only") for f in hw.findings)


# -- profiles -----------------------------------------------------------------------------------


def test_every_profile_the_selector_tests_need_exists() -> None:
    assert set(PROFILE_NAMES) >= {
        "laptop-8gb-cpu",
        "m3-ultra-192gb",
        "rtx4090-1x",
        "rtx4090-4x-pcie",
        "h100-8x-nvlink",
        "b200-8x",
        "mi300x-8x",
    }


@pytest.mark.parametrize("name", PROFILE_NAMES)
def test_profiles_round_trip_through_json(name: str, tmp_path: Path) -> None:
    hw = profile(name)
    copy = tmp_path / "copy.json"
    copy.write_text(hw.to_json(), encoding="utf-8")
    assert load_hardware(copy) == hw
    assert (PROFILES / f"{name}.json").read_text(encoding="utf-8") == hw.to_json() + "\n"  # canonical
    assert hash(hw) == hash(load_hardware(copy))


def test_profiles_describe_their_machines() -> None:
    laptop = profile("laptop-8gb-cpu")
    assert laptop.gpus == () and "avx2" in laptop.cpu_features and 7 * GIB < laptop.ram_total_bytes <= 8 * GIB
    mac = profile("m3-ultra-192gb")
    assert mac.apple_silicon and mac.apple_chip == "Apple M3 Ultra" and mac.ram_bandwidth_gbps == 819
    assert mac.gpu_usable_memory_bytes == int(0.75 * 192 * GIB)
    one = profile("rtx4090-1x")
    assert one.gpu_count == 1 and one.all_nvlinked()
    four = profile("rtx4090-4x-pcie")
    assert four.gpu_count == 4 and not four.all_nvlinked() and four.nvlink == ()
    h100 = profile("h100-8x-nvlink")
    assert h100.gpu_count == 8 and h100.all_nvlinked()
    assert profile("b200-8x").all_nvlinked()
    mi300x = profile("mi300x-8x")
    assert {g.vendor for g in mi300x.gpus} == {"amd"}
    assert all(g.memory_total_bytes == 192 * GIB and g.bandwidth_gbps == 5300 for g in mi300x.gpus)


def test_summary_lines() -> None:
    assert "links    NVLink/xGMI between all 8 GPUs" in profile("h100-8x-nvlink").summary_lines()
    four = profile("rtx4090-4x-pcie").summary_lines()
    assert "links    PCIe only (no NVLink)" in four
    assert (
        "gpu 3    NVIDIA GeForce RTX 4090, 24.0 GiB (23.5 GiB free), compute 8.9, 1008 GB/s (nvml), "
        "PCIe gen 4" in four
    )
    mac = profile("m3-ultra-192gb").summary_lines()
    assert "unified  Apple M3 Ultra, 144.0 GiB usable by the GPU" in mac
    assert "memory   192.0 GiB RAM, 171.0 GiB available, 819 GB/s" in mac
    lines = Hardware(
        os="Linux", arch="x86_64", findings=("llama-cpp-python is built without CUDA",)
    ).summary_lines()
    assert lines[0] == "system   Linux x86_64"
    assert "gpus     none found" in lines and "finding  llama-cpp-python is built without CUDA" in lines


# -- load_hardware errors -----------------------------------------------------------------------


def test_load_hardware_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_hardware(tmp_path / "nope.json")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "a JSON object"),
        ('{"os": "Linux"}', "not a hardware profile"),  # arch missing
        ('{"os": "Linux", "arch": "x86_64", "ram": 8}', "not a hardware profile"),
        ('{"os": "Linux", "arch": "x86_64", "gpus": [{"index": 0, "name": "x"}]}', "not a hardware profile"),
        ('{"os": "Linux", "arch": "x86_64", "gpus": [1]}', "not a hardware profile"),
        ('{"os": "Linux", "arch": "x86_64", "cpu_cores": "many"}', "cpu_cores"),
        ('{"os": "Linux", "arch": "x86_64", "nvlink": [[0, 1]]}', "nvlink pair"),
        ('{"os": "Linux", "arch": "x86_64", "gpus": null}', "not a hardware profile"),
        (
            '{"os": "Linux", "arch": "x86_64", "gpus": [{"index": 0, "vendor": "nvida", "name": "x", '
            '"memory_total_bytes": 1}]}',
            "vendor 'nvida'",
        ),
    ],
    ids=[
        "bad-json",
        "not-object",
        "missing-key",
        "unknown-key",
        "gpu-missing-key",
        "gpu-not-object",
        "bad-type",
        "dangling-link",
        "null",
        "typo-vendor",
    ],
)
def test_load_hardware_rejects_bad_profiles(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=match):
        load_hardware(path)
