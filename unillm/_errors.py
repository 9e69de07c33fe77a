"""Every error a user of unillm can catch.

::

    UnillmError                      base of everything below
    ├── ConfigError (ValueError)     a config, option or sampling value is invalid
    │   ├── UnknownBackend           no backend is registered under that name
    │   ├── UnsupportedParameter     the backend cannot honour a sampling parameter (policy "strict")
    │   └── InvalidTools             tools or tool_choice cannot be used as given (.field names where)
    ├── BackendUnavailable (ImportError)  the engine is not installed or cannot use this machine
    ├── NoSuitableBackend            no registered backend can run this model here
    ├── ModelFormatError             the model file or directory is not in a format unillm can read
    ├── ModelLoadError               the engine failed to load a model it should read
    │   └── ModelNotFound (FileNotFoundError)  the model path does not exist
    ├── OutOfMemory (MemoryError)    weights or KV cache do not fit
    ├── ContextLengthExceeded (ValueError)  the prompt is longer than the loaded context
    ├── GenerationError              the engine failed while generating
    │   ├── StructuredOutputError    the output does not parse or validate under its response_format
    │   └── ToolCallParseError       a call the model had to make is not one (cut by max_tokens)
    ├── EngineClosed                 the engine was used after close() or before load()
    └── PluginError                  a plugin failed to import or register (reported, then skipped)

Every message says what to do next. Engine exceptions are translated at the backend boundary with
``raise ... from exc`` so the original stays available as ``__cause__``.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError

__all__ = [
    "BackendUnavailable",
    "ConfigError",
    "ContextLengthExceeded",
    "EngineClosed",
    "GenerationError",
    "ModelFormatError",
    "ModelLoadError",
    "ModelNotFound",
    "NoSuitableBackend",
    "OutOfMemory",
    "PluginError",
    "UnillmError",
    "UnillmWarning",
    "UnknownBackend",
    "UnsupportedParameter",
    "warn",
]


class UnillmError(Exception):
    """Base class of every error unillm raises on purpose."""


class ConfigError(UnillmError, ValueError):
    """A config value, backend option or sampling parameter is invalid."""

    #: the invalid fields, when a validation named them (``from_validation``); else empty
    fields: tuple[str, ...] = ()

    @classmethod
    def from_validation(cls, exc: ValidationError, what: str) -> ConfigError:
        """Turn a pydantic ``ValidationError`` into one readable message naming each bad field."""
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "(root)"
            if err["type"] == "extra_forbidden":
                lines.append(f"  {loc}: unknown field")
            else:
                lines.append(f"  {loc}: {err['msg']} (got {_shown(err.get('input'))})")
        error = cls(f"invalid {what}:\n" + "\n".join(lines))
        error.fields = tuple(dict.fromkeys(str(e["loc"][0]) for e in exc.errors() if e["loc"]))
        return error


def _shown(value: object, most: int = 200) -> str:
    """``repr(value)`` cut to ``most`` characters; a value too deep to repr says so."""
    try:
        text = repr(value)
    except RecursionError:
        return f"a {type(value).__name__} nested too deeply to show"
    return text if len(text) <= most else text[: most - 3] + "..."


class UnknownBackend(ConfigError):
    """No backend is registered under the requested name."""

    def __init__(self, name: str, known: Sequence[str]) -> None:
        self.name = name
        self.known = list(known)
        super().__init__(
            f"no backend named {name!r}; registered backends: {', '.join(self.known) or '(none)'}. "
            "Run `unillm backends` to list them, or install the plugin that provides it."
        )


class UnsupportedParameter(ConfigError):
    """A sampling parameter was set that the backend cannot honour (policy ``strict``)."""

    def __init__(self, backend: str, params: Sequence[str], hint: str | None = None) -> None:
        self.backend = backend
        self.params = list(params)
        super().__init__(
            f"backend {backend!r} does not support {', '.join(self.params)}. "
            + (
                hint
                or "Leave them at their defaults, or set unsupported_params='warn' or 'drop' in the "
                "engine config to ignore them."
            )
        )


class BackendUnavailable(UnillmError, ImportError):
    """The backend's engine is not installed, or cannot use this machine."""

    def __init__(self, backend: str, reason: str, install_hint: str | None = None) -> None:
        self.backend = backend
        self.reason = reason
        self.install_hint = install_hint
        msg = f"backend {backend!r} is unavailable: {reason}"
        if install_hint:
            msg += f". Install it with: {install_hint}"
        super().__init__(msg)


class NoSuitableBackend(UnillmError):
    """No registered backend can run this model on this machine; ``rejected`` says why for each."""

    def __init__(self, model: str, rejected: Sequence[tuple[str, str]]) -> None:
        self.model = model
        self.rejected = list(rejected)
        lines = "\n".join(f"  - {name}: {why}" for name, why in self.rejected) or "  (none registered)"
        super().__init__(
            f"no backend can run {model!r} here. Candidates considered:\n{lines}\n"
            "Install a backend that reads this format (see `unillm backends`), or pass backend=..."
        )


class ModelFormatError(UnillmError):
    """The model path is not a format unillm recognises, or its file is corrupt."""


class ModelLoadError(UnillmError):
    """The engine failed to load the model."""


class ModelNotFound(ModelLoadError, FileNotFoundError):
    """The model path does not exist."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(
            f"model not found: {path!r}. Pass the path of a .gguf file or of a model directory "
            "(config.json + weights); unillm never downloads weights."
        )


class OutOfMemory(UnillmError, MemoryError):
    """Weights or KV cache do not fit: try a smaller context, fewer GPU layers or a smaller quant."""


class ContextLengthExceeded(UnillmError, ValueError):
    """The prompt (plus the requested new tokens) does not fit in the loaded context window."""

    def __init__(self, prompt_tokens: int, context_length: int, max_tokens: int | None = None) -> None:
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length
        self.max_tokens = max_tokens
        super().__init__(
            f"prompt of {prompt_tokens} tokens does not fit the context window of "
            f"{context_length} tokens. Shorten the prompt or load the model with a larger "
            "context_length."
        )


class GenerationError(UnillmError):
    """The engine failed while generating."""


class EngineClosed(UnillmError):
    """The engine is not loaded: call ``load()`` (or use ``with``) first, and not after ``close()``."""


class PluginError(UnillmError):
    """A plugin failed to import or to register its backends."""

    def __init__(self, plugin: str, reason: str) -> None:
        self.plugin = plugin
        self.reason = reason
        super().__init__(
            f"plugin {plugin!r} failed and was skipped: {reason}. Reinstall or upgrade it, or "
            "uninstall it; `unillm doctor` lists plugin failures."
        )


class UnillmWarning(UserWarning):
    """Warnings unillm emits about misuse (dropped parameters, skipped plugins)."""


_PACKAGE = str(Path(__file__).resolve().parent)


def warn(message: str, category: type[Warning] = UnillmWarning) -> None:
    """``warnings.warn`` pointing at the caller's line: the first frame outside unillm, however
    deep inside unillm the warning is raised (a fixed ``stacklevel`` points at unillm itself when
    ``generate`` calls ``stream``)."""
    level, frame = 2, sys._getframe(1)  # stacklevel 2 is the frame that called warn()
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(message, category, stacklevel=level)
