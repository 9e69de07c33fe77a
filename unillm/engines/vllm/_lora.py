"""LoRA on vLLM: the engine arguments the config's adapters need, and each request's
``LoRARequest`` (multi-LoRA: requests in one batch may each name another adapter).

A config whose ``lora`` is one path applies that adapter to every request, as the engines that load
one adapter do; a mapping {name: path} serves each by name to the requests whose
``SamplingParams.lora`` names it, and the base model to the rest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from unillm import ConfigError, EngineConfig, SamplingParams
from unillm.backend.lora import peft_adapter

__all__ = ["LoraRequests", "lora_engine_args"]

#: the ranks vLLM's LoRAConfig takes for max_lora_rank (vllm/config/lora.py)
_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _adapters(config: EngineConfig) -> dict[str, Path]:
    return {name: peft_adapter(path, "vllm") for name, path in config.lora_adapters().items()}


def lora_engine_args(config: EngineConfig, opts: Any, *, cpu: bool) -> dict[str, Any]:
    """``enable_lora``, ``max_loras`` and ``max_lora_rank`` for the config's adapters (none: {}).
    Options the user set larger are kept; the rank is rounded up to one vLLM takes.

    On the CPU build one slot more than the adapters is kept, never filled: its LoRA kernels
    (vllm/lora/ops/torch_ops) pick each token's adapter as ``weights[index]``, and a request
    without one has index -1, which reads the LAST slot. Measured without the spare slot: a request
    without an adapter, batched with two that had one, left the base model's greedy tokens at the
    second. The spare slot is all zeros, so index -1 adds nothing."""
    adapters = _adapters(config)
    if not adapters:
        return {}
    ranks = [int(json.loads((p / "adapter_config.json").read_text("utf-8"))["r"]) for p in adapters.values()]
    need = max(*ranks, opts.max_lora_rank)
    rank = next((r for r in _RANKS if r >= need), None)
    if rank is None:
        raise ConfigError(f"vLLM serves LoRA ranks up to {_RANKS[-1]}; an adapter has rank {max(ranks)}")
    slots = max(opts.max_loras, len(adapters) + (1 if cpu else 0))
    return {"enable_lora": True, "max_loras": slots, "max_lora_rank": rank}


class LoraRequests:
    """One ``LoRARequest`` per configured adapter (ids from 1), picked per request."""

    def __init__(self, config: EngineConfig) -> None:
        adapters = _adapters(config)
        self._names = sorted(adapters)
        self._by_name: dict[str, Any] = {}
        if adapters:
            from vllm.lora.request import LoRARequest

            for i, (name, path) in enumerate(adapters.items(), 1):
                self._by_name[name] = LoRARequest(name, i, str(path))
        # one path: every request gets it; a mapping: only the requests that name one
        self._default = self._by_name.get("default") if isinstance(config.lora, str) else None

    def for_request(self, params: SamplingParams) -> Any:
        """The ``LoRARequest`` for ``params`` (its ``lora`` name, else the config's lone adapter)."""
        if params.lora is None:
            return self._default
        found = self._by_name.get(params.lora)
        if found is None:
            have = ", ".join(repr(n) for n in self._names) or "none (the config sets no lora)"
            raise ConfigError(
                f"vllm has no LoRA adapter named {params.lora!r}; the config's lora names {have}"
            )
        return found
