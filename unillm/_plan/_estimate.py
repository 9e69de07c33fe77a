"""Memory and speed math: does a model fit this machine at this context and concurrency, where
do its layers go, and how fast can decode possibly be. Pure functions over data (no I/O).

Units: bytes are bytes; GiB = 2**30 bytes; bandwidth is GB/s = 10**9 bytes per second (as vendors
quote it); speeds are tokens per second. Every figure is an estimate from headers, and every
assumption the planner makes is written into ``Plan.notes``. docs/planner.md has worked examples.

Formulas:

- **weights** W = ``model.weights_bytes`` when the inspector measured it, else
  parameters x bits per weight / 8, with bits per weight from ``model.bits_per_weight`` or, failing
  that, from the quantization name (``BITS_PER_WEIGHT``: GGUF Q4_K_M 4.8, Q8_0 8.5, Q4_0 4.5,
  F16 16; AWQ/GPTQ 4-bit g128 4.25; MLX 4-bit g64 4.5; fp8 8; bf16 16; ...).
- **active weights** A = W x active_parameters / parameters for MoE (the weights one token reads),
  else W.
- **KV per token** = 2 (K and V) x layers x kv_heads x head_dim x bytes per element, with bytes per
  element from ``Workload.kv_cache_dtype`` (``KV_BYTES_PER_ELEMENT`` in unillm/_inspect/_kv.py, the one
  table every backend's ``kv_stats`` uses too: f16/bf16 2, f32 4, fp8 1, q8 = q8_0 34/32,
  q6 26/32, q4 = q4_0 18/32). head_dim defaults to hidden_size / heads, kv_heads to heads.
- **KV total** = KV per token x context x concurrency (an upper bound: paged attention allocates
  what is used, and shared prefixes share blocks).
- **overhead per device** = ``FIXED_OVERHEAD_BYTES`` (512 MiB: CUDA context, cuBLAS/Metal
  workspaces, allocator slack; ``CPU_FIXED_OVERHEAD_BYTES``, 32 MiB, on a CPU-only machine) +
  ``ACTIVATION_BYTES`` (2) x context x hidden_size (f16 activations of one context-long prefill;
  replicated on every device that computes). Generic: it undercounts an engine that holds
  attention scores (docs/planner.md, "Calibrated on this machine").
- **with an engine** (``plan(..., engine=Backend.memory)``, CPU-only machines): its measured
  ``EngineMemory`` replaces the overhead: runtime + one prefill step's compute (chunk x context
  attention scores and mask, chunk x activation rows); KV in the engine's cache dtype and growth
  step; ``resident_bytes`` = W + runtime (+ KV allocated at load), ``total_bytes`` the bound.
- **budget per device** = capacity x (1 - ``RESERVE_FRACTION``) where ``RESERVE_FRACTION`` = 0.05
  is kept free. Capacity: a GPU's free memory (else its total); Apple's GPU working set
  ``gpu_usable_memory_bytes`` (else ``APPLE_DEFAULT_WORKING_SET`` x RAM); system RAM available
  (else total).
- **placement**, the first that fits of: all on one GPU (the one with the largest budget); split
  across the fewest GPUs that fit (weights and KV in proportion to each GPU's budget less its
  overhead): tensor parallel when NVLink joins them (the count must divide the attention heads and
  divide or be divided by the KV heads), else pipeline parallel (whole layers per GPU); partial
  (layer) offload on one GPU, gpu_layers = floor((GPU budget - overhead) / ((W + KV) / layers)),
  the other layers in RAM; CPU-only in RAM. On Apple Silicon: unified memory (the GPU working
  set), then partial offload (the rest of the same RAM), then CPU. When none fits, the attempt
  with the largest (least negative) headroom is returned.
- **headroom** = sum of the budgets of the devices used - (W + KV + overhead); negative when it
  does not fit.
- **decode ceiling** (per sequence) = 1 / t, where one decode step reads B = A + concurrency x KV
  per token x context bytes, device i holds share f_i of them and t = f_i x B / bw_i on one device,
  max_i(f_i x B / bw_i) under tensor parallelism over NVLink (bandwidths add), and
  sum_i(f_i x B / bw_i) under pipeline parallelism and partial offload (devices take turns, so
  the slower memory dominates). Aggregate = concurrency / t. Engines reach roughly 60-85 % of
  this ceiling (model bandwidth utilization); unknown bandwidth gives ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from unillm._inspect._kv import KV_BYTES_PER_ELEMENT, kv_bytes_per_token, kv_dtype
from unillm._inspect._model import bits_per_weight
from unillm._plan._placement import (
    Placement,
    Strategy,
    _Attempt,
    _attempts,
    tensor_parallel_ok,
)

if TYPE_CHECKING:
    from unillm._hardware import Hardware
    from unillm._inspect import ModelInfo

__all__ = ["KV_BYTES_PER_ELEMENT", "Placement", "Plan", "Workload", "plan", "tensor_parallel_ok"]

MiB = 1 << 20
GiB = 1 << 30
GB = 10**9

FIXED_OVERHEAD_BYTES = 512 * MiB
#: CPU-only machines: no CUDA context; the built-in engines' runtimes took 18-24 MiB here
CPU_FIXED_OVERHEAD_BYTES = 32 * MiB
"""Per device: CUDA context (300-500 MiB), cuBLAS/Metal workspaces, allocator slack."""
ACTIVATION_BYTES = 2
"""Bytes per element of activations/compute buffers, counted as context x hidden_size per device."""


@dataclass(frozen=True)
class EngineMemory:
    """How one engine spends memory around the weights and the KV cache, measured on the CPU by
    benchmarks/plan_vs_actual.py (docs/planner.md, "Calibrated on this machine"). A backend
    declares its own as the class attribute ``memory``; ``plan(..., engine=...)`` uses it, and
    without one the generic overhead formula applies.

    The compute term is one prefill step's working set: a chunk of ``prefill_chunk`` prompt tokens
    attends to the whole context, and an engine without flash attention holds the chunk x context
    x heads attention scores (``score_bytes`` per score: f32 scores, plus the copies the engine
    makes) and a chunk x context mask (``mask_bytes`` per element), beside ``row_floats`` f32
    activations per chunk token (residual stream, norm, MLP and logits rows; fitted, below).
    """

    runtime_bytes: int
    """Fixed allocations at load beyond weights, KV and compute buffers: thread pools, tokenizer,
    graph metadata, or a second interpreter the engine runs in."""
    prefill_chunk: int
    """Prompt tokens one forward pass takes (the engine's micro-batch or prefill step)."""
    score_bytes: float
    """Bytes held per attention score at the peak of a prefill step (0 under flash attention)."""
    mask_bytes: float = 4.0
    """Bytes per element of the chunk x context attention mask."""
    kv_in_weights_dtype: bool = False
    """The cache takes the dtype the weights run in, not the workload's ``kv_cache_dtype``."""
    kv_step: int = 1
    """The cache grows in steps of this many tokens (mlx-lm: 256)."""
    kv_upfront: bool = True
    """The whole cache is allocated and written (zeroed) at load; else it grows as tokens arrive."""
    kv_regrow_copies: float = 0.0
    """Extra cache-sized buffers a growing cache leaves resident (mlx-lm concatenates the old
    cache with a new step; the old one stays in MLX's buffer cache)."""
    row_floats_per_hidden: float = 5.0
    """Activation floats per chunk token, as a multiple of hidden_size (plus one row of logits)."""
    kv_min_sequences: int = 1
    """The cache is sized for at least this many sequences (a pool allocated at load)."""
    kv_floor_bytes: int = 0
    """The cache is never smaller than this."""
    kv_ram_share: float = 0.0
    """The cache is at most this share of the RAM available, never less than one workload (0: no cap)."""


@dataclass(frozen=True)
class Workload:
    """What the model is asked to do."""

    context_length: int = 4096
    concurrency: int = 1
    goal: Literal["latency", "throughput", "cost", "portability"] = "latency"
    kv_cache_dtype: Literal["f16", "bf16", "f32", "q8", "q4", "fp8"] = "f16"
    shared_prefix: bool = False
    #: what the engine loads for (docs/embeddings.md): a backend that cannot is not a candidate
    task: Literal["generate", "embed", "rerank"] = "generate"


@dataclass(frozen=True)
class Plan:
    """The planner's answer. Every byte figure is an estimate from headers, explained in ``notes``.

    ``total_bytes`` = weights + KV + overhead, the upper bound once the context is full;
    ``resident_bytes`` is what is held right after load; ``headroom_bytes`` is what the devices used have
    left beyond the reserve (negative: short by that much). ``decode_tokens_per_s_ceiling`` is per
    sequence; ``aggregate_decode_tokens_per_s_ceiling`` is for all ``concurrency`` sequences.
    """

    weights_bytes: int
    kv_bytes_per_token: int
    kv_bytes: int
    overhead_bytes: int
    total_bytes: int
    fits: bool
    headroom_bytes: int
    placements: tuple[Placement, ...] = ()
    gpu_layers: int | None = None  # partial (layer) offload: layers on the GPU
    decode_tokens_per_s_ceiling: float | None = None
    bandwidth_gbps: float | None = None
    notes: tuple[str, ...] = field(default=())
    strategy: Strategy | None = None
    parallelism: Literal["tensor", "pipeline"] | None = None
    active_weights_bytes: int | None = None
    aggregate_decode_tokens_per_s_ceiling: float | None = None
    resident_bytes: int | None = None
    """What the engine holds once loaded, before any token: ``total_bytes`` for an engine that
    allocates everything up front or an unknown engine; less for one that grows its cache and
    compute buffers as tokens arrive (mlx). ``fits`` and ``headroom_bytes`` are always against
    ``total_bytes``, the bound at a full context."""


def plan(
    model: ModelInfo,
    hardware: Hardware,
    workload: Workload | None = None,
    *,
    engine: EngineMemory | None = None,
) -> Plan:
    """Plan ``model`` on ``hardware`` for ``workload`` (default: 4096 tokens, one sequence).

    :param model: what the model is (a ``ModelInfo`` from ``inspect_model`` or a literal).
    :param hardware: the machine (a ``Hardware`` from ``detect_hardware``, a profile or a literal).
    :param workload: context length, concurrency and KV cache dtype.
    :param engine: the memory model of the backend that will run it (its ``memory``), when known:
        on a CPU-only machine, where the built-in ones were measured, its cache dtype and growth,
        compute buffers and runtime replace the generic overhead.
    :returns: the memory needed, where it goes, whether it fits and the decode speed ceiling;
        the formulas are in this module's docstring and docs/planner.md.
    """
    wl = workload or Workload()
    context = max(1, wl.context_length)
    concurrency = max(1, wl.concurrency)
    notes: list[str] = []

    weights = _weights_bytes(model, notes)
    active = _active_weights_bytes(model, weights, notes)
    if hardware.gpus or hardware.apple_silicon:
        engine = None  # measured on a CPU: says nothing of CUDA contexts or Metal
    kv_dtype_name = _engine_kv_dtype(model, engine, wl.kv_cache_dtype)
    kv_per_token = _kv_bytes_per_token(model, kv_dtype_name, notes)
    kv_total = kv_per_token * context * concurrency
    if engine is not None:
        kv_total = _engine_kv_bytes(engine, kv_per_token, context, concurrency, hardware)
    if concurrency > 1:
        notes.append(
            f"KV cache sized for {concurrency} sequences of {context} tokens each: an upper bound"
            + (", shared prefixes share KV blocks" if wl.shared_prefix else "")
        )
    if model.context_length is not None and context > model.context_length:
        notes.append(f"context {context} is longer than the model's trained {model.context_length} tokens")
    if model.hybrid_attention:
        notes.append("hybrid attention: KV counted as if every layer were full attention (an upper bound)")
    if engine is None:
        fixed = FIXED_OVERHEAD_BYTES if hardware.gpus or hardware.apple_silicon else CPU_FIXED_OVERHEAD_BYTES
        per_device_overhead = fixed + _activation_bytes(model, context, notes)
        resident_extra = None
    else:
        compute = _compute_bytes(model, engine, context)
        regrow = round(kv_total * engine.kv_regrow_copies)
        per_device_overhead = engine.runtime_bytes + compute + regrow
        resident_extra = engine.runtime_bytes + (kv_total if engine.kv_upfront else 0)
        notes.append(
            f"the engine's memory as measured on a CPU: {kv_dtype_name} KV cache "
            + ("allocated at load" if engine.kv_upfront else "grown as tokens arrive")
            + f", {compute / MiB:.1f} MiB for a {min(context, engine.prefill_chunk)}-token prefill step, "
            f"{engine.runtime_bytes / MiB:.0f} MiB runtime"
        )

    attempts = _attempts(model, hardware, weights, kv_total, per_device_overhead, notes)
    chosen = next((a for a in attempts if a.fits), None)
    if chosen is None:
        chosen = max(attempts, key=lambda a: a.headroom)
    notes.extend(chosen.notes)
    if weights == 0:
        chosen = replace(chosen, fits=False)
        notes.append("weights size unknown: the plan cannot say whether the model fits")

    overhead = sum(p.overhead_bytes for p in chosen.placements)
    total = weights + kv_total + overhead
    resident = total if resident_extra is None else weights + resident_extra
    read_per_step = active + kv_per_token * context * concurrency
    step_s = _step_seconds(chosen, read_per_step, weights + kv_total, notes) if weights else None
    per_seq = aggregate = bandwidth = None
    if step_s:
        per_seq = 1 / step_s
        aggregate = concurrency / step_s
        bandwidth = read_per_step / step_s / GB
        notes.append(
            f"decode ceiling: {bandwidth:.0f} GB/s / {read_per_step / GB:.2f} GB read per step "
            f"= {per_seq:.1f} tok/s per sequence; engines reach ~60-85% of it"
        )
    return Plan(
        weights_bytes=weights,
        kv_bytes_per_token=kv_per_token,
        kv_bytes=kv_total,
        overhead_bytes=overhead,
        total_bytes=total,
        fits=chosen.fits,
        headroom_bytes=chosen.headroom,
        placements=chosen.placements,
        gpu_layers=chosen.gpu_layers,
        decode_tokens_per_s_ceiling=per_seq,
        bandwidth_gbps=bandwidth,
        notes=tuple(notes),
        strategy=chosen.strategy,
        parallelism=chosen.parallelism,
        active_weights_bytes=active,
        aggregate_decode_tokens_per_s_ceiling=aggregate,
        resident_bytes=resident,
    )


# ---- sizes ---------------------------------------------------------------------------------------


def _weights_bytes(model: ModelInfo, notes: list[str]) -> int:
    if model.weights_bytes:
        notes.append("weights = the size the model's files declare")
        return model.weights_bytes
    if not model.parameters:
        notes.append("neither the weights size nor the parameter count is known")
        return 0
    if model.bits_per_weight:
        notes.append(
            f"weights = {model.parameters:,} parameters x {model.bits_per_weight} bits / 8 (from the model)"
        )
        return round(model.parameters * model.bits_per_weight / 8)
    bpw = bits_per_weight(model.quantization)
    if bpw is None and model.quantization is None and model.format in ("safetensors", "hf"):
        bpw = 16.0
        notes.append("no quantization named: assumed 16-bit (bf16/f16) weights")
    if bpw is None:
        notes.append(f"bits per weight of {model.quantization!r} unknown: weights size unknown")
        return 0
    notes.append(
        f"weights = {model.parameters:,} parameters x ~{bpw} bits / 8, the usual average for "
        f"{model.quantization or 'bf16'} (scales included; embeddings kept wider can add more)"
    )
    return round(model.parameters * bpw / 8)


def _active_weights_bytes(model: ModelInfo, weights: int, notes: list[str]) -> int:
    if not model.is_moe:
        return weights
    if model.active_parameters and model.parameters:
        notes.append(
            f"MoE: a token reads {model.active_parameters / model.parameters:.1%} of the weights "
            "(active / total parameters), all of which must still be resident"
        )
        return round(weights * model.active_parameters / model.parameters)
    notes.append("MoE without an active-parameter count: decode ceiling assumes every weight is read")
    return weights


def _kv_bytes_per_token(model: ModelInfo, dtype: str, notes: list[str]) -> int:
    try:
        dtype = kv_dtype(dtype)
    except ValueError:
        notes.append(f"unknown KV cache dtype {dtype!r}: assumed 2 bytes per element")
        dtype = "f16"
    head_dim = model.head_dim
    if head_dim is None and model.hidden_size and model.heads:
        head_dim = model.hidden_size // model.heads
        notes.append(f"head_dim assumed hidden_size / heads = {head_dim}")
    kv_heads = model.kv_heads
    if kv_heads is None and model.heads:
        kv_heads = model.heads
        notes.append("kv_heads unknown: assumed equal to heads (no grouped-query attention)")
    if model.layers is None or kv_heads is None or head_dim is None:
        notes.append("layers, KV heads or head_dim unknown: the KV cache is not counted")
        return 0
    return kv_bytes_per_token(model.layers, kv_heads, head_dim, dtype)


def _engine_kv_dtype(model: ModelInfo, engine: EngineMemory | None, asked: str) -> str:
    """The cache's element type: the workload's, or for an engine whose cache takes the weights'
    dtype, f32 for f32 weights and f16 for anything narrower (quantized weights run f16)."""
    if engine is None or not engine.kv_in_weights_dtype or asked != "f16":
        return asked
    bpw = model.bits_per_weight or bits_per_weight(model.quantization)
    return "f32" if bpw is not None and bpw >= 32 else "f16"


def _engine_kv_bytes(
    engine: EngineMemory, per_token: int, context: int, concurrency: int, hardware: Hardware
) -> int:
    """The cache the engine allocates: whole ``kv_step``s of tokens per sequence, and at least
    ``kv_min_sequences`` sequences and ``kv_floor_bytes`` (vLLM's CPU pool), at most
    ``kv_ram_share`` of the RAM available."""
    tokens = -(-context // engine.kv_step) * engine.kv_step
    kv = per_token * tokens * max(concurrency, engine.kv_min_sequences)
    kv = max(kv, engine.kv_floor_bytes)
    if engine.kv_ram_share:
        ram = hardware.ram_available_bytes or hardware.ram_total_bytes
        if ram:
            kv = max(min(kv, int(ram * engine.kv_ram_share)), per_token * tokens * concurrency)
    return kv


def _compute_bytes(model: ModelInfo, engine: EngineMemory, context: int) -> int:
    """One prefill step's working set: a chunk of prompt tokens against the whole context."""
    chunk = min(context, engine.prefill_chunk)
    heads, hidden = model.heads or 0, model.hidden_size or 0
    scores = chunk * context * (heads * engine.score_bytes + engine.mask_bytes)
    rows = chunk * 4 * (engine.row_floats_per_hidden * hidden + (model.vocab_size or 0))
    return round(scores + rows)


def _activation_bytes(model: ModelInfo, context: int, notes: list[str]) -> int:
    hidden = model.hidden_size
    if hidden is None and model.heads and model.head_dim:
        hidden = model.heads * model.head_dim
    if hidden is None:
        notes.append("hidden_size unknown: overhead counts only the fixed 512 MiB per device")
        return 0
    return ACTIVATION_BYTES * context * hidden


# ---- speed ---------------------------------------------------------------------------------------


def _step_seconds(chosen: _Attempt, read_per_step: int, resident: int, notes: list[str]) -> float | None:
    """Seconds one decode step needs to read ``read_per_step`` bytes, spread over the placements
    in proportion to what each holds of the ``resident`` weights + KV."""
    times: list[float] = []
    for p in chosen.placements:
        share = (p.weights_bytes + p.kv_bytes) / resident if resident else 1.0
        if share == 0:
            continue
        if not p.bandwidth_gbps:
            notes.append(f"bandwidth of {p.device} unknown: no decode ceiling")
            return None
        times.append(share * read_per_step / (p.bandwidth_gbps * GB))
    if not times:
        return None
    if chosen.strategy == "partial_offload":
        notes.append("partial offload: decode is dominated by the slower memory (system RAM)")
    return max(times) if chosen.parallelism == "tensor" else sum(times)
