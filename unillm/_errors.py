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
    │   ├── ModelNotFound (FileNotFoundError)  the model path does not exist
    │   │   ├── RepoNotFound         no such repo on the hub (or a private one, without a token for it)
    │   │   ├── RevisionNotFound     the repo has no such branch, tag or commit
    │   │   ├── QuantNotFound        the repo has no GGUF of that quantization (.tags: those it has)
    │   │   └── NotCached            offline (or the hub unreachable) and the name is not in the cache
    │   └── GatedModel               the repo is gated: accept its terms on the hub, then set HF_TOKEN
    ├── OutOfMemory (MemoryError)    weights or KV cache do not fit
    ├── ContextLengthExceeded (ValueError)  the prompt is longer than the loaded context
    ├── GenerationError              the engine failed while generating
    │   ├── StructuredOutputError    the output does not parse or validate under its response_format
    │   └── ToolCallParseError       a call the model had to make is not one (cut by max_tokens)
    ├── DownloadError                a download failed (network, cut off: run again to resume; checksum)
    │   └── DiskFull (OSError)       no room for the download on the cache's disk
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
    "DiskFull",
    "DownloadError",
    "EngineClosed",
    "GatedModel",
    "GenerationError",
    "ModelFormatError",
    "ModelLoadError",
    "ModelNotFound",
    "NoSuitableBackend",
    "NotCached",
    "OutOfMemory",
    "PluginError",
    "QuantNotFound",
    "RepoNotFound",
    "RevisionNotFound",
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
            "(config.json + weights), or a Hugging Face name (org/name, org/name:Q4_K_M), which "
            "is downloaded; a path is never looked up on the hub, so unillm never downloads weights "
            "for one."
        )


class RepoNotFound(ModelNotFound):
    """No repo of that name on the hub, or a private one and no token that may read it."""

    def __init__(self, repo: str, endpoint: str = "https://huggingface.co") -> None:
        self.path = self.repo = repo
        ModelLoadError.__init__(
            self,
            f"no model {repo!r} on {endpoint}, nor a file or directory of that name here. Check the "
            "spelling (org/name); a private repo needs a token that may read it: set HF_TOKEN or run "
            "`hf auth login`.",
        )


class RevisionNotFound(ModelNotFound):
    """The repo has no branch, tag or commit of that name."""

    def __init__(self, repo: str, revision: str) -> None:
        self.path, self.repo, self.revision = f"{repo}@{revision}", repo, revision
        ModelLoadError.__init__(
            self,
            f"{repo!r} has no revision {revision!r}: name a branch, a tag or a commit of it "
            f"(org/name@main), or leave @revision out for its default branch.",
        )


class QuantNotFound(ModelNotFound):
    """The repo has no GGUF file of the quantization asked for; ``tags`` are the ones it has."""

    def __init__(self, repo: str, tag: str, tags: Sequence[str]) -> None:
        self.path, self.repo, self.tag, self.tags = f"{repo}:{tag}", repo, tag, list(tags)
        have = ", ".join(self.tags) if self.tags else "none: it holds no GGUF file"
        ModelLoadError.__init__(
            self,
            f"{repo!r} has no {tag} file. Its quantizations: {have}. Name one ({repo}:{self.tags[0]}) "
            f"or leave the tag out to get the one that fits this machine."
            if self.tags
            else f"{repo!r} has no {tag} file. Its quantizations: {have}; leave the tag out.",
        )


class NotCached(ModelNotFound):
    """Offline (``HF_HUB_OFFLINE=1``), or the hub cannot be reached, and the name is not in the
    local Hugging Face cache."""

    def __init__(self, name: str, cache_dir: str, why: str = "HF_HUB_OFFLINE is set") -> None:
        self.path, self.cache_dir = name, cache_dir
        ModelLoadError.__init__(
            self,
            f"{name!r} is not in the Hugging Face cache ({cache_dir}) and {why}, so nothing is "
            f"downloaded. When online, run `unillm pull {name}`"
            + (" (with HF_HUB_OFFLINE unset)" if "OFFLINE" in why else "")
            + "; if you meant a local path, nothing is there.",
        )


class GatedModel(ModelLoadError):
    """The repo is gated: its terms must be accepted on the hub, and a token sent."""

    def __init__(self, repo: str, endpoint: str = "https://huggingface.co") -> None:
        self.repo = repo
        super().__init__(
            f"{repo!r} is gated: accept its terms at {endpoint}/{repo} with your account, then "
            "set HF_TOKEN to a token of that account (or run `hf auth login`) and retry."
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


class DownloadError(UnillmError):
    """A download failed: the hub could not be reached, the transfer was cut off (what arrived is
    kept: run the same command again to resume) or a file does not match its checksum."""


class DiskFull(DownloadError, OSError):
    """No room on the cache's disk for the download."""

    def __init__(self, what: str, need: int, free: int, where: str) -> None:
        self.need, self.free, self.where = need, free, where
        DownloadError.__init__(
            self,
            f"{what} needs {need / 2**30:.2f} GiB more but {where} has {free / 2**30:.2f} GiB free: "
            "free some space (`unillm models` lists what is cached, `unillm rm MODEL` removes it) "
            "or point HF_HUB_CACHE at a larger disk.",
        )


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
