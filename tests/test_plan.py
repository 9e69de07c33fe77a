"""The planner against hand arithmetic on real published configs.

Every expected figure below is written as the arithmetic a reader can redo: KV bytes per token =
2 x layers x kv_heads x head_dim x bytes per element; budgets are capacity x 0.95; overhead per
device is 512 MiB + 2 bytes x context x hidden_size; decode ceiling = bandwidth / bytes per step.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from unillm._hardware import GPU, Hardware
from unillm._inspect import ModelInfo
from unillm._plan._estimate import Plan, Workload, bits_per_weight, plan

GiB = 2**30
MiB = 2**20
GB = 10**9


def budget(capacity: int) -> int:
    return int(capacity * 0.95)


def overhead(context: int, hidden: int) -> int:
    return 512 * MiB + 2 * context * hidden


def cpu_overhead(context: int, hidden: int) -> int:
    """No CUDA context on a CPU-only machine: 32 MiB fixed (measured by plan_vs_actual.py)."""
    return 32 * MiB + 2 * context * hidden


# ---- models: published configs (config.json of each repository) -------------------------------

LLAMA_8B = ModelInfo(  # meta-llama/Llama-3.1-8B
    path="meta-llama/Llama-3.1-8B",
    format="safetensors",
    architecture="llama",
    quantization="bf16",
    parameters=8_030_261_248,
    layers=32,
    hidden_size=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    context_length=131072,
    vocab_size=128256,
)
LLAMA_8B_Q4 = replace(LLAMA_8B, path="Llama-3.1-8B-Q4_K_M.gguf", format="gguf", quantization="Q4_K_M")
LLAMA_70B = ModelInfo(  # meta-llama/Llama-3.1-70B
    path="meta-llama/Llama-3.1-70B",
    format="safetensors",
    architecture="llama",
    quantization="bf16",
    parameters=70_553_706_496,
    layers=80,
    hidden_size=8192,
    heads=64,
    kv_heads=8,
    head_dim=128,
    context_length=131072,
    vocab_size=128256,
)
LLAMA_70B_Q4 = replace(LLAMA_70B, path="Llama-3.1-70B-Q4_K_M.gguf", format="gguf", quantization="Q4_K_M")
QWEN_7B = ModelInfo(  # Qwen/Qwen2.5-7B
    path="Qwen/Qwen2.5-7B",
    format="safetensors",
    architecture="qwen2",
    quantization="bf16",
    parameters=7_615_616_512,
    layers=28,
    hidden_size=3584,
    heads=28,
    kv_heads=4,
    head_dim=128,
    context_length=32768,
    vocab_size=152064,
)
MIXTRAL = ModelInfo(  # mistralai/Mixtral-8x7B-v0.1: 46.7B total, 12.9B active
    path="mistralai/Mixtral-8x7B-v0.1",
    format="safetensors",
    architecture="mixtral",
    quantization="bf16",
    parameters=46_700_000_000,
    active_parameters=12_900_000_000,
    layers=32,
    hidden_size=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    context_length=32768,
    vocab_size=32000,
    experts=8,
    experts_per_token=2,
)

W_8B_Q4 = round(8_030_261_248 * 4.8 / 8)  # 4.82 GB
W_8B_BF16 = 8_030_261_248 * 2  # 16.06 GB
W_70B_Q4 = round(70_553_706_496 * 4.8 / 8)  # 42.33 GB
W_70B_BF16 = 70_553_706_496 * 2  # 141.1 GB
KV_8B = 131072  # 2 x 32 x 8 x 128 x 2 = 128 KiB
KV_70B = 327680  # 2 x 80 x 8 x 128 x 2 = 320 KiB

# ---- machines -----------------------------------------------------------------------------------

LAPTOP = Hardware(
    os="linux",
    arch="x86_64",
    cpu_cores=8,
    cpu_features=("avx2",),
    ram_total_bytes=8 * GiB,
    ram_available_bytes=6 * GiB,
    ram_bandwidth_gbps=60.0,
)


def rtx4090(index: int) -> GPU:
    return GPU(
        index, "nvidia", "NVIDIA GeForce RTX 4090", 24 * GiB, compute_capability="8.9", bandwidth_gbps=1008.0
    )


def h100(index: int) -> GPU:
    return GPU(
        index, "nvidia", "NVIDIA H100 80GB HBM3", 80 * GiB, compute_capability="9.0", bandwidth_gbps=3350.0
    )


ONE_4090 = Hardware(
    os="linux",
    arch="x86_64",
    cpu_cores=16,
    ram_total_bytes=64 * GiB,
    ram_bandwidth_gbps=80.0,
    gpus=(rtx4090(0),),
)
FOUR_4090 = Hardware(
    os="linux",
    arch="x86_64",
    cpu_cores=32,
    ram_total_bytes=128 * GiB,
    ram_available_bytes=120 * GiB,
    ram_bandwidth_gbps=80.0,
    gpus=tuple(rtx4090(i) for i in range(4)),
)
EIGHT_H100 = Hardware(
    os="linux",
    arch="x86_64",
    cpu_cores=112,
    ram_total_bytes=2048 * GiB,
    ram_available_bytes=2000 * GiB,
    gpus=tuple(h100(i) for i in range(8)),
    nvlink=tuple((i, j) for i in range(8) for j in range(i + 1, 8)),  # NVSwitch: every pair
)
M3_ULTRA = Hardware(
    os="darwin",
    arch="arm64",
    cpu_model="Apple M3 Ultra",
    cpu_cores=32,
    cpu_features=("neon",),
    ram_total_bytes=192 * GiB,
    apple_chip="Apple M3 Ultra",
    gpu_usable_memory_bytes=144 * GiB,  # 75 % of 192 GiB
    gpus=(GPU(0, "apple", "Apple M3 Ultra", 192 * GiB, bandwidth_gbps=819.0),),
)


def plan_for(model: ModelInfo, hw: Hardware, context: int = 8192, users: int = 1, kv: str = "f16") -> Plan:
    return plan(model, hw, Workload(context_length=context, concurrency=users, kv_cache_dtype=kv))  # type: ignore[arg-type]


# ---- KV cache -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "kv_dtype", "expected"),
    [
        (LLAMA_8B, "f16", 131072),  # 2 x 32 x 8 x 128 x 2 = 128 KiB
        (LLAMA_8B, "bf16", 131072),
        (LLAMA_8B, "f32", 262144),
        (LLAMA_8B, "fp8", 65536),
        (LLAMA_8B, "q8", 69632),  # 65536 x 34/32 (q8_0 blocks)
        (LLAMA_8B, "q4", 36864),  # 65536 x 18/32 (q4_0 blocks)
        (LLAMA_70B, "f16", 327680),  # 2 x 80 x 8 x 128 x 2 = 320 KiB
        (QWEN_7B, "f16", 57344),  # 2 x 28 x 4 x 128 x 2 = 56 KiB
        (MIXTRAL, "f16", 131072),  # same attention as Llama-3.1-8B
    ],
    ids=["8b-f16", "8b-bf16", "8b-f32", "8b-fp8", "8b-q8", "8b-q4", "70b", "qwen-7b", "mixtral"],
)
def test_kv_bytes_per_token(model: ModelInfo, kv_dtype: str, expected: int) -> None:
    assert plan_for(model, EIGHT_H100, kv=kv_dtype).kv_bytes_per_token == expected


def test_kv_total_is_per_token_times_context_times_users() -> None:
    assert plan_for(LLAMA_8B, EIGHT_H100, context=8192).kv_bytes == 1 * GiB
    assert plan_for(LLAMA_8B, EIGHT_H100, context=8192, users=4).kv_bytes == 4 * GiB
    assert plan_for(LLAMA_70B, EIGHT_H100, context=131072).kv_bytes == 40 * GiB  # 320 KiB x 128 Ki


def test_kv_head_dim_falls_back_to_hidden_over_heads() -> None:
    p = plan_for(replace(LLAMA_8B, head_dim=None), EIGHT_H100)
    assert p.kv_bytes_per_token == KV_8B  # 4096 / 32 = 128
    assert any("head_dim" in n for n in p.notes)


# ---- weights ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "bpw"),
    [
        ("Q4_K_M", 4.8),
        ("Q8_0", 8.5),
        ("Q4_0", 4.5),
        ("F16", 16.0),
        ("awq", 4.25),
        ("gptq", 4.25),
        ("mlx-4bit", 4.5),
        ("mlx-8bit", 8.5),
        ("fp8", 8.0),
        ("bf16", 16.0),
        ("exl2", None),  # EXL2's bits per weight live in its config, not its name
        (None, None),
    ],
)
def test_bits_per_weight_by_name(name: str | None, bpw: float | None) -> None:
    assert bits_per_weight(name) == bpw


def test_q4_k_m_gguf_weights_estimate() -> None:
    p = plan_for(LLAMA_8B_Q4, ONE_4090)
    assert p.weights_bytes == W_8B_Q4  # 8.03e9 x 4.8 / 8
    assert p.weights_bytes / GB == pytest.approx(4.82, abs=0.01)
    assert any("4.8 bits" in n for n in p.notes)


def test_weights_precedence_measured_then_bpw_then_name() -> None:
    assert (
        plan_for(replace(LLAMA_8B_Q4, weights_bytes=4_920_000_000), ONE_4090).weights_bytes == 4_920_000_000
    )
    assert plan_for(replace(LLAMA_8B_Q4, bits_per_weight=4.89), ONE_4090).weights_bytes == round(
        8_030_261_248 * 4.89 / 8
    )
    assert plan_for(LLAMA_8B, ONE_4090).weights_bytes == W_8B_BF16


def test_unknown_weights_never_claims_to_fit() -> None:
    p = plan_for(replace(LLAMA_8B, quantization="exl2", format="exl2"), EIGHT_H100)
    assert p.weights_bytes == 0
    assert not p.fits
    assert p.decode_tokens_per_s_ceiling is None
    assert any("unknown" in n for n in p.notes)


# ---- one GPU ------------------------------------------------------------------------------------


def test_8b_q4_on_a_4090_fits_with_hand_computed_headroom() -> None:
    p = plan_for(LLAMA_8B_Q4, ONE_4090, context=8192)
    ov = overhead(8192, 4096)  # 512 MiB + 64 MiB
    assert p.strategy == "single_gpu"
    assert p.fits
    assert p.overhead_bytes == ov
    assert p.total_bytes == W_8B_Q4 + GiB + ov
    assert p.headroom_bytes == budget(24 * GiB) - (W_8B_Q4 + GiB + ov)
    assert [pl.device for pl in p.placements] == ["gpu:0"]


def test_decode_ceiling_is_bandwidth_over_bytes_per_token() -> None:
    # The field's example: a 4.9 GB Q4_K_M 8B on a 4090 at ~1008 GB/s: ~205 tok/s at an empty cache.
    p = plan_for(replace(LLAMA_8B_Q4, weights_bytes=4_900_000_000), ONE_4090, context=1)
    assert p.decode_tokens_per_s_ceiling == pytest.approx(1008e9 / (4.9e9 + KV_8B))
    assert p.decode_tokens_per_s_ceiling == pytest.approx(205.7, abs=0.1)
    # At 8K context every token also reads the 1 GiB KV cache: 1008e9 / (4.82e9 + 1.07e9) = 171 tok/s.
    p = plan_for(LLAMA_8B_Q4, ONE_4090, context=8192)
    assert p.decode_tokens_per_s_ceiling == pytest.approx(1008e9 / (W_8B_Q4 + GiB))
    assert p.decode_tokens_per_s_ceiling == pytest.approx(171.1, abs=0.1)
    assert p.bandwidth_gbps == pytest.approx(1008.0)


def test_long_context_ooms_the_gpu_even_though_the_weights_fit() -> None:
    # bf16 8B: 16.06 GB of weights fit a 4090 at 8K, but 128K of KV is another 16 GiB.
    short = plan_for(LLAMA_8B, ONE_4090, context=8192)
    assert short.strategy == "single_gpu"
    assert short.fits
    long = plan_for(LLAMA_8B, ONE_4090, context=131072)
    assert long.kv_bytes == 16 * GiB
    assert long.strategy == "partial_offload"  # it no longer fits the GPU alone
    # per layer (16.06e9 + 16 GiB) / 32; GPU room 24 GiB x 0.95 - (512 MiB + 2 x 128Ki x 4096)
    per_layer = (W_8B_BF16 + 16 * GiB) / 32
    room = budget(24 * GiB) - overhead(131072, 4096)
    assert long.gpu_layers == int(room // per_layer) == 22
    assert long.fits  # 10 layers in 64 GiB of RAM
    # the GPU part at 1008 GB/s and the RAM part at 80 GB/s take turns: RAM dominates
    step_bytes = W_8B_BF16 + 16 * GiB
    t = (22 / 32) * step_bytes / 1008e9 + (10 / 32) * step_bytes / 80e9
    assert long.decode_tokens_per_s_ceiling == pytest.approx(1 / t, rel=1e-6)
    assert long.decode_tokens_per_s_ceiling == pytest.approx(6.56, abs=0.01)


def test_partial_offload_of_70b_q4_on_one_4090() -> None:
    p = plan_for(LLAMA_70B_Q4, ONE_4090, context=8192)
    kv = KV_70B * 8192  # 2.5 GiB
    per_layer = (W_70B_Q4 + kv) / 80  # 0.563 GB
    room = budget(24 * GiB) - overhead(8192, 8192)  # 22.8 GiB - 0.625 GiB
    assert p.strategy == "partial_offload"
    assert p.gpu_layers == int(room // per_layer) == 42
    assert p.fits
    gpu, cpu = p.placements
    assert (gpu.device, gpu.layers, cpu.device, cpu.layers) == ("gpu:0", 42, "cpu", 38)
    assert gpu.weights_bytes + cpu.weights_bytes == W_70B_Q4
    t = (42 / 80) * (W_70B_Q4 + kv) / 1008e9 + (38 / 80) * (W_70B_Q4 + kv) / 80e9
    assert p.decode_tokens_per_s_ceiling == pytest.approx(1 / t, rel=1e-6)
    assert p.decode_tokens_per_s_ceiling == pytest.approx(3.44, abs=0.01)
    assert any("total RAM" in n for n in p.notes)  # RAM available was not in the profile


def test_partial_offload_without_ram_bandwidth_has_no_ceiling() -> None:
    p = plan_for(LLAMA_70B_Q4, replace(ONE_4090, ram_bandwidth_gbps=None))
    assert p.strategy == "partial_offload"
    assert p.decode_tokens_per_s_ceiling is None
    assert any("bandwidth of cpu unknown" in n for n in p.notes)


def test_too_big_for_gpu_and_ram_does_not_fit() -> None:
    p = plan_for(LLAMA_70B, ONE_4090)  # 141 GB of bf16 weights, 24 GiB + 64 GiB
    assert not p.fits
    assert p.headroom_bytes < 0
    assert p.total_bytes > 88 * GiB


# ---- several GPUs -------------------------------------------------------------------------------


def test_four_4090s_without_nvlink_split_by_pipeline() -> None:
    p = plan_for(LLAMA_70B_Q4, FOUR_4090, context=8192)
    kv = KV_70B * 8192
    assert p.strategy == "multi_gpu"
    assert p.parallelism == "pipeline"
    assert p.fits
    # one 4090 holds 22.8 GiB - 0.625 GiB < 41.9 GiB; two hold 2 x 22.2 GiB
    assert [pl.device for pl in p.placements] == ["gpu:0", "gpu:1"]
    assert [pl.layers for pl in p.placements] == [40, 40]
    assert p.headroom_bytes == 2 * budget(24 * GiB) - (W_70B_Q4 + kv + 2 * overhead(8192, 8192))
    # stages take turns: one sequence runs at one GPU's bandwidth, not the sum
    assert p.decode_tokens_per_s_ceiling == pytest.approx(1008e9 / (W_70B_Q4 + kv), rel=1e-6)
    assert p.decode_tokens_per_s_ceiling == pytest.approx(22.4, abs=0.1)
    assert any("without NVLink" in n for n in p.notes)


def test_four_4090s_partial_offload_uses_one_gpu() -> None:
    p = plan_for(LLAMA_70B, FOUR_4090, context=8192)  # 141 GB bf16 > 4 x 22.8 GiB
    assert p.strategy == "partial_offload"
    assert [pl.device for pl in p.placements] == ["gpu:0", "cpu"]
    assert any("one GPU" in n for n in p.notes)


def test_70b_bf16_on_8xh100_uses_two_gpus_with_tensor_parallelism() -> None:
    p = plan_for(LLAMA_70B, EIGHT_H100, context=8192)
    kv = KV_70B * 8192
    assert p.weights_bytes == W_70B_BF16
    assert p.strategy == "multi_gpu"
    assert p.parallelism == "tensor"
    assert len(p.placements) == 2
    assert sum(pl.weights_bytes for pl in p.placements) == W_70B_BF16
    # NVLink: bandwidths add, 2 x 3350 GB/s / (141.1 GB + 2.68 GB) = 46.6 tok/s
    assert p.decode_tokens_per_s_ceiling == pytest.approx(2 * 3350e9 / (W_70B_BF16 + kv), rel=1e-6)
    assert p.decode_tokens_per_s_ceiling == pytest.approx(46.6, abs=0.1)
    assert p.bandwidth_gbps == pytest.approx(6700.0)


def test_64_users_need_four_h100s_for_their_kv_cache() -> None:
    p = plan_for(LLAMA_70B, EIGHT_H100, context=8192, users=64)
    kv = KV_70B * 8192 * 64  # 160 GiB
    assert p.kv_bytes == 160 * GiB
    assert len(p.placements) == 4  # 2 hold 161.9 GB, 3 would hold 242.8 GB < 312.9 GB
    step = W_70B_BF16 + kv
    assert p.decode_tokens_per_s_ceiling == pytest.approx(4 * 3350e9 / step, rel=1e-6)  # 42.8
    assert p.aggregate_decode_tokens_per_s_ceiling == pytest.approx(64 * 4 * 3350e9 / step, rel=1e-6)


def test_tensor_parallel_size_divides_the_heads() -> None:
    # 16 users: 141.1 GB + 42.9 GB would fit 3 H100s, but 64 heads do not split 3 ways.
    p = plan_for(LLAMA_70B, EIGHT_H100, context=8192, users=16)
    room = budget(80 * GiB) - overhead(8192, 8192)
    assert 2 * room < W_70B_BF16 + 16 * KV_70B * 8192 <= 3 * room
    assert len(p.placements) == 4
    assert p.parallelism == "tensor"


def test_mixtral_reads_only_its_active_experts() -> None:
    p = plan_for(MIXTRAL, EIGHT_H100, context=8192)
    weights = 46_700_000_000 * 2  # all 8 experts resident: 93.4 GB
    active = round(weights * 12.9 / 46.7)  # 25.8 GB read per token
    assert p.weights_bytes == weights
    assert p.active_weights_bytes == active
    assert len(p.placements) == 2  # 93.4 GB + 1 GiB > one H100's 81.6 GB budget
    assert p.decode_tokens_per_s_ceiling == pytest.approx(2 * 3350e9 / (active + GiB), rel=1e-6)
    assert p.decode_tokens_per_s_ceiling == pytest.approx(249.3, abs=0.1)


# ---- Apple unified memory -----------------------------------------------------------------------


def test_m3_ultra_holds_70b_bf16_within_its_working_set() -> None:
    p = plan_for(LLAMA_70B, M3_ULTRA, context=8192)
    kv = KV_70B * 8192
    assert p.strategy == "unified"
    assert p.fits
    assert p.headroom_bytes == budget(144 * GiB) - (W_70B_BF16 + kv + overhead(8192, 8192))
    assert p.decode_tokens_per_s_ceiling == pytest.approx(819e9 / (W_70B_BF16 + kv), rel=1e-6)  # 5.7
    assert p.decode_tokens_per_s_ceiling == pytest.approx(5.70, abs=0.01)


def test_m3_ultra_at_32k_spills_past_the_working_set() -> None:
    p = plan_for(LLAMA_70B, M3_ULTRA, context=32768)  # KV 10 GiB more: past 144 GiB x 0.95
    kv = KV_70B * 32768
    assert p.strategy == "partial_offload"
    room = budget(144 * GiB) - overhead(32768, 8192)
    assert p.gpu_layers == int(room // ((W_70B_BF16 + kv) / 80)) == 76
    assert p.fits  # the other 4 layers fit the rest of the 192 GiB
    assert p.decode_tokens_per_s_ceiling is None  # the CPU's share of bandwidth is not in the profile


def test_apple_working_set_defaults_to_75_percent() -> None:
    p = plan_for(LLAMA_70B, replace(M3_ULTRA, gpu_usable_memory_bytes=None), context=8192)
    assert p.placements[0].capacity_bytes == budget(int(192 * GiB * 0.75))
    assert any("working set unknown" in n for n in p.notes)


# ---- CPU only -----------------------------------------------------------------------------------


def test_8b_q4_on_an_8gb_laptop_fits_at_4k_but_not_32k() -> None:
    short = plan_for(LLAMA_8B_Q4, LAPTOP, context=4096)
    need = W_8B_Q4 + 4096 * KV_8B + cpu_overhead(4096, 4096)  # 4.82 GB + 0.5 GiB + 0.06 GiB
    assert short.strategy == "cpu"
    assert short.fits
    assert short.headroom_bytes == budget(6 * GiB) - need  # RAM available, not total
    assert short.decode_tokens_per_s_ceiling == pytest.approx(60e9 / (W_8B_Q4 + 4096 * KV_8B), rel=1e-6)
    # 32K: the weights still fit, the 4 GiB KV cache does not
    long = plan_for(LLAMA_8B_Q4, LAPTOP, context=32768)
    assert budget(6 * GiB) > W_8B_Q4
    assert not long.fits
    assert long.headroom_bytes == budget(6 * GiB) - (W_8B_Q4 + 4 * GiB + cpu_overhead(32768, 4096)) < 0
    # at 16K an f16 cache (2 GiB) does not fit either, a q4 one (16384 x 36864 = 0.5625 GiB) does
    assert not plan_for(LLAMA_8B_Q4, LAPTOP, context=16384).fits
    q4 = plan_for(LLAMA_8B_Q4, LAPTOP, context=16384, kv="q4")
    assert q4.fits
    assert q4.headroom_bytes == budget(6 * GiB) - (W_8B_Q4 + 16384 * 36864 + cpu_overhead(16384, 4096)) >= 0


def test_cpu_without_ram_bandwidth_has_no_ceiling() -> None:
    p = plan_for(LLAMA_8B_Q4, replace(LAPTOP, ram_bandwidth_gbps=None), context=4096)
    assert p.fits
    assert p.decode_tokens_per_s_ceiling is None


def test_plan_is_a_pure_function_of_its_inputs() -> None:
    assert plan_for(QWEN_7B, FOUR_4090) == plan_for(QWEN_7B, FOUR_4090)
    assert plan(QWEN_7B, LAPTOP) == plan(QWEN_7B, LAPTOP, Workload())
