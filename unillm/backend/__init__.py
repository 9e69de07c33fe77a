"""The kit for writing a backend: everything the built-in backends use, as public API.

A plugin imports from here and from ``unillm``, never from ``unillm._*`` (docs/plugins.md walks
through one). The built-in engines (``unillm/engines/<name>/``) import the core through nothing
else, so they prove the kit suffices (tests/test_architecture.py holds them to it). What it holds:

The contract
    ``Engine`` (subclass it), ``NoOptions``, ``RequestState`` (per-request bookkeeping ``_stream``
    fills in; ``Request``, its first name, still imports), ``RawPiece`` (what ``_stream``
    yields), ``TopLogprobs`` (its logprobs with the alternatives; ``logprobs_from_logits``,
    ``logprobs_from_logprobs`` and ``top_k_logprobs`` make them from a numpy row),
    ``Capabilities``, ``Availability``, ``Suitability``, ``SamplingParams``, ``EngineConfig``,
    ``POOLINGS``, ``task_for`` and ``pooling_for`` (what an embedding backend loads for and how it
    pools: the config's word, else the model's), ``GGUF_POOLING`` (llama.cpp's pooling numbers),
    ``KVStats``, ``STANDARD_SAMPLING`` (the sampling set a full-featured engine honours).

What the selector and ``auto_engine`` ask a backend (its class methods)
    ``Fallback`` and ``Cost``: the steps ``Engine.fallbacks`` declares for an out-of-memory load.
    ``GuideEntry``: a line of the decision guide a plugin adds (hook ``unillm_guide_entries``).
    ``EngineBuild``: what ``Engine.probe_build`` reports for ``unillm doctor``.

What a backend is told
    ``Facts``: the model (``ModelInfo``), the machine (``Hardware``) and the memory plan, computed
    once by ``auto_engine`` and handed in as ``engine.facts``.

Checks every backend makes the same way
    ``check_text``, ``check_token_ids`` (the base class applies them at its edge already),
    ``check_prompt`` (empty, or longer than the context), ``resolve_context`` (the context an
    engine loads with when none is asked for: one rule, ``DEFAULT_CONTEXT``), ``context_for`` (that
    rule, and a context past the model's trained one reduced to it with a warning), ``shared_prefix``
    (tokens a cache can reuse), ``installed`` (an import-free availability check), ``gpu_present``,
    ``available_ram_bytes``.

KV cache size, one formula for every engine
    ``kv_bytes_per_token``, ``kv_dtype`` (an engine's KV type spelled the table's way),
    ``kv_bytes_per_element``, ``KV_BYTES_PER_ELEMENT``; ``tensor_parallel_ok`` (the head rule).

The model's files, read the same way by every engine
    ``hf_dir_in``, ``gguf_in`` (the Hugging Face directory or GGUF file a path names, or None),
    ``exists``, ``is_dir``, ``is_file`` (that never raise on an unreadable path), ``GGUFHeader``;
    ``eos_from_hf_dir``, ``eos_from_gguf_metadata`` (the model's declared end-of-sequence set);
    ``hf_chat_template``, ``gguf_chat_template`` (the model's chat template, one rule);
    ``check_chat_template`` (a model's template compiled in the sandbox at load),
    ``compile_error``, ``compile_error_types``, ``template_message``, ``template_takes_tools``;
    ``no_chat_template``, ``tools_not_rendered`` (the refusals every backend words alike);
    ``Messages``, ``Tools`` (a chat request's shapes) and ``read_tools``.

Structured output, LoRA, builds
    ``OutputFormat`` and ``unenforced`` (schema keywords a plugin's own grammar would not enforce);
    ``llguidance``, the one constraint compiler of the built-ins (``check``: refused in one wording;
    ``closed``: unillm's additional-properties rule; ``grammar``; ``Guide``: matchers over an
    engine's tokenizer; ``allowed``: a matcher's mask); ``lora``
    (``one_adapter``, ``peft_adapter``, ``peft_config``); ``builds`` (``package_dir``,
    ``dist_version``, ``gpu_vendors``: what ``probe_build`` needs without importing the engine);
    ``EngineMemory``, the memory model a backend declares for the planner; ``warn`` (a
    ``UnillmWarning`` pointing at the user's line).

Batching engines
    ``StepWorker`` and ``Live``: a worker thread that owns an engine object which is not
    thread-safe and serves many callers through it (continuous batching); ``StepWorker.events``
    is the caller's side, the loop every batching ``_stream`` runs (``asubmit``/``aevents`` for an
    async caller: no thread of its own); ``Mailbox``/``Mailboxes``: a thread's hand-over to an
    event loop, one wake-up per step for all the loop's requests. ``host_loop()``: the event
    loop the application will consume the engine's async streams on, when the loading code said
    so (``unillm serve`` does): an asyncio-native engine may run there instead of on a loop of
    its own (the vLLM backend does), which saves a thread hop per token.
"""

