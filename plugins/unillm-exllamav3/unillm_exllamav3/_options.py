"""The ExLlamaV3 plugin's load options, install hint, and whether this machine has an NVIDIA GPU
(told without importing exllamav3, whose import compiles CUDA code)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "ASSUME_GPU_ENV",
    "INSTALL_HINT",
    "NO_GPU",
    "DEFAULT_CONTEXT",
    "PAGE",
    "ExLlamaV3Options",
    "nvidia_present",
]

INSTALL_HINT = "pip install unillm-exllamav3 exllamav3"
NO_GPU = (
    "needs an NVIDIA (CUDA) GPU and found none (exllamav3 compiles CUDA code at import); use "
    "llama.cpp for GGUF models, or MLX on a Mac"
)
#: "1" skips the GPU probe and assumes an NVIDIA GPU, "0" assumes none: for tests (against a fake
#: exllamav3) and for machines whose GPU the probe cannot see.
ASSUME_GPU_ENV = "UNILLM_EXLLAMAV3_ASSUME_GPU"
DEFAULT_CONTEXT = 4096
PAGE = 256  # exllamav3's cache page; the cache holds whole pages


@functools.lru_cache(maxsize=1)
def _nvidia_probe() -> bool:
    if Path("/dev/nvidia0").exists() or any(Path("/proc/driver/nvidia/gpus").glob("*")):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def nvidia_present() -> bool:
    """An NVIDIA GPU is there (driver nodes, then nvidia-smi), or ``ASSUME_GPU_ENV`` says so."""
    forced = os.environ.get(ASSUME_GPU_ENV, "").strip()
    return forced == "1" if forced in ("0", "1") else _nvidia_probe()


# ---- options ----


class ExLlamaV3Options(BaseModel):
    """Load options of the ExLlamaV3 backend."""

    model_config = ConfigDict(extra="forbid")

    max_seq_len: int | None = Field(
        default=None,
        ge=16,
        description="Longest sequence (prompt + completion); default: the config's context_length, "
        f"else min(the model's trained context, {DEFAULT_CONTEXT}).",
    )
    cache_size: int | None = Field(
        default=None,
        ge=PAGE,
        description="Tokens the KV cache holds, shared by all running requests (rounded up to a "
        "multiple of 256, at least max_seq_len); default: max_seq_len x max_batch_size.",
    )
    cache_type: Literal["fp16", "q8", "q6", "q4"] = Field(
        default="fp16", description="KV cache precision: FP16, or quantized to 8, 6 or 4 bits (K and V)."
    )
    tensor_parallel: bool = Field(
        default=False,
        description="Split every layer across the GPUs (exllamav3's tensor_p; MoE layers by expert "
        "parallelism unless moe_tensor_split); False splits by layers, filling each GPU in turn.",
    )
    moe_tensor_split: bool = Field(
        default=False, description="Under tensor_parallel, split MoE layers by tensor, not by expert."
    )
    tp_backend: Literal["native", "nccl"] = Field(
        default="native", description="Tensor-parallel communication: exllamav3's native one, or NCCL."
    )
    use_per_device: list[float] | None = Field(
        default=None,
        description="GB to use on each GPU, in order (0 leaves a GPU out); None: all of each.",
    )
    reserve_per_device: list[float] | None = Field(
        default=None,
        description="GB to keep free on each GPU, in order (negative leaves a GPU out); exclusive "
        "with use_per_device.",
    )
    max_batch_size: int = Field(default=8, ge=1, description="Requests decoded together.")
    max_chunk_size: int = Field(
        default=2048,
        ge=PAGE,
        description="Prompt tokens evaluated per step; smaller chunks pause running requests for "
        "less time when a long prompt arrives.",
    )
    draft_model: str | None = Field(
        default=None, description="A small EXL3 model with the same vocabulary, for speculative decoding."
    )
    num_draft_tokens: int = Field(default=4, ge=1, le=16, description="Tokens the draft model proposes.")
    seed: int | None = Field(default=None, description="Default sampling seed for requests that set none.")

    @field_validator("use_per_device", "reserve_per_device")
    @classmethod
    def _one_per_gpu(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and not value:
            raise ValueError("give one number of GB for each GPU")
        return value
