"""The vLLM backend's load arguments, built and checked before vLLM starts: the model directory vLLM
reads (its format judged from the facts unillm already has), the ``AsyncEngineArgs`` keywords for a
config (the dtype, the parallel layout of ``_parallel``, and on the CPU build the KV space unillm
sizes), and the KV cache's bytes per token by the one formula (``unillm.backend.kv_bytes_per_token``)
that the planner uses too. vllm is never imported here."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from unillm import ConfigError, ModelFormatError, ModelNotFound, OutOfMemory
from unillm.backend import (
    Facts,
    available_ram_bytes,
    context_for,
    hf_dir_in,
    kv_bytes_per_token,
    kv_dtype,
    resolve_context,
)
from unillm.engines.vllm._draft import speculative_config
from unillm.engines.vllm._options import VLLMOptions
from unillm.engines.vllm._parallel import ParallelPlan, plan_parallel
from unillm.engines.vllm._start import weights_dtype

if TYPE_CHECKING:
    from unillm import Hardware, ModelInfo

__all__ = ["ELSEWHERE", "READS", "engine_args", "kv_bytes", "kv_cache_dtype_name", "model_dir"]

Device = Literal["cuda", "rocm", "cpu"]

#: Formats vLLM has kernels for (unquantized HF safetensors and the HF quantization methods).
READS = frozenset({"safetensors", "awq", "gptq", "fp8", "compressed-tensors", "bitsandbytes", "mxfp4"})
ELSEWHERE = {
    "gguf": "use backend='llama.cpp' for GGUF",
    "exl2": "use backend='exllamav2' for EXL2",
    "exl3": "EXL3 needs ExLlamaV3 (a plugin)",
    "mlx": "use backend='mlx' for MLX weights",
}
# Share of the RAM available at load that the CPU build's KV cache may take by default.
_CPU_KV_SHARE = 0.25
_CPU_KV_FLOOR = 256 << 20
# The cap when the RAM available is not known: vLLM's own default KV space on CPU.
_CPU_KV_UNKNOWN = 4 << 30


def model_dir(model: str, facts: Facts) -> tuple[Path, Facts]:
    """The HF model directory vLLM reads for ``model`` (a directory holding several formats side by
    side: its HF one) and the facts about that directory; a format vLLM has no kernels for is refused
    here, before vLLM is imported, with the backend that reads it.

    :raises ModelNotFound: for a path that does not exist.
    :raises ModelFormatError: for a model unillm cannot read, or one vLLM does not run.
    """
    hf = hf_dir_in(model)
    if hf is not None:
        model = str(hf)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFound(model)
    facts = facts.for_path(model)
    info = facts.model
    if info is None:
        raise ModelFormatError(
            f"{model!r} is not a model unillm can read (unillm.inspect_model says why); vLLM reads HF "
            "model directories (config.json + safetensors)"
        )
    fmt = info.format
    if fmt not in READS:
        where = ELSEWHERE.get(fmt, "")
        raise ModelFormatError(
            f"{model!r} is {fmt}; vLLM reads HF safetensors directories (unquantized, AWQ, GPTQ, "
            f"FP8, compressed-tensors, bitsandbytes, MXFP4){'; ' + where if where else ''}"
        )
    if path.is_file() or not (path / "config.json").is_file():
        raise ModelFormatError(f"{model!r} is not an HF model directory (config.json + safetensors)")
    return path, facts


#: response formats through llguidance, the compiler every built-in backend uses, in compact JSON:
#: vLLM's default grammars admit JSON's free whitespace, which a model can write for ever (random
#: weights do), and vLLM reads the switch from its engine config only (the request's
#: StructuredOutputsParams.disable_any_whitespace is not read). Schemas arrive closed by unillm's rule
#: (``unillm.backend.llguidance.closed``), which vLLM's own additional-properties switch repeats.
#: ``engine_args={"structured_outputs_config": ...}`` replaces it.
COMPACT_JSON = {"backend": "guidance", "disable_any_whitespace": True, "disable_additional_properties": True}


def engine_args(
    opts: VLLMOptions,
    *,
    path: Path,
    model: ModelInfo | None,
    hardware: Hardware | None,
    context_length: int | None,
    device: Device,
    cpu_ids: Sequence[int] | None = None,
    numa_nodes: int | None = None,
) -> tuple[dict[str, Any], ParallelPlan, list[str]]:
    """The ``AsyncEngineArgs`` keywords for ``opts`` and the engine config's ``context_length``, the
    parallel plan, and a note for each decision unillm took (the dtype, the layout).

    :param model: the model's headers (the facts), or None when unillm cannot read them.
    :param hardware: this machine (the facts): its GPUs for the parallel plan, its RAM for the CPU
        build's KV space; None when the probe failed.
    :param device: what the installed vLLM build runs on.
    :param cpu_ids: on CPU, the cores this process may run on; ``numa_nodes``: the machine's NUMA
        nodes (both for the binding of this node's ranks).
    :raises ConfigError: for options that disagree, sizes vLLM would refuse, or a ``node_rank`` above 0
        (a worker node: ``_headless.run_headless`` runs it, with node 0's arguments and its own rank).
    :raises OutOfMemory: when one sequence's KV cache does not fit the CPU build's share of RAM.
    """
    if opts.max_model_len and context_length and opts.max_model_len != context_length:
        raise ConfigError(
            f"context_length={context_length} and options max_model_len={opts.max_model_len} "
            "disagree; set only one"
        )
    if opts.node_rank > 0:
        raise ConfigError(
            f"node_rank={opts.node_rank} runs only vLLM workers, no engine: load the engine on node 0 "
            f"(node_rank=0), and start this node with `unillm serve MODEL --backend vllm --option "
            f"nnodes={opts.nnodes} --option node_rank={opts.node_rank} --option master_addr=<node 0> "
            "--headless` (docs/backends/vllm-scale-out.md)"
        )
    cpu = device == "cpu"
    parallel = plan_parallel(
        device=device,
        hardware=hardware if not cpu else None,
        model=model,
        tensor_parallel_size=opts.tensor_parallel_size,
        pipeline_parallel_size=opts.pipeline_parallel_size,
        data_parallel_size=opts.data_parallel_size,
        num_gpus=opts.num_gpus,
        distributed_executor=opts.distributed_executor,
        cpu_ids=cpu_ids if cpu else None,
        numa_nodes=numa_nodes if cpu else None,
        nnodes=opts.nnodes,
        enforce_eager=opts.enforce_eager,
    )
    dtype, why = (opts.dtype, "asked for") if opts.dtype else weights_dtype(path, model)
    notes = [f"dtype {dtype}: {why}", *parallel.notes]
    max_len = opts.max_model_len or context_length
    if max_len is None and model is not None and model.context_length:
        max_len, why_shorter = resolve_context(None, model.context_length)
        if why_shorter:
            notes.append(why_shorter)
    elif max_len is not None and model is not None:  # vLLM refuses one past the trained context
        max_len = context_for("vllm", str(path), max_len, model.context_length)
    args: dict[str, Any] = {
        "model": str(path),
        "max_model_len": max_len,
        "max_num_seqs": opts.max_num_seqs,
        "max_num_batched_tokens": opts.max_num_batched_tokens,
        "kv_cache_dtype": opts.kv_cache_dtype,
        "block_size": opts.block_size,
        "enable_prefix_caching": opts.enable_prefix_caching,
        "dtype": dtype,
        "quantization": opts.quantization,
        "enable_lora": opts.enable_lora,
        "speculative_config": speculative_config(opts, Path(path)),
        "trust_remote_code": opts.trust_remote_code,
        "disable_log_stats": True,  # unillm's own stat logger keeps the numbers; nothing printed
        **parallel.engine_args(),
    }
    if opts.nnodes > 1:
        args.update(nnodes=opts.nnodes, node_rank=opts.node_rank)
        args.update({k: v for k in ("master_addr", "master_port") if (v := getattr(opts, k)) is not None})
    if opts.enable_lora:
        args.update(max_loras=opts.max_loras, max_lora_rank=opts.max_lora_rank)
    if opts.enforce_eager is not None:
        args["enforce_eager"] = opts.enforce_eager
    if opts.seed is not None:
        args["seed"] = opts.seed
    if opts.gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = opts.gpu_memory_utilization
    kv_space = opts.kv_cache_memory_bytes
    if kv_space is None and cpu and opts.gpu_memory_utilization is None:
        bpt = kv_bytes(model, opts.kv_cache_dtype, dtype)
        kv_space = _cpu_kv_bytes(bpt, max_len or (model.context_length if model else None), hardware)
    if kv_space is not None:
        args["kv_cache_memory_bytes"] = kv_space
    args = {k: v for k, v in args.items() if v is not None}
    clash = sorted(set(opts.engine_args) & set(args))
    if clash:
        raise ConfigError(
            f"engine_args sets {', '.join(clash)}, which unillm sets from its own options; "
            "use the options of the same meaning instead"
        )
    if "structured_outputs_config" not in opts.engine_args:
        args["structured_outputs_config"] = dict(COMPACT_JSON)
    return {**args, **opts.engine_args}, parallel, notes


def kv_bytes(model: ModelInfo | None, kv_cache_dtype: str, dtype: str | None) -> int | None:
    """The KV cache's bytes per token for ``model`` with the ``kv_cache_dtype`` option ("auto": the
    ``dtype`` the engine runs in), by the formula the planner uses; None when the model's shape or
    the element type is not known."""
    if model is None or model.layers is None or model.kv_heads is None or model.head_dim is None:
        return None
    try:
        element = kv_dtype(kv_cache_dtype, model_dtype=None if dtype in (None, "auto") else dtype)
    except ValueError:
        return None
    return kv_bytes_per_token(model.layers, model.kv_heads, model.head_dim, element)


def kv_cache_dtype_name(option: str, model_dtype: str) -> str:
    """The KV cache's dtype in vLLM's spelling (``kv_stats().dtype``): the option, or for "auto"
    the dtype the model runs in."""
    if option != "auto":
        return option
    return model_dtype.removeprefix("torch.")


def _cpu_kv_bytes(bpt: int | None, length: int | None, hardware: Hardware | None) -> int:
    """The CPU build's default KV space: room for 16 sequences of ``length`` tokens at ``bpt``
    bytes each, at most a quarter of the RAM available (the facts' machine), never less than one
    full sequence (else OutOfMemory)."""
    available = (hardware.ram_available_bytes or hardware.ram_total_bytes) if hardware is not None else None
    available = available or available_ram_bytes()
    cap = int(available * _CPU_KV_SHARE) if available else _CPU_KV_UNKNOWN
    if not bpt or not length:
        return max(min(cap, 4 << 30), _CPU_KV_FLOOR)
    one = bpt * length
    if one > cap:
        raise OutOfMemory(
            f"one sequence of {length} tokens needs {one / 2**30:.2f} GiB of KV cache, more than a "
            f"quarter of the RAM available ({cap / 2**30:.2f} GiB); lower context_length, or set "
            "kv_cache_memory_bytes explicitly"
        )
    return min(max(16 * one, _CPU_KV_FLOOR), cap)
