"""The benchmark entry points: an engine in this process, a model on several backends, a URL.

Each returns the result document (``unillm.bench._result``); ``write_result`` writes it once its
metadata is complete. Ctrl-C during a run ends it early: what was measured is returned, marked
``partial``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unillm.bench._meta import BenchError, collect, engine_metadata, model_metadata
from unillm.bench._prompts import HFTokenizer, Prompts
from unillm.bench._result import build_result
from unillm.bench._runner import Bench, Level, Progress
from unillm.bench._targets import EngineTarget, HttpTarget
from unillm.bench._workload import BenchWorkload, load_workload

if TYPE_CHECKING:
    from unillm._contract._engine import Engine
    from unillm._hardware import Hardware
    from unillm._inspect import ModelInfo
    from unillm._plan._estimate import Plan

__all__ = [
    "bench_backends",
    "bench_engine",
    "bench_url",
    "model_path_for",
    "run_interleaved",
    "url_bench",
    "url_result",
]


def _run(bench: Bench) -> tuple[list[Level], bool]:
    async def main() -> None:
        try:
            await bench.run()
        finally:
            await bench.target.aclose()

    try:
        asyncio.run(main())
        return bench.levels, False
    except KeyboardInterrupt:
        return bench.interrupted(), True


def _plans(
    info: ModelInfo | None,
    hardware: Hardware | None,
    levels: Sequence[Level],
    context: int | None,
    memory: Any = None,
) -> list[Plan | None]:
    """The memory plan of each level; with ``memory`` (the backend's ``Engine.memory``) the
    engine's own calibrated figures (docs/planner.md), else the generic formula (a URL's)."""
    if info is None or hardware is None:
        return [None] * len(levels)
    from unillm._contract._context import resolve_context
    from unillm._plan._estimate import Workload, plan

    out: list[Plan | None] = []
    for level in levels:
        n = int(level.value) if level.kind == "concurrency" else max(1, level.peak_in_flight)
        try:
            wl = Workload(context_length=resolve_context(context, info.context_length)[0], concurrency=n)
            out.append(plan(info, hardware, wl, engine=memory))
        except Exception:  # the plan is context, never a reason to lose a run
            out.append(None)
    return out


def bench_engine(
    engine: Engine[Any],
    workload: BenchWorkload | dict[str, Any] | str | Path,
    *,
    model_name: str | None = None,
    model_path: str | Path | None = None,
    price_per_hour: float | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Benchmark a loaded ``engine`` under ``workload``; the result document.

    ``model_name`` labels the model (default: the name of its path); ``model_path`` is where its
    weights are (default: the engine's ``config.model``), for the metadata's hash.
    """
    wl = load_workload(workload)
    bench = _engine_bench(engine, wl, progress)
    levels, interrupted = _run(bench)
    return _engine_result(engine, bench, levels, interrupted, model_name, model_path, price_per_hour)


def _engine_bench(engine: Engine[Any], wl: BenchWorkload, progress: Progress | None) -> Bench:
    _check_context(wl, engine.context_length, engine.name)
    prompts = Prompts(wl, engine, vocab_size=engine.vocab_size)
    return Bench(EngineTarget(engine, wl), wl, prompts, progress=progress)


def _engine_result(
    engine: Engine[Any],
    bench: Bench,
    levels: list[Level],
    interrupted: bool,
    model_name: str | None,
    model_path: str | Path | None,
    price_per_hour: float | None,
) -> dict[str, Any]:
    wl, target = bench.workload, bench.target
    facts = engine.facts
    path = Path(model_path or engine.config.model)
    info = facts.model
    meta = collect(
        model=model_metadata(model_name or _name(path), path, info),
        engine=engine_metadata(engine),
        hardware=facts.hardware,
        workload=wl.as_dict(),
    )
    return build_result(
        metadata=meta,
        target={"kind": "engine", "backend": engine.name},
        workload=wl,
        levels=levels,
        output_enforcement=target.output_enforcement,
        prompt_lengths_exact=bench.prompts.exact,
        plans=_plans(
            info, facts.hardware, levels, engine.context_length, getattr(type(engine), "memory", None)
        ),
        partial=interrupted,
        price_per_hour=price_per_hour,
    )


