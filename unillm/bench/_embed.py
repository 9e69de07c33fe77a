"""The embedding benchmark: ``engine.embed`` over batches of synthetic texts, batch size by batch size.

Each batch size is a level: ``warmup`` unmeasured calls, then ``requests`` calls of that many
texts of ``input_len`` tokens each (the prompt builder's exact-length texts, every call its own
texts, built before the clock starts), one after another. A call's latency is its record's E2E;
texts/s and tokens/s are over the level's wall time (``summarize_embed``). The result is the
generate bench's document (``unillm.bench._result``) with ``"task": "embed"`` and levels of kind
``batch_size``, so ``write_result``, ``read_result``, ``compare``, ``table`` and ``plot`` take it;
its workload is an ``EmbedWorkload`` (``unillm.bench._workload``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Any

from unillm._errors import ConfigError, UnillmError
from unillm.bench._api import _name, model_path_for
from unillm.bench._meta import collect, engine_metadata, model_metadata
from unillm.bench._metrics import RequestRecord, summarize_embed
from unillm.bench._prompts import Prompts
from unillm.bench._result import SCHEMA
from unillm.bench._runner import Level, Progress, _wall, rss_bytes
from unillm.bench._workload import EmbedWorkload

if TYPE_CHECKING:
    from unillm._contract._engine import Engine

__all__ = ["bench_embed", "bench_embed_backends"]

_WARMUP_BASE = 1_000_000  # warm-up calls take texts of their own, not the measured ones'


def bench_embed(
    engine: Engine[Any],
    workload: EmbedWorkload | dict[str, Any],
    *,
    model_name: str | None = None,
    model_path: str | Path | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Benchmark ``engine.embed`` (an engine loaded with ``task="embed"``) under ``workload``;
    the result document. Ctrl-C ends it early: what was measured is returned, marked partial."""
    wl = workload if isinstance(workload, EmbedWorkload) else EmbedWorkload(**workload)
    limit = engine.embed_limit
    if limit is not None and wl.input_len.upper > limit:
        raise ConfigError(
            f"the workload's longest text ({wl.input_len.upper} tokens) is more than the {limit} "
            f"{engine.name} embeds at once; load it with a longer context (--context "
            f"{wl.input_len.upper}) or shorten the texts"
        )
    prompts = Prompts(wl.prompt_workload(), engine, vocab_size=engine.vocab_size)
    levels: list[Level] = []
    interrupted = False
    try:
        for size in wl.batch_sizes:
            levels.append(Level("batch_size", float(size)))
            _run_level(engine, wl, prompts, levels[-1], progress)
    except KeyboardInterrupt:
        interrupted = True
        if levels:  # the level in progress, its unfinished call left out
            last = levels[-1]
            last.partial = True
            last.records = [r for r in last.records if r.end is not None or r.error is not None]
    path = Path(model_path or engine.config.model)
    facts = engine.facts
    meta = collect(
        model=model_metadata(model_name or _name(path), path, facts.model),
        engine=engine_metadata(engine),
        hardware=facts.hardware,
        workload=wl.as_dict(),
    )
    return {
        "schema": SCHEMA,
        "task": "embed",
        "partial": interrupted or any(lv.partial for lv in levels),
        "metadata": meta,
        "target": {"kind": "engine", "backend": engine.name, "pooling": engine.pooling},
        "prompt_lengths_exact": prompts.exact,
        "levels": [_level_dict(lv) for lv in levels],
    }


def _texts(prompts: Prompts, first: int, n: int) -> list[str]:
    return [prompts.get(first + j).prompt for j in range(n)]


def _run_level(
    engine: Engine[Any], wl: EmbedWorkload, prompts: Prompts, level: Level, progress: Progress | None
) -> None:
    size = int(level.value)
    for k in range(wl.warmup):
        with contextlib.suppress(UnillmError):  # a failing call fails measured too, counted there
            engine.embed(_texts(prompts, _WARMUP_BASE + k * size, size), normalize=wl.normalize)
    batches = [_texts(prompts, k * size, size) for k in range(wl.requests)]
    label = f"batch={size}"
    level.started = time.time()
    t0 = perf_counter()
    for k, batch in enumerate(batches):
        rec = RequestRecord(k, streamed=False, output_asked=0)
        level.records.append(rec)
        rec.send = perf_counter() - t0
        try:
            result = engine.embed(batch, normalize=wl.normalize)
        except UnillmError as exc:
            rec.error, rec.error_message = type(exc).__name__, str(exc)[:500]
        else:
            rec.end = perf_counter() - t0
            rec.input_tokens = result.usage.prompt_tokens
        rss = rss_bytes()
        if rss is not None:
            level.peak_rss_bytes = max(level.peak_rss_bytes or 0, rss)
        level.done += 1
        if progress is not None:
            progress(label, level.done, wl.requests)
    level.wall_s = _wall(level, perf_counter() - t0)


def _level_dict(level: Level) -> dict[str, Any]:
    return {
        "kind": level.kind,
        "value": level.value,
        "partial": level.partial,
        "started": level.started,
        "summary": summarize_embed(level.records, int(level.value), wall_s=level.wall_s),
        "memory": {"peak_rss_bytes": level.peak_rss_bytes},
        "records": [r.to_dict() for r in level.records],
    }


def bench_embed_backends(
    model: str | Path,
    backends: Sequence[str | None],
    workload: EmbedWorkload | dict[str, Any],
    *,
    context_length: int | None = None,
    pooling: str | None = None,
    model_name: str | None = None,
    progress: Progress | None = None,
    options: Mapping[str, Any] | None = None,
    backend_options: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """``bench_embed`` on each of ``backends`` in turn, each loading ``model`` in its own format
    for embeddings (``task="embed"``, ``pooling`` when given; a generative model pools its last
    token), with ``options`` and ``backend_options`` as ``bench_backends`` takes them."""
    from unillm._choose._auto import auto_engine

    name = model_name or _name(Path(model))
    tables = {k: dict(v) for k, v in (backend_options or {}).items()}
    out = []
    for backend in backends:
        path = model_path_for(model, backend) if backend is not None else Path(model)
        engine = auto_engine(
            path, backend=backend, context_length=context_length, options=dict(options or {}) or None,
            backend_options=tables, task="embed", pooling=pooling,
        )  # fmt: skip
        try:
            used = model_path_for(model, engine.name) if backend is None else path
            out.append(bench_embed(engine, workload, model_name=name, model_path=used, progress=progress))
        finally:
            engine.close()
        if out[-1]["partial"]:
            break  # interrupted: the backends not run yet stay unrun
    return out
