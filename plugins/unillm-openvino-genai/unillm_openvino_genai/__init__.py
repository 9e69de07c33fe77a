"""unillm-openvino-genai: OpenVINO GenAI as a unillm backend, for OpenVINO IR directories.

Registered through the ``unillm`` entry-point group; the engine class's module is imported by the
hook, openvino_genai itself only when an engine loads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from unillm import hookimpl
from unillm.backend import GuideEntry

if TYPE_CHECKING:
    from unillm import ModelInfo

__all__ = ["unillm_guide_entries", "unillm_inspect_model", "unillm_register_backends"]

NAME = "openvino-genai"


@hookimpl
def unillm_register_backends(register: Callable[[Any], None]) -> None:
    from unillm_openvino_genai.engine import OpenVINOGenAIEngine

    register(OpenVINOGenAIEngine)


@hookimpl
def unillm_inspect_model(path: str) -> ModelInfo | None:
    """A directory holding ``openvino_model.xml`` is OpenVINO IR (format ``openvino``), whatever
    else it holds: the ``config.json`` optimum-cli copies beside it is not HF weights."""
    from unillm_openvino_genai._files import inspect

    return inspect(path)


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
