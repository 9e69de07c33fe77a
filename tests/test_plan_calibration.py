"""The planner's engine memory models (``plan(..., engine=Backend.memory)``), as measured on this project's
CPU machine by benchmarks/plan_vs_actual.py: exact figures on known shapes, then one real check
per engine that the plan lands within 15 % of the resident memory the engine really adds.

The arithmetic, per engine (docs/planner.md, "Calibrated on this machine"):

    KV        = KV per token (in the engine's cache dtype) x context rounded up to its step
    compute   = chunk x context x (heads x score_bytes + mask_bytes)
              + chunk x 4 x (row_floats_per_hidden x hidden + vocab),  chunk = min(context, prefill)
    resident  = weights + runtime (+ KV when allocated at load)
    total     = weights + KV + runtime + compute (the bound: a full context after its prefill)
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from unillm._hardware import GPU, Hardware
from unillm._inspect import ModelInfo
from unillm._plan._estimate import Workload, plan
from unillm.engines.llamacpp import LLAMACPP_MEMORY
from unillm.engines.mlx import MLX_MEMORY
from unillm.engines.vllm import VLLM_MEMORY

MiB = 2**20
GiB = 2**30
ROOT = Path(__file__).resolve().parent.parent

CPU = Hardware(
    os="linux",
    arch="x86_64",
    cpu_cores=2,
    ram_total_bytes=24 * GiB,
    ram_available_bytes=20 * GiB,
    ram_bandwidth_gbps=20.0,
)
GPU_BOX = replace(
    CPU,
    gpus=(
        GPU(index=0, vendor="nvidia", name="RTX 4090", memory_total_bytes=24 * GiB, bandwidth_gbps=1008.0),
    ),
)

# unillm.testing's "bench" tiny Llama: 4 layers, hidden 512, 8 heads, 2 KV heads of 64, vocab 512, f32
BENCH_GGUF = ModelInfo(
    path="tiny-bench-f32.gguf",
    format="gguf",
    architecture="llama",
    quantization="F32",
    bits_per_weight=32.0,
    parameters=12_587_520,
    weights_bytes=50_350_080,
    layers=4,
    hidden_size=512,
    heads=8,
    kv_heads=2,
    head_dim=64,
    context_length=4096,
    vocab_size=512,
)
BENCH_HF = replace(BENCH_GGUF, path="hf", format="safetensors", quantization="f32")


def test_llamacpp_allocates_its_f16_cache_at_load_and_its_compute_buffer_with_the_context() -> None:
    p = plan(BENCH_GGUF, CPU, Workload(context_length=4096), engine=LLAMACPP_MEMORY)
    kv = 2 * 4 * 2 * 64 * 2 * 4096  # f16: 8 MiB
    # a 512-token micro-batch: 8 heads of scores at 4 + 1.3 bytes, a 4-byte mask, f32 rows
    compute = round(512 * 4096 * (8 * 5.3 + 4) + 512 * 4 * (5 * 512 + 512))
    assert p.kv_bytes_per_token == 2048
    assert p.kv_bytes == kv == 8 * MiB
    assert p.resident_bytes == 50_350_080 + kv + 24 * MiB
    assert p.overhead_bytes == 24 * MiB + compute
    assert p.total_bytes == 50_350_080 + kv + 24 * MiB + compute
    assert compute == 103_599_309  # 98.8 MiB; llama.cpp itself reports a 77.5 MiB compute buffer here


def test_llamacpp_compute_buffer_matches_what_llama_cpp_reports_for_scores_and_mask() -> None:
    """llama.cpp's "CPU compute buffer size" for the bench model: 14.51 MiB at n_ctx 512, 41.51 at
    2048, 77.51 at 4096: 512 x n_ctx x (4 x 8 heads + 4) bytes plus 5.51 MiB of rows."""
    for ctx, reported in ((512, 14.51), (2048, 41.51), (4096, 77.51)):
        assert (512 * ctx * (4 * 8 + 4)) / MiB + 5.51 == pytest.approx(reported, abs=0.01)


def test_mlx_holds_only_its_weights_at_load_and_bounds_an_f32_cache_grown_in_steps() -> None:
    p = plan(BENCH_HF, CPU, Workload(context_length=1000), engine=MLX_MEMORY)
    per_token = 2 * 4 * 2 * 64 * 4  # the cache takes the weights' f32
    kv = per_token * 1024  # four steps of 256 tokens
    compute = 1000 * 1000 * (8 * 4 + 4) + 1000 * 4 * (9 * 512 + 512)
    assert p.kv_bytes_per_token == 4096
    assert p.kv_bytes == kv == 4 * MiB
    assert p.resident_bytes == 50_350_080 + 18 * MiB
    assert p.total_bytes == 50_350_080 + kv + 18 * MiB + compute
    assert p.total_bytes > p.resident_bytes


def test_mlx_prefills_in_chunks_of_2048() -> None:
    p = plan(BENCH_HF, CPU, Workload(context_length=4096), engine=MLX_MEMORY)
    compute = 2048 * 4096 * (8 * 4 + 4) + 2048 * 4 * (9 * 512 + 512)
    assert p.total_bytes == 50_350_080 + 4096 * 4096 + 18 * MiB + compute


def test_mlx_cache_of_quantized_weights_is_f16_and_an_asked_dtype_wins() -> None:
    four_bit = replace(BENCH_HF, quantization="mlx-4bit", bits_per_weight=4.5, weights_bytes=None)
    assert plan(four_bit, CPU, Workload(context_length=512), engine=MLX_MEMORY).kv_bytes_per_token == 2048
    q8 = plan(BENCH_HF, CPU, Workload(context_length=512, kv_cache_dtype="q8"), engine=MLX_MEMORY)
    assert q8.kv_bytes_per_token == round(2 * 4 * 2 * 64 * 34 / 32)


def test_vllm_holds_its_whole_kv_pool_and_a_second_interpreter_at_load() -> None:
    p = plan(BENCH_HF, CPU, Workload(context_length=512), engine=VLLM_MEMORY)
    pool = 256 * MiB  # 16 sequences x 512 tokens x 4096 bytes (f32) = 32 MiB, under the 256 MiB floor
    compute = round(512 * 512 * 8 * 0.37 + 512 * 4 * (23 * 512 + 512))
    assert p.kv_bytes_per_token == 4096
    assert p.kv_bytes == pool
    ray = 274 * MiB if importlib.util.find_spec("ray") else 0  # vLLM imports Ray where it is installed
    assert p.resident_bytes == 50_350_080 + pool + 1406 * MiB + ray
    assert p.total_bytes == p.resident_bytes + compute


def test_vllm_pool_is_16_sequences_at_most_a_quarter_of_the_ram_never_less_than_one() -> None:
    long = plan(BENCH_HF, CPU, Workload(context_length=8192), engine=VLLM_MEMORY)
    assert long.kv_bytes == 16 * 8192 * 4096  # 512 MiB
    small = replace(CPU, ram_available_bytes=1 * GiB)
    assert plan(BENCH_HF, small, Workload(context_length=8192), engine=VLLM_MEMORY).kv_bytes == GiB // 4
    tiny = replace(CPU, ram_available_bytes=64 * MiB)
    assert plan(BENCH_HF, tiny, Workload(context_length=8192), engine=VLLM_MEMORY).kv_bytes == 8192 * 4096


def test_fits_is_judged_against_the_bound_not_the_resident_figure() -> None:
    p = plan(BENCH_HF, CPU, Workload(context_length=4096), engine=MLX_MEMORY)
    tight = replace(CPU, ram_available_bytes=int((p.resident_bytes + p.total_bytes) / 2 / 0.95))
    q = plan(BENCH_HF, tight, Workload(context_length=4096), engine=MLX_MEMORY)
    assert not q.fits
    assert q.headroom_bytes < 0 < q.headroom_bytes + (q.total_bytes - q.resident_bytes)


def test_no_engine_model_off_the_cpu_or_without_one() -> None:
    """The engines were measured on a CPU: on a GPU box, or with no engine named, the generic plan."""
    wl = Workload(context_length=4096)
    on_gpu = plan(BENCH_GGUF, GPU_BOX, wl, engine=LLAMACPP_MEMORY)
    assert on_gpu == plan(BENCH_GGUF, GPU_BOX, wl)
    assert on_gpu.resident_bytes == on_gpu.total_bytes
    generic = plan(BENCH_GGUF, CPU, wl)
    assert generic.resident_bytes == generic.total_bytes


def test_the_built_in_backends_declare_their_memory() -> None:
    from unillm.engines.llamacpp import LlamaCppEngine
    from unillm.engines.mlx import MLXEngine
    from unillm.engines.vllm import VLLMEngine

    assert LlamaCppEngine.memory is LLAMACPP_MEMORY
    assert MLXEngine.memory is MLX_MEMORY
    assert VLLMEngine.memory is VLLM_MEMORY


# ---- real engines: the plan against the memory they add, in a fresh process ---------------------


def _probe() -> Any:
    spec = importlib.util.spec_from_file_location("plan_vs_actual", ROOT / "benchmarks" / "plan_vs_actual.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("plan_vs_actual", module)
    spec.loader.exec_module(module)
    return module._probe


REAL = [
    pytest.param(
        "llama.cpp",
        2048,
        marks=pytest.mark.skipif(not importlib.util.find_spec("llama_cpp"), reason="no llama-cpp-python"),
    ),
    pytest.param(
        "mlx", 512, marks=pytest.mark.skipif(not importlib.util.find_spec("mlx_lm"), reason="no mlx-lm")
    ),
    pytest.param(
        "vllm",
        512,
        marks=[pytest.mark.vllm, pytest.mark.skipif(not importlib.util.find_spec("vllm"), reason="no vllm")],
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "context"), REAL)
def test_plan_is_within_15_percent_of_the_memory_the_engine_adds(backend: str, context: int) -> None:
    """RSS, unlike time, barely moves with the machine's load: the engine's figures hold on a
    shared machine. Measured: the bench model in a fresh process, its context filled."""
    from unillm import detect_hardware, inspect_model
    from unillm.testing import tiny_model

    model = tiny_model("bench")
    path = model.gguf_path if backend == "llama.cpp" else model.hf_dir
    from unillm._choose._registry import default_registry

    memory = default_registry().get(backend).memory  # type: ignore[attr-defined]
    p = plan(inspect_model(path), detect_hardware(), Workload(context_length=context), engine=memory)
    measured = _probe()(backend, path, context)
    assert p.resident_bytes == pytest.approx(measured["load"], rel=0.15)
    assert p.total_bytes == pytest.approx(measured["peak"], rel=0.15)
