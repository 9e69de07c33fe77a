"""``auto_engine`` and ``load_engine``: from a model path or a config to a loaded engine.

The model is inspected and the machine probed once; ``select()`` ranks every registered backend,
built-in or plugin, by the same rule (its own ``suitability()`` plus the decision guide's bonus,
docs/selection.md), and the best one that is installed is loaded with those facts
(``engine.facts``). When a load fails, the backend's own fallback steps are walked, then the next
backend is tried. The engine's ``selection`` records the candidates, why each was or was not
taken, and every step. Nothing here names an engine: what is specific to one lives with it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from unillm._choose._registry import Registry, default_registry
from unillm._choose._select import Candidate, Selection, _size, select
from unillm._config import read_config
from unillm._contract._context import resolve_context
from unillm._contract._facts import Facts, machine
from unillm._errors import (
    BackendUnavailable,
    DownloadError,
    ModelFormatError,
    ModelLoadError,
    ModelNotFound,
    NoSuitableBackend,
    OutOfMemory,
    UnillmError,
    UnillmWarning,
    warn,
)
from unillm._inspect import ModelInfo
from unillm._inspect._paths import model_formats
from unillm._names import parse_model_name
from unillm._plan._estimate import Plan, Workload, plan
from unillm._types import Fallback, normalize_name

if TYPE_CHECKING:
    from unillm._contract._engine import Engine
    from unillm._hardware import Hardware
    from unillm._hub import Progress, Resolved
    from unillm._types import Availability, EngineConfig

__all__ = [
    "Candidate",
    "Choice",
    "Selection",
    "auto_engine",
    "choose",
    "inspect_model",
    "load_engine",
    "model_info",
    "resolve_name",
    "workload_for",
]


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
    (each backend reads the one it can), or a Hugging Face name: ``org/name``,
    ``org/name@revision``, ``org/name:Q4_K_M`` (docs/models.md), downloaded into the Hugging Face
    cache when it is not there, the quantization that fits this machine chosen when no tag is given.
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
    """Load the engine a config describes (an ``EngineConfig``, a dict or a TOML path); its
    ``model`` may be a Hugging Face name, as ``auto_engine``'s."""
    return _open(read_config(source, **overrides), registry or default_registry())


@dataclass
class Choice:
    """What ``auto_engine`` decides before it loads: the selection (every candidate and why), the
    backends to try in order, and for each the model facts, workload and plan it is loaded with."""

    selection: Selection
    order: list[type[Engine[Any]]]
    facts: dict[str, tuple[Any, Workload, Plan | None]]
    hardware: Hardware | None
    #: what a model name resolved to (None for a path); its files may still be to download
    source: Resolved | None = None
    #: of ``EngineConfig.variants``, the one chosen (None: no variants were weighed), and each
    #: variant as it was weighed (``unillm._choose._variants.Weighed``)
    variant: str | None = None
    weighed: list[Any] = field(default_factory=list)

    def fetch(self, cfg: EngineConfig, progress: Progress | None = None) -> EngineConfig:
        """``cfg`` with its model name replaced by the local path, downloading what is missing
        (nothing for a path): what ``auto_engine`` does before it loads."""
        if self.source is None:
            return cfg
        local = self.source.local or self.source.fetch(progress)
        return cfg.model_copy(update={"model": str(local)})


def model_info(cfg: EngineConfig, registry: Registry | None = None, hardware: Hardware | None = None) -> Any:
    """What ``cfg``'s model is, from headers only: a path inspected (a plugin's format
    included), a name resolved (``resolve_name``; nothing downloaded). ``unillm inspect`` and
    ``unillm plan`` read a model through it."""
    cfg, source = resolve_name(cfg, hardware)
    if source is not None and source.local is None:
        return source.info
    return (registry or default_registry()).inspect_model(cfg.model)


