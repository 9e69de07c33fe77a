"""The kit for writing a backend: everything the built-in backends use, as public API.

A plugin imports from here and from ``unillm``, never from ``unillm._*`` (docs/plugins.md walks
through one). What it holds:

The contract
    ``Engine`` (subclass it), ``NoOptions``, ``Request`` (per-request bookkeeping ``_stream``
    fills in), ``RawPiece`` (what ``_stream`` yields), ``TopLogprobs`` (its logprobs with
    the alternatives; ``logprobs_from_logits`` and ``top_k_logprobs`` make them from a numpy
    row), ``Capabilities``, ``Availability``,
    ``Suitability``, ``SamplingParams``, ``EngineConfig``, ``KVStats``, ``STANDARD_SAMPLING`` (the
    sampling set a full-featured engine honours).

What the selector and ``auto_engine`` ask a backend (its class methods)
    ``Fallback`` and ``Cost``: the steps ``Engine.fallbacks`` declares for an out-of-memory load.
    ``GuideEntry``: a line of the decision guide a plugin adds (hook ``unillm_guide_entries``).
    ``EngineBuild``: what ``Engine.probe_build`` reports for ``unillm doctor``.

What a backend is told
    ``Facts``: the model (``ModelInfo``), the machine (``Hardware``) and the memory plan, computed
    once by ``auto_engine`` and handed in as ``engine.facts``.

Checks every backend makes the same way
    ``check_text``, ``check_token_ids`` (the base class applies them at its edge already),
    ``check_prompt`` (empty, or longer than the context), ``shared_prefix`` (tokens a cache can
    reuse), ``installed`` (an import-free availability check), ``gpu_present``,
    ``available_ram_bytes``.

KV cache size, one formula for every engine
    ``kv_bytes_per_token``, ``kv_dtype`` (an engine's KV type spelled the table's way),
    ``kv_bytes_per_element``, ``KV_BYTES_PER_ELEMENT``; ``tensor_parallel_ok`` (the head rule).

Batching engines
    ``StepWorker`` and ``Live``: a worker thread that owns an engine object which is not
    thread-safe and serves many callers through it (continuous batching); ``StepWorker.events``
    is the caller's side, the loop every batching ``_stream`` runs. ``host_loop()``: the event
    loop the application will consume the engine's async streams on, when the loading code said
    so (``unillm serve`` does): an asyncio-native engine may run there instead of on a loop of
    its own (the vLLM backend does), which saves a thread hop per token.
"""

from __future__ import annotations

from unillm._common import available_ram_bytes, check_prompt, gpu_present, installed, shared_prefix
from unillm._engine import Engine, NoOptions, check_text, check_token_ids
from unillm._facts import Facts
from unillm._guide import GuideEntry
from unillm._hardware import EngineBuild
from unillm._kv import KV_BYTES_PER_ELEMENT, kv_bytes_per_element, kv_bytes_per_token, kv_dtype
from unillm._logprobs import from_logits as logprobs_from_logits
from unillm._logprobs import top_k as top_k_logprobs
from unillm._loops import host_loop
from unillm._plan import tensor_parallel_ok
from unillm._run import RawPiece, Request, TopLogprobs
from unillm._types import (
    STANDARD_SAMPLING,
    Availability,
    Capabilities,
    Cost,
    EngineConfig,
    Fallback,
    KVStats,
    SamplingParams,
    Suitability,
)
from unillm._worker import Live, StepWorker

__all__ = [
    "KV_BYTES_PER_ELEMENT",
    "STANDARD_SAMPLING",
    "Availability",
    "Capabilities",
    "Cost",
    "Engine",
    "EngineBuild",
    "EngineConfig",
    "Facts",
    "Fallback",
    "GuideEntry",
    "KVStats",
    "Live",
    "NoOptions",
    "RawPiece",
    "Request",
    "SamplingParams",
    "StepWorker",
    "Suitability",
    "TopLogprobs",
    "available_ram_bytes",
    "check_prompt",
    "check_text",
    "check_token_ids",
    "gpu_present",
    "host_loop",
    "installed",
    "kv_bytes_per_element",
    "kv_bytes_per_token",
    "kv_dtype",
    "logprobs_from_logits",
    "shared_prefix",
    "tensor_parallel_ok",
    "top_k_logprobs",
]
