"""unillm-exllamav3: a unillm backend, ``exllamav3``, over ExLlamaV3 (EXL3 weights on NVIDIA GPUs,
one model split across 2-4 consumer GPUs).

Installed, the entry point in pyproject.toml points unillm at this module. The hooks register
``ExLlamaV3Engine`` (its module is imported inside the hook; exllamav3 itself only at load) and
add the decision guide's line for the case ExLlamaV3 is built for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unillm import hookimpl
from unillm.backend import GuideEntry

__all__ = ["GUIDE_ENTRIES", "unillm_guide_entries", "unillm_register_backends"]

#: The core's guide already names exllamav3 first for EXL3 anywhere (rank 0, with an install
#: hint); this plugin's own ``install_hint`` replaces that hint once it is registered. What it
#: adds is the field's case for it by name: EXL3 on 2-4 NVIDIA GPUs, local use (rank 0, same bonus).
GUIDE_ENTRIES = (
    GuideEntry(
        "exllamav3",
        "2-4 NVIDIA GPUs, local use: ExLlamaV3 splits an EXL3 model across them "
        "(tensor and expert parallelism)",
        formats=frozenset({"exl3"}),
        machines=frozenset({"nvidia"}),
        gpus="several",
        workload="local",
    ),
)


@hookimpl
def unillm_register_backends(register: Callable[[Any], None]) -> None:
    from unillm_exllamav3.engine import ExLlamaV3Engine

    register(ExLlamaV3Engine)


@hookimpl
def unillm_guide_entries(add: Callable[[GuideEntry], None]) -> None:
    for entry in GUIDE_ENTRIES:
        add(entry)