def inspect_model(model: str | os.PathLike[str], *, hardware: Hardware | None = None) -> ModelInfo:
    """What a model is, read from headers only (never the weights), as ``unillm inspect`` reads it.

    ``model`` is a ``.gguf`` file (any part of a split set), a ``.safetensors`` file, a model
    directory, or a Hugging Face
    name, ``org/name[@revision][:QUANT]``, resolved as ``auto_engine`` resolves it: from the cache
    when its files are there, else from the hub's file list and headers (range requests: nothing
    is downloaded). Of a repo with several GGUF files and no tag, the one chosen for ``hardware``
    at the default workload (no hardware: llama.cpp's default, Q4_K_M, else Q8_0, else the first).
    Raises ``ModelNotFound`` for a missing path, ``ModelFormatError`` for anything corrupt or not a
    model, and for a name the hub's typed errors (``RepoNotFound``, ``QuantNotFound``,
    ``GatedModel``; ``NotCached`` offline, saying what to run).
    """
    from unillm._types import EngineConfig

    if parse_model_name(model) is None:  # a path: unillm's own reading (a plugin's hook calls this)
        from unillm._inspect import inspect_model as read_headers

        return read_headers(os.fspath(model))
    return model_info(EngineConfig(model=str(model)), hardware=hardware)  # type: ignore[no-any-return]


def resolve_name(
    cfg: EngineConfig, hardware: Hardware | None, reads: Collection[str] | None = None
) -> tuple[EngineConfig, Resolved | None]:
    """The one place a model name is resolved (``unillm._hub.resolve``): ``cfg`` as it was for a
    path; for a name, ``cfg`` with the local path when the files are cached, and the resolution
    (its files, its header-read info, the quantization chosen for ``cfg``'s workload; of a repo
    holding two formats, the one the installed backends ``reads``)."""
    name = parse_model_name(cfg.model)
    if name is None:
        return cfg, None
    from unillm._hub import resolve

    resolved = resolve(name, hardware=hardware, workload=lambda info: workload_for(cfg, info), reads=reads)
    local = resolved.local
    return (cfg.model_copy(update={"model": str(local)}) if local else cfg), resolved


def choose(
    cfg: EngineConfig,
    registry: Registry | None = None,
    *,
    hardware: Hardware | None = None,
    available: Mapping[str, Availability] | None = None,
) -> Choice:
    """Choose the backend for ``cfg`` from the model's headers, as ``auto_engine`` does before it
    loads: the one function ``auto_engine``, ``unillm select``, ``unillm generate``'s label and the
    server call. ``hardware`` (a profile) and ``available`` (the backends a profile has installed)
    replace this machine's; by default the machine is probed once per process."""
    registry = registry or default_registry()
    backends = registry.backends()
    if available is None:
        available = {name: info.availability() for name, info in backends.items()}
    if hardware is None:
        hardware = _machine()
    if cfg.variants and not cfg.backend:
        return _choose_variant(cfg, registry, hardware, available)
    given, note = cfg, None
    if cfg.backend:
        reads: set[str] = set(registry.get(cfg.backend).formats)
    else:
        reads = {
            f
            for n, b in backends.items()
            if (a := available.get(n)) is not None and a.available
            for f in b.cls.formats
        }
    try:
        cfg, source = resolve_name(cfg, hardware, reads)
    except (ModelNotFound, DownloadError) as exc:
        if not cfg.backend:
            raise
        # a forced backend may take a name unillm cannot resolve (a model on a server): it decides
        source, note = (
            None,
            f"{cfg.model!r} is not resolved on the hub ({_first_line(exc)}); {cfg.backend} takes it as given",
        )
    forced = (
        registry.get(cfg.backend) if cfg.backend and source is not None and source.local is None else None
    )
    if forced is not None and source is not None and source.info.format not in forced.formats:
        cfg, source = given, None  # not a file the forced backend reads: nothing is downloaded for it
    remote = source.info if source is not None and source.local is None else None
    choice = _choose(cfg, registry, backends, available, hardware, remote)
    if note:
        choice.selection.steps.append(note)
    if source is not None:
        choice.source = source
        choice.selection.model = str(source.name)
        choice.selection.files = source.lines()
    return choice