def _check_context(wl: BenchWorkload, context: int | None, name: str) -> None:
    """A workload whose longest request cannot fit the loaded context fails before it runs, not
    as a level of errors."""
    if not context or wl.prompts_jsonl:
        return
    longest = wl.input_len.upper + wl.output_len.upper
    if longest > context:
        from unillm._errors import ConfigError

        raise ConfigError(
            f"the workload's longest request ({wl.input_len.upper} prompt + {wl.output_len.upper} "
            f"output tokens) does not fit {name}'s context of {context} tokens; load it with a "
            f"longer context (--context {longest}) or shorten the workload"
        )


def _name(path: Path) -> str:
    # the tiny builders' and HF's layouts put the weights in a directory named for their format
    return (
        path.parent.name if path.name in ("hf", "mlx", "gguf") else path.stem if path.is_file() else path.name
    )


def model_path_for(model: str | Path, backend: str) -> Path:
    """The file or directory of ``model`` that ``backend`` reads: in a directory holding an HF
    directory and a GGUF of the same weights, its own format of them."""
    from unillm._choose._registry import default_registry
    from unillm._inspect._paths import model_formats

    formats = model_formats(model)
    cls = default_registry().get(backend)
    if "gguf" in cls.formats and "gguf" in formats:
        return formats["gguf"]
    if "gguf" not in cls.formats and "hf" in formats:
        return formats["hf"]
    return Path(model)


