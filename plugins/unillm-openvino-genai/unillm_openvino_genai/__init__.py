"""unillm-openvino-genai: OpenVINO GenAI as a unillm backend, for OpenVINO IR directories.

Registered through the ``unillm`` entry-point group; the engine class's module is imported by the
hook, openvino_genai itself only when an engine loads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unillm import hookimpl
from unillm.backend import GuideEntry

__all__ = ["unillm_guide_entries", "unillm_register_backends"]

NAME = "openvino-genai"


@hookimpl
def unillm_register_backends(register: Callable[[Any], None]) -> None:
    from unillm_openvino_genai.engine import OpenVINOGenAIEngine

    register(OpenVINOGenAIEngine)


@hookimpl
def unillm_guide_entries(add: Callable[[GuideEntry], None]) -> None:
    # Intel hardware is the engine's own (suitability adds to its score there); the guide's
    # cases tell machines apart by GPU vendor only, so this entry names the format alone
    add(
        GuideEntry(
            NAME,
            "OpenVINO IR is OpenVINO's own format (Intel CPUs, GPUs and NPUs)",
            formats=frozenset({"openvino"}),
            install="pip install unillm-openvino-genai",
        )
    )
