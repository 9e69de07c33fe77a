"""unillm: one interface over the local LLM inference engines.

    from unillm import auto_engine

    with auto_engine("model.gguf") as engine:
        print(engine.generate("Hello", max_tokens=32).text)

Importing unillm is cheap: names load on first use and no engine is imported until a model is
loaded.
"""

from __future__ import annotations

from importlib import import_module

# `typing` alone costs ~10 ms to import: the namespace stays free of it (mypy reads this name).
TYPE_CHECKING = False

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "auto_engine": "unillm._choose._auto",
    "load_engine": "unillm._choose._auto",
    "Selection": "unillm._choose._select",
    "Candidate": "unillm._choose._select",
    "select": "unillm._choose._select",
    "Hardware": "unillm._hardware",
    "GPU": "unillm._hardware",
    "detect_hardware": "unillm._hardware",
    "load_hardware": "unillm._hardware",
    "ModelInfo": "unillm._inspect",
    "inspect_model": "unillm._choose._auto",
    "Workload": "unillm._plan._estimate",
    "Plan": "unillm._plan._estimate",
    "Placement": "unillm._plan._estimate",
    "plan": "unillm._plan._estimate",
    "read_config": "unillm._config",
    "detect_format": "unillm._inspect",
    "Engine": "unillm._contract._engine",
    "NoOptions": "unillm._contract._engine",
    "Request": "unillm._contract._engine",
    "RequestState": "unillm._contract._engine",
    "UnillmWarning": "unillm._errors",
    "backends": "unillm._choose._registry",
    "Registry": "unillm._choose._registry",
    "BackendInfo": "unillm._choose._registry",
    "hookimpl": "unillm.hookspecs",
    "SamplingParams": "unillm._types",
    "EngineConfig": "unillm._types",
    "ChatMessage": "unillm._types",
    "Chunk": "unillm._types",
    "Completion": "unillm._types",
    "Usage": "unillm._types",
    "Timings": "unillm._types",
    "KVStats": "unillm._types",
    "Embeddings": "unillm._types",
    "Ranked": "unillm._types",
    "Reranked": "unillm._types",
    "Capabilities": "unillm._types",
    "Availability": "unillm._types",
    "Suitability": "unillm._types",
    "UnillmError": "unillm._errors",
    "ConfigError": "unillm._errors",
    "UnknownBackend": "unillm._errors",
    "UnsupportedParameter": "unillm._errors",
    "BackendUnavailable": "unillm._errors",
    "NoSuitableBackend": "unillm._errors",
    "ModelFormatError": "unillm._errors",
    "ModelLoadError": "unillm._errors",
    "ModelNotFound": "unillm._errors",
    "RepoNotFound": "unillm._errors",
    "RevisionNotFound": "unillm._errors",
    "QuantNotFound": "unillm._errors",
    "NotCached": "unillm._errors",
    "GatedModel": "unillm._errors",
    "DownloadError": "unillm._errors",
    "DiskFull": "unillm._errors",
    "OutOfMemory": "unillm._errors",
    "ContextLengthExceeded": "unillm._errors",
    "GenerationError": "unillm._errors",
    "StructuredOutputError": "unillm._structured",
    "ToolCall": "unillm._types",
    "InvalidTools": "unillm._chat._tools",
    "ToolCallParseError": "unillm._chat._tools",
    "EngineClosed": "unillm._errors",
    "PluginError": "unillm._errors",
}

__all__ = [
    "Availability",
    "BackendInfo",
    "BackendUnavailable",
    "Candidate",
    "Capabilities",
    "ChatMessage",
    "Chunk",
    "Completion",
    "ConfigError",
    "ContextLengthExceeded",
    "DiskFull",
    "DownloadError",
    "Embeddings",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "GPU",
    "GatedModel",
    "GenerationError",
    "Hardware",
    "InvalidTools",
    "KVStats",
    "ModelFormatError",
    "ModelInfo",
    "ModelLoadError",
    "ModelNotFound",
    "NoOptions",
    "NoSuitableBackend",
    "NotCached",
    "OutOfMemory",
    "Placement",
    "Plan",
    "PluginError",
    "QuantNotFound",
    "Ranked",
    "Reranked",
    "Registry",
    "RepoNotFound",
    "Request",
    "RequestState",
    "RevisionNotFound",
    "SamplingParams",
    "Selection",
    "StructuredOutputError",
    "Suitability",
    "Timings",
    "ToolCall",
    "ToolCallParseError",
    "UnillmError",
    "UnillmWarning",
    "UnknownBackend",
    "UnsupportedParameter",
    "Usage",
    "Workload",
    "auto_engine",
    "backends",
    "detect_format",
    "detect_hardware",
    "hookimpl",
    "inspect_model",
    "load_engine",
    "load_hardware",
    "plan",
    "read_config",
    "select",
]

if TYPE_CHECKING:
    from typing import Any

    from unillm._chat._tools import InvalidTools, ToolCallParseError
    from unillm._choose._auto import auto_engine, inspect_model, load_engine
    from unillm._choose._registry import BackendInfo, Registry, backends
    from unillm._choose._select import Candidate, Selection, select
    from unillm._config import read_config
    from unillm._contract._engine import Engine, NoOptions, Request, RequestState
    from unillm._errors import (
        BackendUnavailable,
        ConfigError,
        ContextLengthExceeded,
        DiskFull,
        DownloadError,
        EngineClosed,
        GatedModel,
        GenerationError,
        ModelFormatError,
        ModelLoadError,
        ModelNotFound,
        NoSuitableBackend,
        NotCached,
        OutOfMemory,
        PluginError,
        QuantNotFound,
        RepoNotFound,
        RevisionNotFound,
        UnillmError,
        UnillmWarning,
        UnknownBackend,
        UnsupportedParameter,
    )
    from unillm._hardware import GPU, Hardware, detect_hardware, load_hardware
    from unillm._inspect import ModelInfo, detect_format
    from unillm._plan._estimate import Placement, Plan, Workload, plan
    from unillm._structured import StructuredOutputError
    from unillm._types import (
        Availability,
        Capabilities,
        ChatMessage,
        Chunk,
        Completion,
        EngineConfig,
        KVStats,
        SamplingParams,
        Suitability,
        Timings,
        ToolCall,
        Usage,
    )
    from unillm.hookspecs import hookimpl


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'unillm' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return [*globals(), *_LAZY]
