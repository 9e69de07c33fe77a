"""unillm-onnxruntime-genai: ONNX Runtime GenAI model directories as a unillm backend.

Importing this package imports neither onnxruntime-genai nor the engine module: the hooks below
import the engine class only when unillm asks for the backends, and the class imports
``onnxruntime_genai`` in ``load()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unillm import hookimpl
from unillm.backend import GuideEntry

__all__ = ["FORMAT", "NAME"]

NAME = "onnxruntime-genai"
#: The format name the plugin reads; unillm's inspector has no name for it (README: the gap).
FORMAT = "onnx-genai"


@hookimpl
def unillm_register_backends(register: Callable[[Any], None]) -> None:
    from unillm_onnxruntime_genai.engine import OnnxGenAIEngine

    register(OnnxGenAIEngine)


@hookimpl
def unillm_guide_entries(add: Callable[[GuideEntry], None]) -> None:
    # Only ONNX Runtime GenAI reads its own model directories; the entries say where it is the
    # field's choice beyond that: an application shipping one model to Windows PCs (DirectML)
    # and CPUs, local use.
    own = "an ONNX Runtime GenAI model directory is that runtime's own format"
    add(GuideEntry(NAME, own, formats=frozenset({FORMAT})))
    add(
        GuideEntry(
            NAME,
            "app deployment on CPUs and Windows GPUs (DirectML): one ONNX model, no Python ML stack",
            formats=frozenset({FORMAT}),
            machines=frozenset({"cpu", "amd", "nvidia"}),
            workload="local",
            rank=0,
            install="pip install unillm-onnxruntime-genai (onnxruntime-genai-directml on Windows GPUs)",
        )
    )
