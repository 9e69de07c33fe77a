"""The vLLM backend's load options: ``AsyncEngineArgs`` under unillm's names, validated before
vLLM is imported."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["VLLMOptions"]


class VLLMOptions(BaseModel):
    """Load options of the vLLM backend (``AsyncEngineArgs`` under unillm's names)."""

    model_config = ConfigDict(extra="forbid")

    max_model_len: int | None = Field(
        default=None,
        ge=16,
        description="Longest sequence; default: context_length, else the model's trained one.",
    )
    max_num_seqs: int | None = Field(
        default=None, ge=1, description="Most sequences in one batch (vLLM's default)."
    )
    max_num_batched_tokens: int | None = Field(default=None, ge=16, description="Token budget of one step.")
    gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="Share of GPU memory vLLM may take (weights + KV); on the CPU build, the share of "
        "RAM. Default: vLLM's on a GPU; on the CPU build unillm sizes the KV cache itself "
        "(kv_cache_memory_bytes).",
    )
    kv_cache_memory_bytes: int | None = Field(
        default=None,
        ge=1 << 20,
        description="KV cache size in bytes (the CPU build's KV space; on a GPU it overrides "
        "gpu_memory_utilization). CPU default: room for 16 full sequences, at most 25% of the RAM "
        "available at load.",
    )
    kv_cache_dtype: Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        default="auto", description="KV cache precision; auto follows the model's dtype."
    )
    block_size: int | None = Field(default=None, ge=1, description="Tokens per KV block (vLLM's default).")
    enable_prefix_caching: bool = Field(
        default=True, description="Reuse the KV blocks of shared prompt prefixes."
    )
    enforce_eager: bool | None = Field(
        default=None, description="Skip torch.compile and CUDA graphs: faster start, slower steps."
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] | None = Field(
        default=None,
        description="Weights and activations dtype. Default: the weights' own (config.json's "
        "torch_dtype); auto: vLLM's choice (bf16 for f32 weights on most CPUs and GPUs).",
    )
    quantization: str | None = Field(
        default=None, description="Quantization method; default: read from the model."
    )
    tensor_parallel_size: int | None = Field(default=None, ge=1, description="GPUs each layer is split over.")
    pipeline_parallel_size: int | None = Field(
        default=None, ge=1, description="Stages the layers are cut into."
    )
    data_parallel_size: int = Field(default=1, ge=1, description="Replicas of the model serving in parallel.")
    num_gpus: int | None = Field(
        default=None,
        ge=1,
        description="Spread the model over this many GPUs; unillm picks tensor or pipeline.",
    )
    distributed_executor: Literal["mp", "ray"] | None = Field(
        default=None, description="mp: processes on this machine; ray: a Ray cluster (several machines)."
    )
    nnodes: int = Field(
        default=1,
        ge=1,
        description="Machines (nodes) the model spans by vLLM's own multi-node path, without Ray: node "
        "0 loads the engine, the others run `unillm serve --headless` (docs/backends/vllm-scale-out.md).",
    )
    node_rank: int = Field(
        default=0, ge=0, description="This node's index, 0 to nnodes-1: 0 serves, the others are headless."
    )
    master_addr: str | None = Field(
        default=None,
        min_length=1,
        description="The address of node 0 that the other nodes reach (vLLM's default: 127.0.0.1).",
    )
    master_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="The port on node 0 the nodes' ranks meet at (vLLM's default: 29501).",
    )
    enable_lora: bool = Field(default=False, description="Allow LoRA adapters.")
    max_loras: int = Field(default=1, ge=1, description="LoRA adapters in one batch.")
    max_lora_rank: int = Field(default=16, ge=1, description="Largest LoRA rank.")
    speculative_config: dict[str, Any] | None = Field(
        default=None, description="vLLM's speculative decoding config, passed through."
    )
    draft_model: str | None = Field(
        default=None, description="Speculative decoding: a draft model directory (method draft_model)."
    )
    num_draft_tokens: int | None = Field(default=None, ge=1, description="Tokens drafted per step (4).")
    seed: int | None = Field(default=None, description="The engine's seed (vLLM's default 0).")
    trust_remote_code: bool = Field(default=False, description="Run model code shipped with the weights.")
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="Any other AsyncEngineArgs field, passed through as given."
    )

    @model_validator(mode="after")
    def _node_rank_below_nnodes(self) -> VLLMOptions:
        if self.node_rank >= self.nnodes:
            raise ValueError(
                f"node_rank={self.node_rank} with nnodes={self.nnodes}: the nodes are numbered 0 to "
                f"{self.nnodes - 1}; give each machine its own node_rank below nnodes (0 on the one that "
                "serves)"
            )
        return self
