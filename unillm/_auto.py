"""``auto_engine`` and ``load_engine``: from a model path or a config to a loaded engine.

The choice for now routes by model format among the installed backends (the first registered
one that reads the format wins; built-ins register first). Whatever chose it, the engine's
``selection`` records the candidates, why each was or was not taken, and every fallback step.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from unillm._config import read_config
from unillm._errors import (
    BackendUnavailable,
    ModelFormatError,
    ModelLoadError,
    ModelNotFound,
    NoSuitableBackend,
    OutOfMemory,
    warn,
)
from unillm._hardware import Hardware, detect_hardware
from unillm._inspect import ModelInfo, inspect_model
from unillm._model_path import model_formats
from unillm._plan import Plan, Workload, plan
from unillm._plugins import Registry, default_registry, normalize_name
from unillm._select import Candidate, Selection, select

if TYPE_CHECKING:
    from unillm._engine import Engine
    from unillm._types import EngineConfig

__all__ = ["Candidate", "Selection", "auto_engine", "load_engine"]


def auto_engine(
    model: str | os.PathLike[str],
    *,
    backend: str | None = None,
    context_length: int | None = None,
    concurrency: int | None = None,
    goal: str | None = None,
    options: Mapping[str, Any] | None = None,
    registry: Registry | None = None,
    **config: Any,
) -> Engine[Any]:
    """Open ``model`` with the most suitable installed backend and return it loaded.

    ``backend`` forces a backend; ``concurrency`` (requests at once) and ``goal`` (``latency``,
    ``throughput``, ``cost``, ``portability``) describe the workload the selector chooses for;
    ``options`` are the backend's load options; other keywords are ``EngineConfig`` fields.
    ``UNILLM_*`` environment variables override all of these. The returned engine's
    ``selection.explain()`` says what was chosen, for which workload, and why.

    ``model`` is a GGUF file, an HF model directory, or a directory holding both side by side
    (each backend reads the one it can).
    """
    cfg = read_config(
        {"model": os.fspath(model)},
        backend=backend,
        context_length=context_length,
        concurrency=concurrency,
        goal=goal,
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
    backends = registry.backends()
    available = {name: info.availability() for name, info in backends.items()}
    hardware = _machine()
    if cfg.backend:
        env_backend = os.environ.get("UNILLM_BACKEND", "")
        by: Literal["config", "environment", "auto"] = (
            "environment" if normalize_name(env_backend) == normalize_name(cfg.backend) else "config"
        )
        cls = registry.get(cfg.backend)
        avail = available.get(cls.name) or cls.available()
        if not avail.available:
            raise BackendUnavailable(cls.name, avail.reason, avail.install_hint)
        # A forced backend may read what unillm cannot inspect (a plugin's own format, a model
        # name on a server): the backend itself reports a missing or unreadable model.
        try:
            model: Any = inspect_model(cfg.model)
        except (ModelFormatError, ModelNotFound):
            model = _ModelRef(cfg.model, "unknown")
        workload = _workload(cfg, model)
        the_plan = _plan(model, hardware, workload)
        selection = select(
            hardware, model, workload, backends, available=available, plan=the_plan, requested=cls.name
        )
        selection.chosen_by = by
        order = [cls]
        mine = next((c for c in selection.candidates if c.name == cls.name), None)
        problems = list(mine.blockers) if mine else []
        if model.format == "unknown":  # unillm cannot tell: the backend will
            problems = [p for p in problems if "does not read" not in p]
        if problems:
            note = f"{cls.name} was asked for, but the selector sees a problem: {'; '.join(problems)}"
            warn(f"{note}; loading it anyway")
            selection.steps.append(note)
    else:
        # One selection per format the model is held in (a directory may hold an HF directory and
        # a GGUF of the same weights): each backend is ranked on the format it reads.
        per_format = []
        for info in _inspect_all(cfg.model):
            wl = _workload(cfg, info)
            pl = _plan(info, hardware, wl)
            sel = select(hardware, info, wl, backends, available=available, plan=pl)
            per_format.append((sel, info, wl, pl))
        serving = (cfg.concurrency or 1) > 1 or cfg.goal == "throughput"
        ranked = sorted(per_format, key=lambda s: _rank(s[0], registry, serving), reverse=True)
        selection, model, workload, the_plan = ranked[0]
        facts: dict[str, tuple[Candidate, ModelInfo, Workload, Plan | None]] = {}
        for sel, info, wl, pl in ranked:
            for c in sel.candidates:
                if c.eligible and c.name not in facts:
                    facts[c.name] = (c, info, wl, pl)
        if len(per_format) > 1:
            # each backend as it stands on the format it reads
            best = [f[0] for f in facts.values()]
            rest = [c for c in selection.candidates if c.name not in facts]
            selection.candidates = sorted(best, key=lambda c: -c.score) + rest
            held = ", ".join(f"{info.format} ({info.path})" for _, info, _, _ in per_format)
            selection.steps.append(f"the model directory holds {held}; each backend reads its own")
        order = [registry.get(c.name) for c in selection.candidates if c.eligible]
        if not order:
            rejected = [(c.name, "; ".join(c.blockers)) for c in selection.candidates]
            if selection.recommendation:
                rejected.append(("recommended", selection.recommendation))
            raise NoSuitableBackend(cfg.model, rejected)
    last_error: Exception | None = None
    for cls in order:
        selection.backend = cls.name
        if not cfg.backend:
            _, model, workload, the_plan = facts[cls.name]
            selection.format = model.format
        try:
            return _load_walking_down(cls, cfg, workload, selection, model, hardware, the_plan)
        except (OutOfMemory, ModelLoadError, BackendUnavailable) as exc:
            if isinstance(exc, FileNotFoundError) or len(order) == 1:
                raise
            selection.steps.append(f"{cls.name} failed to load: {_first_line(exc)}; trying the next backend")
            last_error = exc
    assert last_error is not None
    raise last_error


_MIN_CONTEXT = 1024


def _load_walking_down(
    cls: type[Engine[Any]],
    cfg: EngineConfig,
    workload: Workload,
    selection: Selection,
    model: Any = None,
    hardware: Hardware | None = None,
    plan: Plan | None = None,
) -> Engine[Any]:
    """Load ``cls``; on ``OutOfMemory`` walk down: the model's trained context if more was asked,
    then halving the context down to 1024, then fewer layers on the GPU (where the backend offloads
    by layer and there is a GPU), then a quantized KV cache where the backend has one. Each step is
    recorded in the selection; the caller then tries the next backend."""
    trained = getattr(model, "context_length", None)
    current = cfg
    context = cfg.context_length or workload.context_length
    while True:
        engine = cls(current)
        engine.selection = selection
        try:
            return engine.load()
        except OutOfMemory as exc:
            why = _first_line(exc)
            if context > _MIN_CONTEXT:
                smaller = max(_MIN_CONTEXT, context // 2)
                if isinstance(trained, int) and _MIN_CONTEXT <= trained < smaller:
                    smaller = trained  # more context than the model was trained for is no use
                step = f"context_length={smaller}"
                context = smaller
                current = current.model_copy(update={"context_length": smaller})
            elif (layers := _fewer_gpu_layers(cls, current, model, hardware, plan)) is not None:
                step = f"n_gpu_layers={layers}"
                current = current.model_copy(update={"options": {**current.options, "n_gpu_layers": layers}})
            elif (kv := _quantized_kv_option(cls, current)) is not None:
                step = f"a quantized KV cache {kv}"
                current = current.model_copy(update={"options": {**current.options, **kv}})
            else:
                raise
            selection.steps.append(f"{cls.name}: out of memory ({why}); retrying with {step}")


def _fewer_gpu_layers(
    cls: type[Engine[Any]], cfg: EngineConfig, model: Any, hardware: Hardware | None, plan: Plan | None
) -> int | None:
    """Half the layers on the GPU (first what the plan says fits), for backends that offload by
    layer; None when there is no GPU or nothing left to take off it."""
    if "n_gpu_layers" not in cls.Options.model_fields or hardware is None or not hardware.gpus:
        return None
    now = cfg.options_for(cls.name).get("n_gpu_layers")
    total = getattr(model, "layers", None)
    if now in (None, -1, "auto"):
        if plan is not None and plan.gpu_layers is not None and (total is None or plan.gpu_layers < total):
            return plan.gpu_layers
        return total // 2 if isinstance(total, int) and total > 1 else None
    return now // 2 if isinstance(now, int) and now > 1 else None


def _quantized_kv_option(cls: type[Engine[Any]], cfg: EngineConfig) -> dict[str, Any] | None:
    """The backend's quantized-KV option not yet tried, if it has one."""
    fields = cls.Options.model_fields
    opts = cfg.options_for(cls.name)
    if "kv_cache_type" in fields and opts.get("kv_cache_type", "f16") == "f16":
        return {"kv_cache_type": "q8_0"}
    if "kv_bits" in fields and not opts.get("kv_bits"):
        return {"kv_bits": 8}
    if "cache_type" in fields and opts.get("cache_type", "fp16") == "fp16":
        return {"cache_type": "q8"}
    return None


