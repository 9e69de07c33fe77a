"""What the tests share besides fixtures: engine options and how to open an engine on a path."""

from __future__ import annotations

from pathlib import Path

from unillm_openvino_genai.engine import OpenVINOGenAIEngine

# bf16 is the CPU plugin's default inference precision where the CPU has it (AMX, AVX512-BF16),
# which moves greedy tokens off llama.cpp's f32 ones; parity is checked with these properties
F32: dict[str, str] = {"INFERENCE_PRECISION_HINT": "f32"}


def open_engine(
    path: Path | str, config: dict[str, object] | None = None, **options: object
) -> OpenVINOGenAIEngine:
    """An engine (not loaded) on ``path`` with these load options and engine ``config``."""
    cfg = {"model": str(path), "backend_options": {"openvino-genai": options}, **(config or {})}
    return OpenVINOGenAIEngine(cfg)