def _choose_variant(
    cfg: EngineConfig, registry: Registry, hardware: Hardware | None, available: Mapping[str, Availability]
) -> Choice:
    """``choose`` for ``cfg.model`` and each of ``cfg.variants``, weighed (``_variants``): the
    choice of the one to load, its ``explain()`` listing them all."""
    from unillm._choose._variants import pick, ranked_lines, weigh

    weighed, choices, failed, errors = [], [], [], []
    for name in (cfg.model, *cfg.variants):
        try:
            with warnings.catch_warnings():  # a tagged copy that does not fit: weighed, said below
                warnings.simplefilter("ignore", UnillmWarning)
                one = choose(cfg.model_copy(update={"model": name, "variants": ()}), registry,
                             hardware=hardware, available=available)  # fmt: skip
        except UnillmError as exc:  # a copy missing, gated, unreadable: the others may do
            failed.append(f"{name}: {_first_line(exc)}")
            errors.append(exc)
            continue
        choices.append(one)
        weighed.append(weigh(name, one))
    if not choices:
        raise errors[0]  # the model's own error; the variants failed too
    where = f"{cfg.context_length or 'the default'} tokens x {cfg.concurrency or 1}"
    chosen, why = pick(weighed, where)
    choice = choices[chosen]
    choice.variant, choice.weighed = weighed[chosen].name, weighed
    if weighed[chosen].fits is False:
        warn(
            f"none of {cfg.model} and its variants fits at {where}; {weighed[chosen].name}, the "
            "smallest that runs here, may still load with a smaller context (selection.explain())"
        )
    lines = ranked_lines(weighed, chosen, why) + [f"  not weighed: {f}" for f in failed]
    choice.selection.files = lines + choice.selection.files
    return choice


def _choose(
    cfg: EngineConfig,
    registry: Registry,
    backends: Any,
    available: Mapping[str, Availability],
    hardware: Hardware | None,
    remote: ModelInfo | None,
) -> Choice:
    """``choose`` once the model is a local path, or a name's header-read info (``remote``)."""
    guide = registry.guide()
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
            # a directory holding several formats: the one this backend reads
            model: Any = remote or _format_for(cls, _inspect_all(cfg.model, registry))
        except (ModelFormatError, ModelNotFound):
            model = _ModelRef(cfg.model, "unknown")
        workload = workload_for(cfg, model)
        the_plan = _plan(model, hardware, workload, getattr(cls, "memory", None))
        selection = select(
            hardware,
            model,
            workload,
            backends,
            available=available,
            plan=the_plan,
            requested=cls.name,
            guide_entries=guide,
        )
        selection.chosen_by = by
        mine = next((c for c in selection.candidates if c.name == cls.name), None)
        problems = list(mine.blockers) if mine else []
        if model.format == "unknown":  # unillm cannot tell: the backend will
            problems = [p for p in problems if "does not read" not in p]
        if problems:
            note = f"{cls.name} was asked for, but the selector sees a problem: {'; '.join(problems)}"
            warn(f"{note}; loading it anyway")
            selection.steps.append(note)
        return Choice(selection, [cls], {cls.name: (model, workload, the_plan)}, hardware)
    # One selection per format the model is held in (a directory may hold an HF directory and
    # a GGUF of the same weights): each backend is ranked on the format it reads.
    per_format = []
    for info in [remote] if remote is not None else _inspect_all(cfg.model, registry):
        wl = workload_for(cfg, info)
        pl = _plan(info, hardware, wl)
        sel = select(hardware, info, wl, backends, available=available, plan=pl, guide_entries=guide)
        per_format.append((sel, info, wl, pl))
    serving = (cfg.concurrency or 1) > 1 or cfg.goal == "throughput"
    ranked = sorted(per_format, key=lambda s: _rank(s[0], registry, cfg, serving), reverse=True)
    selection = ranked[0][0]
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
        if selection.candidates and selection.candidates[0].eligible:
            selection.backend = selection.candidates[0].name
            selection.format = facts[selection.backend][1].format
    order = [registry.get(c.name) for c in selection.candidates if c.eligible]
    return Choice(selection, order, {n: f[1:] for n, f in facts.items()}, hardware)


