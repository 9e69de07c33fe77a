"""``auto_engine`` and ``load_engine``: from a model path or a config to a loaded engine.

The choice for now routes by model format among the installed backends (the first registered
one that reads the format wins; built-ins register first). Whatever chose it, the engine's
``selection`` records the candidates, why each was or was not taken, and every fallback step.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from unillm._config import read_config
from unillm._engine import UnillmWarning
from unillm._errors import (
    BackendUnavailable,
    ModelFormatError,
    ModelLoadError,
    ModelNotFound,
    NoSuitableBackend,
    OutOfMemory,
)
from unillm._inspect import detect_format
from unillm._plugins import Registry, default_registry, normalize_name

if TYPE_CHECKING:
    from unillm._engine import Engine
    from unillm._types import EngineConfig

__all__ = ["Candidate", "Selection", "auto_engine", "load_engine"]


@dataclass(frozen=True)
class Candidate:
    """One backend the selection considered."""

    name: str
    source: str
    eligible: bool
    reasons: tuple[str, ...] = ()
    blockers: tuple[str, ...] = ()


@dataclass
class Selection:
    """What was chosen for a model, by whom, and why; ``explain()`` renders it."""

    model: str
    format: str
    backend: str
    chosen_by: Literal["config", "environment", "auto"]
    candidates: list[Candidate] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)

    def explain(self) -> str:
        """A plain-text account: the choice, then every candidate with its reasons."""
        lines = [
            f"model:   {self.model} (format: {self.format})",
            f"backend: {self.backend} (chosen by {self.chosen_by})",
            "candidates:",
        ]
        for c in self.candidates:
            mark = "+" if c.eligible else "-"
            why = "; ".join(c.reasons + c.blockers) or "no reason recorded"
            lines.append(f"  {mark} {c.name} [{c.source}]: {why}")
        if self.steps:
            lines.append("steps:")
            lines.extend(f"  {i}. {s}" for i, s in enumerate(self.steps, 1))
        return "\n".join(lines)


def auto_engine(
    model: str | os.PathLike[str],
    *,
    backend: str | None = None,
    context_length: int | None = None,
    options: Mapping[str, Any] | None = None,
    registry: Registry | None = None,
    **config: Any,
) -> Engine[Any]:
    """Open ``model`` with the most suitable installed backend and return it loaded.

    ``backend`` forces a backend; ``options`` are its load options; other keywords are
    ``EngineConfig`` fields. ``UNILLM_*`` environment variables override all of these. The
    returned engine's ``selection.explain()`` says what was chosen and why.
    """
    cfg = read_config(
        {"model": os.fspath(model)},
        backend=backend,
        context_length=context_length,
        options=dict(options) if options else None,
        **config,
    )
    return _open(cfg, registry or default_registry())


def load_engine(
    source: EngineConfig | Mapping[str, Any] | str | os.PathLike[str],
    *,
    registry: Registry | None = None,
    **overrides: Any,
) -> Engine[Any]:
    """Load the engine a config describes (an ``EngineConfig``, a dict or a TOML path)."""
    return _open(read_config(source, **overrides), registry or default_registry())


def _open(cfg: EngineConfig, registry: Registry) -> Engine[Any]:
    if cfg.backend:
        env_backend = os.environ.get("UNILLM_BACKEND", "")
        by: Literal["config", "environment", "auto"] = (
            "environment" if normalize_name(env_backend) == normalize_name(cfg.backend) else "config"
        )
        cls = registry.get(cfg.backend)
        avail = cls.available()
        if not avail.available:
            raise BackendUnavailable(cls.name, avail.reason, avail.install_hint)
        # A forced backend may read what unillm cannot detect (a plugin's own format, a model
        # name on a server): the backend itself reports a missing or unreadable model.
        try:
            fmt = detect_format(cfg.model)
        except (ModelFormatError, ModelNotFound):
            fmt = "unknown"
        order = [cls]
        selection = Selection(cfg.model, fmt, cls.name, by, _candidates(fmt, registry, cfg.model))
        if fmt != "unknown" and fmt not in cls.formats:
            note = f"{cls.name} was asked for, but it does not list {fmt} among its formats"
            warnings.warn(f"{note}; loading it anyway", UnillmWarning, stacklevel=3)
            selection.steps.append(note)
    else:
        fmt = detect_format(cfg.model)
        candidates = _candidates(fmt, registry, cfg.model)
        order = [registry.get(c.name) for c in candidates if c.eligible]
        if not order:
            raise NoSuitableBackend(cfg.model, [(c.name, "; ".join(c.blockers)) for c in candidates])
        selection = Selection(cfg.model, fmt, order[0].name, "auto", candidates)
    last_error: Exception | None = None
    for cls in order:
        engine = cls(cfg)
        engine.selection = selection
        selection.backend = cls.name
        try:
            return engine.load()
        except (OutOfMemory, ModelLoadError, BackendUnavailable) as exc:
            if isinstance(exc, FileNotFoundError) or len(order) == 1:
                raise
            selection.steps.append(f"{cls.name} failed to load: {exc}")
            last_error = exc
    assert last_error is not None
    raise last_error


@dataclass(frozen=True)
class _ModelRef:
    """What the selection knows about the model so far (full inspection comes with the selector)."""

    path: str
    format: str


def _candidates(fmt: str, registry: Registry, model: str = "") -> list[Candidate]:
    out = []
    for info in registry.backends().values():
        try:
            fit = info.cls.suitability(None, _ModelRef(model, fmt), None)
            reasons, blockers = list(fit.reasons), list(fit.blockers)
        except Exception as exc:  # a plugin's bug must not break selection
            reasons, blockers = [], [f"its suitability check failed: {exc!r}"]
        avail = info.availability()
        if avail.available:
            reasons.append(f"installed{f' ({avail.version})' if avail.version else ''}")
        else:
            hint = f"; install: {avail.install_hint}" if avail.install_hint else ""
            blockers.append(f"unavailable: {avail.reason}{hint}")
        out.append(Candidate(info.name, info.source, not blockers, tuple(reasons), tuple(blockers)))
    return out
