"""unillm-onnxruntime-genai: ONNX Runtime GenAI model directories as a unillm backend.

Importing this package imports neither onnxruntime-genai nor the engine module: the hooks below
import the engine class only when unillm asks for the backends, and the class imports
``onnxruntime_genai`` in ``load()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from unillm import hookimpl
from unillm.backend import GuideEntry

if TYPE_CHECKING:
    from unillm import ModelInfo

__all__ = ["FORMAT", "NAME"]

NAME = "onnxruntime-genai"
#: The format name the plugin's inspection gives a genai_config.json directory.
FORMAT = "onnx-genai"


@hookimpl
def unillm_register_backends(register: Callable[[Any], None]) -> None:
    from unillm_onnxruntime_genai.engine import OnnxGenAIEngine

    register(OnnxGenAIEngine)


@hookimpl
def unillm_inspect_model(path: str) -> ModelInfo | None:
    """A directory holding genai_config.json is this plugin's format, whatever else it holds (a
    config.json beside it, as Hugging Face's ONNX repos ship, is not HF weights)."""
    from unillm_onnxruntime_genai._files import inspect

    return inspect(path)


@hookimpl
def unillm_guide_entries(add: Callable[[GuideEntry], None]) -> None:
    # Only ONNX Runtime GenAI reads its own model directories: first choice for them everywhere.
    # The reasons say where it is the field's choice: an application shipping one model to CPUs
    # and Windows GPUs (DirectML), with no Python ML stack to run it.
    formats = frozenset({FORMAT})
    add(
        GuideEntry(
            NAME,
            "app deployment on CPUs: ONNX Runtime GenAI runs its own format with no Python ML stack",
            formats=formats,
            machines=frozenset({"cpu"}),
        )
    )
    add(
        GuideEntry(
            NAME,
            "an ONNX Runtime GenAI directory is that runtime's own format "
            "(Windows GPUs through DirectML, NVIDIA with onnxruntime-genai-cuda)",
            formats=formats,
            install="pip install unillm-onnxruntime-genai",
        )
    )