def _open(cfg: EngineConfig, registry: Registry) -> Engine[Any]:
    choice = choose(cfg, registry)
    selection = choice.selection
    if choice.variant is not None:  # the variant chosen stands for the model from here on
        cfg = cfg.model_copy(update={"model": choice.variant, "variants": ()})
    if choice.source is not None:
        remote = choice.source.local is None
        local = choice.fetch(cfg)
        if remote:
            # downloaded just now: the engines read the files, with the facts read from them
            info = registry.inspect_model(local.model)
            facts = choice.facts.items()
            choice.facts = {
                n: ((info if isinstance(m, ModelInfo) else m), wl, pl) for n, (m, wl, pl) in facts
            }
        cfg = local
    if not choice.order:
        rejected = [(c.name, "; ".join(c.blockers)) for c in selection.candidates]
        if selection.recommendation:
            rejected.append(("recommended", selection.recommendation))
        raise NoSuitableBackend(cfg.model, rejected)
    last_error: Exception | None = None
    for cls in choice.order:
        selection.backend = cls.name
        model, workload, the_plan = choice.facts[cls.name]
        if not cfg.backend:
            selection.format = model.format
        try:
            return _load_walking_down(cls, cfg, workload, selection, model, choice.hardware, the_plan)
        except (OutOfMemory, ModelLoadError, BackendUnavailable) as exc:
            if isinstance(exc, FileNotFoundError) or len(choice.order) == 1:
                raise
            selection.steps.append(f"{cls.name} failed to load: {_first_line(exc)}; trying the next backend")
            last_error = exc
    assert last_error is not None
    raise last_error


def _load_walking_down(
    cls: type[Engine[Any]],
    cfg: EngineConfig,
    workload: Workload,
    selection: Selection,
    model: Any = None,
    hardware: Hardware | None = None,
    plan: Plan | None = None,
) -> Engine[Any]:
    """Load ``cls`` with what it is told (``Facts``); when that fails, walk the fallback steps the
    backend declares (``Engine.fallbacks``), cheapest first, each on top of the ones before, so
    as much of what was asked is kept as loads. A step the memory plan says still cannot fit is
    skipped (but the last one is always tried: plans are estimates). Every step is recorded in
    the selection; when none is left the error goes up and the caller tries the next backend."""
    info = model if isinstance(model, ModelInfo) else None
    facts = Facts(cfg.model, model=info, hardware=hardware, workload=workload, plan=plan)
    current = cfg
    steps: list[Fallback] | None = None
    wl = workload
    applied: list[str] = []  # the steps taken, and why the first was needed
    first_why = ""
    while True:
        engine = cls(current)
        engine.selection = selection
        engine.facts = facts
        try:
            loaded = engine.load()
        except (OutOfMemory, ModelLoadError) as exc:
            if steps is None:
                steps = sorted(_declared(cls, cfg, facts, selection), key=lambda f: f.cost)
            why = _first_line(exc)
            left = [f for f in steps if f.answers(exc)]
            if not left:
                raise
            while True:
                step = left.pop(0)
                steps.remove(step)
                current = _apply(cls, current, step)
                wl = replace(
                    wl,
                    context_length=step.context_length or wl.context_length,
                    kv_cache_dtype=step.kv_cache_dtype or wl.kv_cache_dtype,  # type: ignore[arg-type]
                )
                step_plan = _plan(info, hardware, wl, getattr(cls, "memory", None))
                if left and step_plan is not None and not step_plan.fits:
                    selection.steps.append(
                        f"{cls.name}: skipped {step.label}: the plan needs {_size(step_plan.total_bytes)} "
                        f"and finds {_size(step_plan.total_bytes + step_plan.headroom_bytes)}"
                    )
                    continue
                break
            facts = Facts(cfg.model, model=info, hardware=hardware, workload=wl, plan=step_plan)
            kind = "out of memory" if isinstance(exc, OutOfMemory) else "failed to load"
            selection.steps.append(f"{cls.name}: {kind} ({why}); retrying with {step.label}")
            first_why = first_why or f"{kind}: {why}"
            applied.append(step.label)
            continue
        if applied:  # a reduced request is said, not only recorded
            asked = f"context_length={workload.context_length}" if workload.context_length else "its settings"
            final = {label.split("=", 1)[0]: label for label in applied}  # each setting's last value
            warn(
                f"{cls.name}: {cfg.model!r} did not load with {asked} ({first_why}); it loaded with "
                f"{', '.join(final.values())} (selection.explain() lists each step)"
            )
        return loaded


