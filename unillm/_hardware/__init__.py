"""What machine this is: a frozen, serializable snapshot the selector and planner read.

``detect_hardware()`` probes this machine (each probe short and never fatal); ``Hardware`` values
can also be written as literals or loaded from JSON, so a plan can be made for a machine you do not
have (an 8xH100 box is a test fixture, not a purchase).

Nothing heavy is imported here: ``pynvml`` is imported inside the NVIDIA probe, and command-line
tools run as subprocesses with a timeout. docs/hardware.md says what is detected and how.

No engine is known here: ``Hardware.engines`` (``EngineBuild``) is data that ``detect_hardware``
leaves empty; the backends report their installed builds (``Engine.probe_build``), which
``unillm._choose._doctor.with_engine_builds`` adds for ``unillm doctor``.

One layer a module: ``_model`` (the data model and its JSON), ``_bandwidth`` (bandwidth figures),
``_run`` (bounded subprocesses and calls), ``_host`` (CPU and memory), ``_nvidia`` and ``_amd``
(GPUs). They import one another, never this package.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

from unillm._hardware._amd import (
    _probe_amd,
    parse_amd_smi_static,
    parse_rocm_smi,
    parse_rocm_smi_topotype,
)
from unillm._hardware._bandwidth import apple_bandwidth, bandwidth_from_table, nvml_bandwidth
from unillm._hardware._host import _linux_memory as _linux_memory
from unillm._hardware._host import _probe_host, _usable_cpus, cpu_features_from_flags
from unillm._hardware._model import GPU, EngineBuild, Hardware, load_hardware
from unillm._hardware._model import Vendor as Vendor
from unillm._hardware._nvidia import _probe_nvidia, _visible, parse_nvidia_smi_csv, parse_nvidia_smi_topo

__all__ = [
    "GPU",
    "EngineBuild",
    "Hardware",
    "apple_bandwidth",
    "bandwidth_from_table",
    "cpu_features_from_flags",
    "detect_hardware",
    "load_hardware",
    "nvml_bandwidth",
    "parse_amd_smi_static",
    "parse_nvidia_smi_csv",
    "parse_nvidia_smi_topo",
    "parse_rocm_smi",
    "parse_rocm_smi_topotype",
]
# Imported from here too, though not in __all__ (the ``as`` marks them re-exported): _linux_memory
# (_quick.py) and Vendor.


def detect_hardware(*, timeout: float = 2.0) -> Hardware:
    """Probe this machine. Each probe runs at most ``timeout`` seconds and never raises: what it
    cannot learn is left at its default and noted in ``findings``. Installed engines are not
    probed here (``engines`` is empty): the backends report them (``unillm doctor``)."""
    findings: list[str] = []
    info: dict[str, Any] = {
        "os": platform.system() or sys.platform,
        "arch": platform.machine() or "unknown",
        "cpu_cores": _usable_cpus(),
    }
    try:
        _probe_host(info, findings, timeout)
    except Exception as exc:
        findings.append(f"CPU and memory could not be read: {exc!r}")

    gpus: list[GPU] = []
    links: list[tuple[int, int]] = []
    if info["os"] in ("Linux", "Windows"):
        try:
            gpus, links = _probe_nvidia(timeout, findings)
            gpus, links = _visible(gpus, links, os.environ.get("CUDA_VISIBLE_DEVICES"), findings)
        except Exception as exc:
            findings.append(f"NVIDIA GPUs could not be read: {exc!r}")
        if not gpus and info["os"] == "Linux":
            gpus, links = _probe_amd(timeout, findings)

    return Hardware(
        **info,
        gpus=tuple(gpus),
        nvlink=tuple(links),
        findings=tuple(dict.fromkeys(findings)),
    )