from __future__ import annotations

from unillm._chat._template import (
    check_chat_template,
    compile_error,
    compile_error_types,
    no_chat_template,
    template_message,
    template_takes_tools,
    tools_not_rendered,
)
from unillm._chat._tools import read_tools
from unillm._choose._guide import GuideEntry
from unillm._contract._checks import check_prompt, installed, shared_prefix
from unillm._contract._context import DEFAULT_CONTEXT, context_for, resolve_context
from unillm._contract._embed import POOLINGS, pooling_for, task_for
from unillm._contract._engine import Engine, Messages, NoOptions, Tools, check_text, check_token_ids
from unillm._contract._facts import Facts
from unillm._contract._logprobs import from_logits as logprobs_from_logits
from unillm._contract._logprobs import from_logprobs as logprobs_from_logprobs
from unillm._contract._logprobs import top_k as top_k_logprobs
from unillm._contract._loops import host_loop
from unillm._contract._run import RawPiece, Request, RequestState, TopLogprobs
from unillm._contract._tokens import hf_token_bytes
from unillm._contract._worker import Live, Mailbox, Mailboxes, StepWorker
from unillm._errors import warn
from unillm._hardware import EngineBuild
from unillm._hardware._quick import available_ram_bytes, gpu_present
from unillm._inspect import GGUFHeader
from unillm._inspect._chat_template import gguf_chat_template, hf_chat_template
from unillm._inspect._eos import eos_from_gguf_metadata, eos_from_hf_dir
from unillm._inspect._kv import KV_BYTES_PER_ELEMENT, kv_bytes_per_element, kv_bytes_per_token, kv_dtype
from unillm._inspect._paths import exists, gguf_in, hf_dir_in, is_dir, is_file
from unillm._inspect._pooling import GGUF_POOLING
from unillm._plan._estimate import EngineMemory
from unillm._plan._placement import tensor_parallel_ok
from unillm._structured import OutputFormat, unenforced
from unillm._types import (
    STANDARD_SAMPLING,
    Availability,
    Capabilities,
    Cost,
    EngineConfig,
    Fallback,
    KVStats,
    Pooling,
    SamplingParams,
    Suitability,
)
from unillm.backend import builds, llguidance, lora

__all__ = [
    "DEFAULT_CONTEXT",
    "GGUF_POOLING",
    "KV_BYTES_PER_ELEMENT",
    "POOLINGS",
    "Pooling",
    "STANDARD_SAMPLING",
    "Availability",
    "Capabilities",
    "Cost",
    "Engine",
    "EngineBuild",
    "EngineConfig",
    "EngineMemory",
    "Facts",
    "Fallback",
    "GGUFHeader",
    "GuideEntry",
    "KVStats",
    "Live",
    "Mailbox",
    "Mailboxes",
    "Messages",
    "NoOptions",
    "OutputFormat",
    "RawPiece",
    "Request",
    "RequestState",
    "SamplingParams",
    "StepWorker",
    "Suitability",
    "Tools",
    "TopLogprobs",
    "available_ram_bytes",
    "builds",
    "check_chat_template",
    "check_prompt",
    "check_text",
    "check_token_ids",
    "compile_error",
    "compile_error_types",
    "eos_from_gguf_metadata",
    "eos_from_hf_dir",
    "exists",
    "gguf_chat_template",
    "gguf_in",
    "gpu_present",
    "hf_chat_template",
    "hf_token_bytes",
    "hf_dir_in",
    "host_loop",
    "installed",
    "is_dir",
    "is_file",
    "kv_bytes_per_element",
    "kv_bytes_per_token",
    "kv_dtype",
    "llguidance",
    "logprobs_from_logits",
    "logprobs_from_logprobs",
    "lora",
    "pooling_for",
    "read_tools",
    "resolve_context",
    "context_for",
    "shared_prefix",
    "template_message",
    "template_takes_tools",
    "no_chat_template",
    "tools_not_rendered",
    "task_for",
    "tensor_parallel_ok",
    "top_k_logprobs",
    "unenforced",
    "warn",
]
