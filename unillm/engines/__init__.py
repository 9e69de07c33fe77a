"""The built-in backends, registered through the same hook a plugin uses.

Each backend lives in its own module (same shape in each) and imports its engine only in
``_load``, so registering them costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unillm.hookspecs import hookimpl


@hookimpl
def unillm_register_backends(register: Callable[[Any], None]) -> None:
    from unillm.engines.exllamav2 import ExLlamaV2Engine
    from unillm.engines.llamacpp import LlamaCppEngine
    from unillm.engines.mlx import MLXEngine
    from unillm.engines.vllm import VLLMEngine

    register(LlamaCppEngine)
    register(MLXEngine)
    register(ExLlamaV2Engine)
    register(VLLMEngine)