def _inspect_all(path: str) -> list[ModelInfo]:
    """The model's inspection, once per format it is held in side by side (usually one)."""
    formats = model_formats(path)
    if len(formats) < 2:
        return [inspect_model(path)]
    infos, first_error = [], None
    for p in formats.values():
        try:
            infos.append(inspect_model(p))
        except (ModelFormatError, ModelNotFound) as exc:
            first_error = first_error or exc
    if not infos:
        assert first_error is not None
        raise first_error
    return infos


def _rank(selection: Selection, registry: Registry, serving: bool) -> tuple[float, bool]:
    """How a format's selection ranks against the model's other formats: its best score, then,
    for several users or throughput, whether that backend batches requests."""
    best = next((c for c in selection.candidates if c.eligible), None)
    if best is None:
        return (float("-inf"), False)
    batching = registry.get(best.name).capabilities.batching
    return (best.score, batching == serving)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


@functools.lru_cache(maxsize=1)
def _machine() -> Hardware | None:
    """This machine, probed once per process (a few short subprocesses at most)."""
    try:
        return detect_hardware()
    except Exception:  # detection must never stop a load
        return None


def _workload(cfg: EngineConfig, model: Any) -> Workload:
    trained = getattr(model, "context_length", None)
    ctx = cfg.context_length or (min(trained, 4096) if isinstance(trained, int) and trained > 0 else 4096)
    return Workload(context_length=ctx, concurrency=cfg.concurrency or 1, goal=cfg.goal or "latency")


def _plan(model: Any, hardware: Hardware | None, workload: Workload) -> Plan | None:
    if hardware is None or not isinstance(model, ModelInfo):
        return None
    try:
        return plan(model, hardware, workload)
    except Exception:  # a plan is advice: its failure must not stop a load
        return None


@dataclass(frozen=True)
class _ModelRef:
    """What the selection knows about the model before full inspection: its path and format."""

    path: str
    format: str
