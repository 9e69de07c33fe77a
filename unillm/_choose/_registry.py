"""Backend discovery: the built-ins plus every plugin in the ``unillm`` entry-point group.

A ``Registry`` owns one pluggy ``PluginManager``. Plugins are loaded one at a time and each hook
implementation is called on its own, so a plugin that fails to import or to register is recorded
in ``Registry.failures``, reported with a ``UnillmWarning`` and skipped; the others keep working.
Nothing here imports an engine: backends are registered as classes from cheap modules.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from functools import partial
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pluggy

from unillm import hookspecs
from unillm._choose._guide import GUIDE, GuideEntry
from unillm._errors import ConfigError, PluginError, UnknownBackend, warn
from unillm._types import normalize_name

if TYPE_CHECKING:
    from pathlib import Path

    from unillm._contract._engine import Engine
    from unillm._inspect import ModelInfo
    from unillm._types import Availability, Capabilities

__all__ = [
    "BackendInfo",
    "PluginFailure",
    "PluginInfo",
    "Registry",
    "backends",
    "default_registry",
    "normalize_name",
]

ENTRY_POINT_GROUP = "unillm"
BUILTIN = "builtin"
#: the module holding the built-in engines' hook, loaded like a plugin's entry point
BUILTIN_MODULE = "unillm.engines"


@dataclass(frozen=True)
class BackendInfo:
    """A registered backend: its class and where it came from (``"builtin"`` or the plugin)."""

    name: str
    cls: type[Engine]
    source: str

    def availability(self) -> Availability:
        """Whether it can run here; a backend whose check crashes is reported unavailable."""
        from unillm._types import Availability

        try:
            return self.cls.available()
        except Exception as exc:
            return Availability(False, f"its availability check failed: {exc!r}")

    def capabilities(self) -> Capabilities:
        """What it does loaded with its default options (``capabilities_for``: MLX batches by
        default); what its class declares when its options have no defaults (a plugin's)."""
        try:
            return self.cls.capabilities_for(self.cls.Options())
        except Exception:
            return self.cls.capabilities


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that was skipped, and why."""

    plugin: str
    reason: str


@dataclass(frozen=True)
class PluginInfo:
    """An installed plugin: its entry point, the distribution that installed it, what it reaches
    (the backends it registered, the guide entries it added) and, if it failed, why."""

    name: str
    value: str  # the module the entry point names
    distribution: str | None
    version: str | None
    backends: tuple[str, ...]
    guide_entries: int
    failures: tuple[str, ...]


class Registry:
    """The backends known to one plugin manager. Tests make their own; apps use the default."""

    def __init__(self, *, builtins: bool = True, entry_points: bool = True) -> None:
        self.pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.failures: list[PluginFailure] = []
        self._backends: dict[str, BackendInfo] = {}
        self._guide: list[GuideEntry] = []
        self._collected: set[str] = set()
        self._guided: set[str] = set()
        self._entry_points: dict[str, tuple[str, str | None, str | None]] = {}
        self._guide_counts: dict[str, int] = {}
        if builtins:
            # by name, as an entry point names a plugin: the engines sit above this layer
            self.pm.register(importlib.import_module(BUILTIN_MODULE), name=BUILTIN)
        if entry_points:
            self._load_entry_points()
        self._collect()

    # ---- loading ----

    def _load_entry_points(self) -> None:
        seen: set[tuple[str, str]] = set()
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if (ep.name, ep.value) in seen:
                continue
            seen.add((ep.name, ep.value))
            dist = getattr(ep, "dist", None)
            meta = (dist.metadata["Name"], dist.version) if dist is not None else (None, None)
            self._entry_points[ep.name] = (ep.value, *meta)
            try:
                plugin = ep.load()
                self.pm.register(plugin, name=ep.name)
            except Exception as exc:
                self._fail(ep.name, f"import of {ep.value!r} failed: {exc!r}")

    def register_plugin(self, plugin: ModuleType | object, name: str | None = None) -> None:
        """Register a plugin object (a module or any object with hook implementations)."""
        try:
            self.pm.register(plugin, name=name)
        except Exception as exc:
            self._fail(name or repr(plugin), f"registration failed: {exc!r}")
            return
        self._collect()

    def register_backend(self, cls: type[Engine], source: str = "direct") -> None:
        """Register one backend class directly (tests, notebooks)."""
        self._add(cls, source=source, strict=True)

    def _collect(self) -> None:
        # in registration order, so built-ins claim their names first
        for impl in self.pm.hook.unillm_register_backends.get_hookimpls():
            if impl.plugin_name in self._collected:
                continue
            self._collected.add(impl.plugin_name)
            try:
                impl.function(register=partial(self._add, source=impl.plugin_name))
            except Exception as exc:
                self._fail(impl.plugin_name, f"unillm_register_backends raised {exc!r}")
        for impl in self.pm.hook.unillm_guide_entries.get_hookimpls():
            if impl.plugin_name in self._guided:
                continue
            self._guided.add(impl.plugin_name)
            added: list[GuideEntry] = []
            try:
                impl.function(add=partial(self._add_entry, added, source=impl.plugin_name))
            except Exception as exc:
                self._fail(impl.plugin_name, f"unillm_guide_entries raised {exc!r}")
                continue  # all of a failing plugin's entries or none
            self._guide.extend(added)
            self._guide_counts[impl.plugin_name] = len(added)

    def _add_entry(self, into: list[GuideEntry], entry: Any, *, source: str) -> None:
        if isinstance(entry, GuideEntry) and isinstance(entry.engine, str) and entry.engine:
            into.append(entry)
        else:
            self._fail(source, f"add() takes a unillm.backend.GuideEntry with an engine name, got {entry!r}")

    def _add(self, cls: Any, *, source: str, strict: bool = False) -> None:
        from unillm._contract._engine import Engine

        problem = None
        if not (isinstance(cls, type) and issubclass(cls, Engine)):
            problem = f"register() takes an Engine subclass, got {cls!r}"
        elif not cls.name:
            problem = f"{cls.__name__} has no `name`"
        elif normalize_name(cls.name) == "ollama":
            problem = "unillm does not wrap Ollama (see docs/concepts.md)"
        elif normalize_name(cls.name) in self._backends:
            have = self._backends[normalize_name(cls.name)]
            problem = f"backend name {cls.name!r} is already registered by {have.source}"
        if problem is None:
            self._backends[normalize_name(cls.name)] = BackendInfo(cls.name, cls, source)
        elif strict:
            raise ConfigError(problem)
        else:
            self._fail(source, problem)

    def _fail(self, plugin: str, reason: str) -> None:
        failure = PluginFailure(plugin, reason)
        self.failures.append(failure)

        warn(str(PluginError(plugin, reason)))

    # ---- queries ----

    def guide(self) -> tuple[GuideEntry, ...]:
        """The decision guide: the built-in table, then the plugins' entries, in order."""
        return (*GUIDE, *self._guide)

    def inspect_model(self, path: str | Path) -> ModelInfo:
        """``path`` inspected: by the first plugin that recognizes it (``unillm_inspect_model``),
        else by unillm's own inspection (``unillm.inspect_model``, and what it raises)."""
        from unillm._inspect import ModelInfo, inspect_model

        for impl in self.pm.hook.unillm_inspect_model.get_hookimpls():  # registration order
            try:
                info = impl.function(path=str(path))
            except Exception as exc:
                self._fail(impl.plugin_name, f"unillm_inspect_model({str(path)!r}) raised {exc!r}")
                continue
            if isinstance(info, ModelInfo):
                return info
            if info is not None:
                self._fail(impl.plugin_name, f"unillm_inspect_model returned {info!r}, not a ModelInfo")
        return inspect_model(path)

    def plugins(self) -> list[PluginInfo]:
        """Every plugin found through the entry-point group, loaded or failed, in discovery order."""
        out = []
        for name, (value, dist, version) in self._entry_points.items():
            out.append(
                PluginInfo(
                    name,
                    value,
                    dist,
                    version,
                    tuple(i.name for i in self._backends.values() if i.source == name),
                    self._guide_counts.get(name, 0),
                    tuple(f.reason for f in self.failures if f.plugin == name),
                )
            )
        return out

    def names(self) -> list[str]:
        return [info.name for info in self._backends.values()]

    def backends(self) -> dict[str, BackendInfo]:
        """Every registered backend by name, in registration order (built-ins first)."""
        return {info.name: info for info in self._backends.values()}

    def get(self, name: str) -> type[Engine]:
        """The backend class registered as ``name`` (any spelling ``normalize_name`` accepts)."""
        key = normalize_name(name)
        if key == "ollama":
            raise ConfigError(
                "unillm does not wrap Ollama: it hides the engine's settings and is not a serving "
                "engine. Use backend='llama.cpp' for GGUF models."
            )
        try:
            return self._backends[key].cls
        except KeyError:
            raise UnknownBackend(name, self.names()) from None


_default: Registry | None = None


def default_registry(*, refresh: bool = False) -> Registry:
    """The process-wide registry, built on first use (plugins are loaded once)."""
    global _default  # noqa: PLW0603 - one lazily built registry per process
    if _default is None or refresh:
        _default = Registry()
    return _default


def backends(*, refresh: bool = False) -> dict[str, BackendInfo]:
    """Every registered backend, built-in or plugin, by name. ``info.availability()`` says
    whether it can run on this machine."""
    return default_registry(refresh=refresh).backends()
