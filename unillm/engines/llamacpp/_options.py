"""The llama.cpp backend's load options, and its memory model for the planner (measured).

Used by ``unillm.engines.llamacpp``, which exports both; it does not import that module.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from unillm.backend import DEFAULT_CONTEXT, EngineMemory

__all__ = ["LLAMACPP_MEMORY", "LlamaCppOptions"]

_MiB = 1 << 20

# llama.cpp 0.3.36 (llama-cpp-python), f16 KV, n_ubatch 512, no flash attention (unillm's
# defaults). At load it maps the weights and zeroes the whole KV buffer (both resident); its
# compute buffer, which llama.cpp itself sizes at chunk x context x (4 x heads + 4) bytes of
# scores and mask plus the activation rows (its log's "compute buffer size", checked on two
# shapes), is reserved but touched only by the first long prefill. Beside it, ggml converts
# the f32 scores to f16 to multiply them by the f16 V cache: 2 bytes more per score, of which
# ~1.3 were resident (score_bytes 4 + 1.3).
LLAMACPP_MEMORY = EngineMemory(runtime_bytes=24 * _MiB, prefill_chunk=512, score_bytes=5.3)


class LlamaCppOptions(BaseModel):
    """Load options of the llama.cpp backend."""

    model_config = ConfigDict(extra="forbid")

    n_ctx: int | None = Field(
        default=None,
        ge=16,
        description="Context length; default: the config's context_length, else "
        f"min(the model's trained context, {DEFAULT_CONTEXT}).",
    )
    n_gpu_layers: int | Literal["auto"] | None = Field(
        default=None,
        description="Layers offloaded to the GPU; -1 = all. Default: all when this build of "
        "llama.cpp can offload, 0 on CPU. 'auto' behaves as the default until the planner decides.",
    )
    main_gpu: int = Field(
        default=0, ge=0, description="The one GPU used; llama.cpp never splits a model here."
    )
    n_threads: int | None = Field(
        default=None, ge=1, description="Threads for decode; default: half the cores."
    )
    n_threads_batch: int | None = Field(
        default=None, ge=1, description="Threads for prefill; default: all cores."
    )
    n_batch: int = Field(default=512, ge=1, description="Prompt tokens submitted per llama_decode call.")
    n_ubatch: int = Field(default=512, ge=1, description="Physical micro-batch size.")
    flash_attn: bool = Field(
        default=False, description="Flash attention; turned on for a quantized KV cache."
    )
    kv_cache_type: Literal["f16", "q8_0", "q4_0"] = Field(default="f16", description="KV cache element type.")
    use_mmap: bool = Field(default=True, description="Memory-map the weights.")
    use_mlock: bool = Field(default=False, description="Lock the weights in RAM.")
    seed: int | None = Field(default=None, description="Default sampling seed for requests that set none.")
    verbose: bool = Field(default=False, description="Let llama.cpp print its logs to stderr.")
    allow_longer_context: bool = Field(
        default=False,
        description="Allow a context longer than the model was trained for (for RoPE-scaled models).",
    )
    skip_memory_check: bool = Field(
        default=False,
        description="Load even when the weights and KV cache look larger than the free RAM.",
    )
    parallel: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="Sequences decoded together (continuous batching in one llama.cpp context), each "
        "with the whole context; default: the config's concurrency when above 1, else 1 (one request "
        "at a time). Not with draft_model or LoRA, which run one request at a time.",
    )
    prefix_cache_tokens: int | None = Field(
        default=None,
        ge=0,
        description="With parallel above 1: cells of finished sequences kept for prefix reuse (least "
        "recently used dropped first). Every step attends over them too (one unified cache), so the "
        "default is one context (context_length); 0 keeps none.",
    )
    draft_model: str | None = Field(default=None, description="Speculative: a draft GGUF or 'prompt-lookup'.")
    num_draft_tokens: int | None = Field(default=None, ge=1, description="Tokens drafted per step.")
