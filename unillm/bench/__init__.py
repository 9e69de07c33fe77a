"""``unillm.bench``: engine benchmarks done the way the field says they must be (docs/benchmarks.md).

    from unillm.bench import BenchWorkload, bench_engine, write_result

    result = bench_engine(engine, BenchWorkload(input_len=64, output_len=32, requests=8, concurrency=[1, 4]))
    write_result(result, "bench.json")

Workloads are data (``BenchWorkload``, also importable as ``Workload``, or a TOML / Python file
read by ``load_workload``); targets are an engine in this process (``bench_engine``), a model on
several backends (``bench_backends``) or an OpenAI-compatible URL (``bench_url``); embeddings,
``engine.embed`` by batch size, with ``bench_embed`` and ``bench_embed_backends`` (an
``EmbedWorkload``). Nothing here is imported by ``import unillm``; matplotlib and httpx are imported
only when plotting and when benchmarking a URL.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_LAZY = {
    "BenchWorkload": "unillm.bench._workload",
    "Workload": "unillm.bench._workload",
    "Lengths": "unillm.bench._workload",
    "Arrival": "unillm.bench._workload",
    "SLO": "unillm.bench._workload",
    "load_workload": "unillm.bench._workload",
    "bench_engine": "unillm.bench._api",
    "bench_backends": "unillm.bench._api",
    "bench_url": "unillm.bench._api",
    "EmbedWorkload": "unillm.bench._workload",
    "bench_embed": "unillm.bench._embed",
    "bench_embed_backends": "unillm.bench._embed",
    "write_result": "unillm.bench._result",
    "read_result": "unillm.bench._result",
    "compare": "unillm.bench._result",
    "SCHEMA": "unillm.bench._result",
    "table": "unillm.bench._report",
    "plot": "unillm.bench._report",
    "BenchError": "unillm.bench._meta",
    "IncompleteResult": "unillm.bench._meta",
    "WorkloadMismatch": "unillm.bench._meta",
    "RequestRecord": "unillm.bench._metrics",
    "percentile": "unillm.bench._metrics",
}
__all__ = [
    "SCHEMA",
    "SLO",
    "Arrival",
    "BenchError",
    "BenchWorkload",
    "EmbedWorkload",
    "IncompleteResult",
    "Lengths",
    "RequestRecord",
    "Workload",
    "WorkloadMismatch",
    "bench_backends",
    "bench_embed",
    "bench_embed_backends",
    "bench_engine",
    "bench_url",
    "compare",
    "load_workload",
    "percentile",
    "plot",
    "read_result",
    "table",
    "write_result",
]

if TYPE_CHECKING:
    from unillm.bench._api import bench_backends, bench_engine, bench_url
    from unillm.bench._embed import bench_embed, bench_embed_backends
    from unillm.bench._meta import BenchError, IncompleteResult, WorkloadMismatch
    from unillm.bench._metrics import RequestRecord, percentile
    from unillm.bench._report import plot, table
    from unillm.bench._result import SCHEMA, compare, read_result, write_result
    from unillm.bench._workload import (
        SLO,
        Arrival,
        BenchWorkload,
        EmbedWorkload,
        Lengths,
        Workload,
        load_workload,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'unillm.bench' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return [*globals(), *_LAZY]