def bench_backends(
    model: str | Path,
    backends: Sequence[str | None],
    workload: BenchWorkload | dict[str, Any] | str | Path,
    *,
    context_length: int | None = None,
    model_name: str | None = None,
    price_per_hour: float | None = None,
    progress: Progress | None = None,
    interleave: bool = False,
    options: Mapping[str, Any] | None = None,
    backend_options: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The same workload on each of ``backends``, each loading ``model`` in its own format
    (``model_path_for``); a result per backend. A backend of None is the one ``auto_engine``
    selects. By default one backend runs all its levels, is closed, then the next loads;
    ``interleave`` loads them all and runs each level on each backend in turn, so that a shared
    or throttling machine's drift falls on every backend alike (and needs the memory of all).
    ``options`` go to every backend, ``backend_options`` to the one each table names, as an
    ``EngineConfig``'s (``options_for``); each result records the options its engine ran with."""
    wl = load_workload(workload)
    name = model_name or _name(Path(model))
    opened = _opener(context_length, options, backend_options)
    if interleave:
        return _interleaved(model, backends, wl, name, opened, price_per_hour, progress)
    out = []
    for backend in backends:
        path = model_path_for(model, backend) if backend is not None else Path(model)
        engine = opened(path, backend)
        if backend is None:
            path = model_path_for(model, engine.name)
        try:
            out.append(
                bench_engine(
                    engine,
                    wl,
                    model_name=name,
                    model_path=path,
                    price_per_hour=price_per_hour,
                    progress=progress,
                )
            )
        finally:
            engine.close()
        if out[-1]["partial"]:
            break  # interrupted: the backends not run yet stay unrun
    return out


def _opener(
    context_length: int | None,
    options: Mapping[str, Any] | None,
    backend_options: Mapping[str, Mapping[str, Any]] | None,
) -> Callable[[Path, str | None], Engine[Any]]:
    """How each backend's engine is opened: ``auto_engine`` with the context and the options."""
    from unillm._choose._auto import auto_engine

    tables = {k: dict(v) for k, v in (backend_options or {}).items()}

    def opened(path: Path, backend: str | None) -> Engine[Any]:
        return auto_engine(
            path, backend=backend, context_length=context_length, options=dict(options or {}) or None,
            backend_options=tables,
        )  # fmt: skip

    return opened


def _interleaved(
    model: str | Path,
    backends: Sequence[str | None],
    wl: BenchWorkload,
    name: str,
    opened: Callable[[Path, str | None], Engine[Any]],
    price_per_hour: float | None,
    progress: Progress | None,
) -> list[dict[str, Any]]:
    engines: list[tuple[Engine[Any], Path]] = []
    try:
        for backend in backends:
            path = model_path_for(model, backend) if backend is not None else Path(model)
            engine = opened(path, backend)
            engines.append((engine, model_path_for(model, engine.name)))
        benches = [_engine_bench(engine, wl, progress) for engine, _ in engines]
        interrupted = run_interleaved(benches, wl)
        return [
            _engine_result(
                engine, bench, bench.interrupted() if interrupted else bench.levels, interrupted,
                name, path, price_per_hour,
            )
            for (engine, path), bench in zip(engines, benches, strict=True)
        ]  # fmt: skip
    finally:
        for engine, _ in engines:
            engine.close()


def run_interleaved(benches: Sequence[Bench], wl: BenchWorkload, *, rotate: bool = False) -> bool:
    """Each level of ``wl`` on every bench in turn (``rotate``: who goes first moves by one a
    level), then their targets closed; True when Ctrl-C ended it (each bench keeps what it measured)."""

    async def main() -> None:
        try:
            for i, (kind, value) in enumerate(wl.levels()):
                k = i % len(benches) if rotate else 0
                for bench in [*benches[k:], *benches[:k]]:
                    await bench.run_level(kind, value)
        finally:
            for bench in benches:
                await bench.target.aclose()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        return True
    return False


def bench_url(
    url: str,
    workload: BenchWorkload | dict[str, Any] | str | Path,
    *,
    model: str | None = None,
    model_path: str | Path | None = None,
    tokenizer: str | Path | None = None,
    engine_name: str | None = None,
    engine_version: str | None = None,
    api_key: str | None = None,
    price_per_hour: float | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Benchmark an OpenAI-compatible server at ``url``. ``model`` is the name to send (default:
    the first the server lists); ``model_path`` the model's files on this machine (metadata, and
    the tokenizer when ``tokenizer`` is not given: an HF directory or its ``tokenizer.json``).
    The server's memory is not sampled (it is not this process's)."""
    wl = load_workload(workload)
    bench = url_bench(
        url, wl, model=model, model_path=model_path, tokenizer=tokenizer, api_key=api_key, progress=progress
    )
    levels, interrupted = _run(bench)
    return url_result(
        bench, url, levels, interrupted, model_path=model_path, engine_name=engine_name,
        engine_version=engine_version, price_per_hour=price_per_hour,
    )  # fmt: skip


def url_bench(
    url: str,
    wl: BenchWorkload,
    *,
    model: str | None = None,
    model_path: str | Path | None = None,
    tokenizer: str | Path | None = None,
    api_key: str | None = None,
    progress: Progress | None = None,
    keepalive: bool = True,
) -> Bench:
    """The benchmark of the server at ``url`` (``bench_url``'s, and each server's of ``bench_servers``)."""
    from unillm._inspect._paths import hf_dir_in

    tok_source = tokenizer or (hf_dir_in(model_path) if model_path else None)
    tok = HFTokenizer(tok_source) if tok_source else None
    count = (lambda text: len(tok.tokenize(text))) if tok is not None else None
    target = HttpTarget(url, model or "", wl, api_key=api_key, count_tokens=count, keepalive=keepalive)
    if not model:
        names = asyncio.run(_models(url, api_key))
        if not names:
            raise BenchError(f"{url} lists no model at /v1/models; pass the model name to send")
        target.model = names[0]
    prompts = Prompts(wl, tok, vocab_size=getattr(tok, "vocab_size", None))
    return Bench(target, wl, prompts, progress=progress)


def url_result(
    bench: Bench,
    url: str,
    levels: list[Level],
    interrupted: bool,
    *,
    model_path: str | Path | None,
    engine_name: str | None,
    engine_version: str | None,
    price_per_hour: float | None,
) -> dict[str, Any]:
    """The result document of a server's benchmark."""
    from unillm._contract._facts import machine

    wl, target = bench.workload, bench.target
    assert isinstance(target, HttpTarget)
    info = _inspect(model_path)
    hardware = machine()
    engine = {"name": engine_name, "version": engine_version, "url": url, "served_model": target.model}
    meta = collect(
        model=model_metadata(_name(Path(model_path)) if model_path else target.model, model_path, info),
        engine=engine,
        hardware=hardware,
        workload=wl.as_dict(),
    )
    return build_result(
        metadata=meta,
        target={"kind": "http", "url": url, "model": target.model},
        workload=wl,
        levels=levels,
        output_enforcement=target.output_enforcement,
        prompt_lengths_exact=bench.prompts.exact,
        plans=_plans(info, hardware, levels, info.context_length if info else None),
        partial=interrupted,
        price_per_hour=price_per_hour,
    )


async def _models(url: str, api_key: str | None) -> list[str]:
    probe = HttpTarget(url, "", BenchWorkload(), api_key=api_key)
    try:
        return await probe.models()
    finally:
        await probe.aclose()


def _inspect(path: str | Path | None) -> ModelInfo | None:
    if not path:
        return None
    from unillm._errors import UnillmError
    from unillm._inspect import inspect_model

    try:
        return inspect_model(str(path))
    except UnillmError:
        return None