def _declared(
    cls: type[Engine[Any]], cfg: EngineConfig, facts: Facts, selection: Selection
) -> list[Fallback]:
    """The backend's fallback steps; a plugin whose hook fails gets none (and a recorded step)."""
    try:
        return [f for f in cls.fallbacks(cfg, facts) if isinstance(f, Fallback)]
    except Exception as exc:  # a plugin's bug must not hide the load error
        selection.steps.append(f"{cls.name}: its fallbacks() failed ({exc!r}); no fallback steps")
        return []


def _apply(cls: type[Engine[Any]], cfg: EngineConfig, step: Fallback) -> EngineConfig:
    update: dict[str, Any] = dict(step.config)
    if step.options:
        # under the backend's own table, so a step for one backend never reaches the next one
        tables = dict(cfg.backend_options)
        key = next((k for k in tables if normalize_name(k) == normalize_name(cls.name)), cls.name)
        tables[key] = {**tables.get(key, {}), **step.options}
        update["backend_options"] = tables
    return cfg.model_copy(update=update)


def _inspect_all(path: str, registry: Registry) -> list[ModelInfo]:
    """The model's inspection, once per format it is held in side by side (usually one); a
    plugin's inspection (``unillm_inspect_model``) comes first."""
    formats = model_formats(path)
    if len(formats) < 2:
        return [registry.inspect_model(path)]
    infos, first_error = [], None
    for p in formats.values():
        try:
            infos.append(registry.inspect_model(p))
        except (ModelFormatError, ModelNotFound) as exc:
            first_error = first_error or exc
    if not infos:
        assert first_error is not None
        raise first_error
    return infos


def _format_for(cls: type[Engine[Any]], infos: list[ModelInfo]) -> ModelInfo:
    """Of the formats a model is held in, the first ``cls`` reads (else the first: it says why)."""
    return next((i for i in infos if i.format in cls.formats), infos[0])


def _rank(selection: Selection, registry: Registry, cfg: EngineConfig, serving: bool) -> tuple[float, bool]:
    """How a format's selection ranks against the model's other formats: its best score, then,
    for several users or throughput, whether that backend batches requests with these options."""
    best = next((c for c in selection.candidates if c.eligible), None)
    if best is None:
        return (float("-inf"), False)
    return (best.score, _batches(registry.get(best.name), cfg) == serving)


def _batches(cls: type[Engine[Any]], cfg: EngineConfig) -> bool:
    """Whether ``cls`` loaded with ``cfg``'s options batches requests (``capabilities_for``)."""
    try:
        return cls.capabilities_for(cls._validate_options(cfg.options_for(cls.name))).batching
    except Exception:  # options meant for another backend, or a plugin's bug
        return cls.capabilities.batching


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _machine() -> Hardware | None:
    """This machine, probed once per process (``unillm._contract._facts.machine``)."""
    return machine()


def workload_for(cfg: EngineConfig, model: Any) -> Workload:
    """The workload ``cfg`` asks of ``model``: its context (``resolve_context``), concurrency,
    goal and task (the config's, else the model's: an embedding model loads for embed)."""
    context, _ = resolve_context(cfg.context_length, getattr(model, "context_length", None))
    task = cfg.task or getattr(model, "task", None) or "generate"
    return Workload(
        context_length=context, concurrency=cfg.concurrency or 1, goal=cfg.goal or "latency", task=task
    )


def _plan(model: Any, hardware: Hardware | None, workload: Workload, engine: Any = None) -> Plan | None:
    """The plan, with the backend's measured memory model (its ``memory``) once it is known."""
    if hardware is None or not isinstance(model, ModelInfo):
        return None
    try:
        return plan(model, hardware, workload, engine=engine)
    except Exception:  # a plan is advice: its failure must not stop a load
        return None


@dataclass(frozen=True)
class _ModelRef:
    """What the selection knows about the model before full inspection: its path and format."""

    path: str
    format: str
