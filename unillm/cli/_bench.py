"""``unillm bench``: benchmark engines in-process or a server over HTTP; ``unillm bench compare``.

``unillm bench MODEL --backends llama.cpp,mlx`` runs one workload on each backend (each in its own
format of the model's weights), writes one JSON result per backend, prints the table and draws
the plots. ``unillm bench --url URL --model-path DIR`` does the same for an OpenAI-compatible
server; ``unillm bench MODEL --servers llama-cpp-python,xllamacpp`` starts ``unillm serve``
and those engines' own servers on the model and runs the workload on each, levels interleaved.
``unillm bench compare a.json b.json`` puts results side by side.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from typer.core import TyperGroup

from unillm.cli._common import _bad, _console, _reported

__all__ = ["bench_app"]

_EXIT_INTERRUPTED = 130  # the shell's status for a command ended by Ctrl-C: what was measured is written


class _RunByDefault(TyperGroup):
    """``unillm bench MODEL ...`` means ``unillm bench run MODEL ...``."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        elif not args:
            args = ["run"]
        return super().parse_args(ctx, args)


bench_app = typer.Typer(
    cls=_RunByDefault,
    help="Benchmark engines (in-process, side by side) or an OpenAI-compatible URL; compare results. "
    "`unillm bench MODEL ...` is `unillm bench run MODEL ...`.",
)


def _ints(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise _bad(f"{what} takes comma-separated whole numbers, got {text!r}") from None


def _floats(text: str | None, what: str) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise _bad(f"{what} takes comma-separated numbers, got {text!r}") from None


def _progress() -> tuple[Any, Any]:
    """A rich progress bar on a terminal's stderr (and its callback); (None, None) elsewhere."""
    console = _console(stderr=True)
    if not console.is_terminal:
        return None, None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
    tasks: dict[str, Any] = {}

    def update(level: str, done: int, total: int | None) -> None:
        if level not in tasks:
            tasks[level] = bar.add_task(level, total=total)
        bar.update(tasks[level], completed=done)

    return bar, update


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower() or "x"


@bench_app.command("run")
def run_cmd(
    model: Annotated[
        str | None, typer.Argument(help="A .gguf file, an HF directory, or a directory holding both.")
    ] = None,
    backends: Annotated[
        str | None, typer.Option(help="Comma-separated backends to run side by side.")
    ] = None,
    task: Annotated[
        Literal["generate", "embed"],
        typer.Option(help="What to measure: generation, or embeddings (engine.embed by batch size)."),
    ] = "generate",
    url: Annotated[str | None, typer.Option(help="An OpenAI-compatible server to benchmark instead.")] = None,
    servers: Annotated[
        str | None,
        typer.Option(
            help="Compare `unillm serve` on MODEL with engines' own servers, started here on loopback: "
            "comma-separated llama-cpp-python, xllamacpp, mlx-lm, vllm."
        ),
    ] = None,
    peer_python: Annotated[
        str | None,
        typer.Option(
            help="--servers: a Python for the peers this one cannot run (xllamacpp's own environment)."
        ),
    ] = None,
    parallel: Annotated[
        int, typer.Option(min=1, help="--servers: sequences decoded together where a server batches.")
    ] = 8,
    workload: Annotated[
        Path | None, typer.Option(help="A workload file (TOML, or Python defining WORKLOAD).")
    ] = None,
    requests: Annotated[
        int | None, typer.Option(help="Requests per level; --task embed: calls per batch size.")
    ] = None,
    duration: Annotated[
        float | None, typer.Option(help="Seconds per level, instead of a request count.")
    ] = None,
    concurrency: Annotated[str | None, typer.Option(help="Concurrency levels, e.g. 1,4,16.")] = None,
    rate: Annotated[
        str | None, typer.Option(help="Request rates per second (Poisson arrivals), e.g. 2,8.")
    ] = None,
    input_len: Annotated[
        int | None, typer.Option(help="Prompt tokens (fixed); --task embed: each text's.")
    ] = None,
    batch_sizes: Annotated[
        str | None, typer.Option(help="--task embed: texts per call, one level each (default 1,8,32).")
    ] = None,
    output_len: Annotated[int | None, typer.Option(help="Output tokens (fixed).")] = None,
    stream: Annotated[bool | None, typer.Option("--stream/--no-stream", help="Stream responses.")] = None,
    chat: Annotated[bool, typer.Option(help="Send chat requests instead of completions.")] = False,
    structured: Annotated[bool, typer.Option(help="Ask for JSON output under a small schema.")] = False,
    warmup: Annotated[int | None, typer.Option(help="Unmeasured requests before each level.")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of the prompts and arrivals.")] = None,
    context: Annotated[int | None, typer.Option(help="Context window to load engines with.")] = None,
    model_path: Annotated[
        Path | None, typer.Option(help="--url: the served model's files here (metadata, tokenizer).")
    ] = None,
    tokenizer: Annotated[Path | None, typer.Option(help="--url: an HF directory or tokenizer.json.")] = None,
    served_model: Annotated[str | None, typer.Option(help="--url: the model name to send.")] = None,
    engine: Annotated[str | None, typer.Option(help="--url: the server's engine name.")] = None,
    engine_version: Annotated[str | None, typer.Option(help="--url: the server's engine version.")] = None,
    price_per_hour: Annotated[
        float | None, typer.Option(help="$/hour of the machine, for cost per 1M tokens.")
    ] = None,
    out: Annotated[Path, typer.Option(help="Directory for the JSON results and plots.")] = Path(
        "bench-results"
    ),
    plots: Annotated[
        bool, typer.Option("--plots/--no-plots", help="Draw PNG plots (needs matplotlib).")
    ] = True,
    interleave: Annotated[
        bool,
        typer.Option(help="Load every backend; run each level on each in turn (fairer on a shared machine)."),
    ] = False,
    option: Annotated[
        list[str] | None,
        typer.Option(
            "--option",
            help="A backend's load option, BACKEND:KEY=VALUE (KEY=VALUE with one backend), repeatable.",
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            help="An engine config (TOML) whose options and [backend_options.<name>] tables load the engines."
        ),
    ] = None,
) -> None:
    """Run a benchmark; one JSON result per engine under --out, the table on stdout.

    Ctrl-C ends it early: what was measured is written, marked partial, and the exit status is 130.
    """
    from unillm.bench._api import bench_backends, bench_url
    from unillm.bench._report import plot, table
    from unillm.bench._result import write_result
    from unillm.bench._workload import BenchWorkload, load_workload

    if task == "embed":
        _embed_only(model, url=url, servers=servers, workload=workload, duration=duration,
                    concurrency=concurrency, rate=rate, output_len=output_len, stream=stream,
                    chat=chat or None, structured=structured or None, interleave=interleave or None,
                    price_per_hour=price_per_hour)  # fmt: skip
    elif batch_sizes is not None:
        raise _bad("--batch-sizes goes with --task embed")
    if (model is None) == (url is None):
        raise _bad("give a MODEL (with --backends or --servers) or --url, one of them")
    if (option or config) and (url is not None or servers is not None):
        raise _bad(
            "--option and --config load engines here: with MODEL (and --backends), not --url or --servers"
        )
    if servers is not None and (backends is not None or url is not None):
        raise _bad("--servers compares servers on MODEL: not with --backends or --url")
    with _reported():
        if task == "embed":
            from unillm.bench._workload import EmbedWorkload

            sizes = _ints(batch_sizes, "--batch-sizes")
            given: dict[str, Any] = {"requests": requests, "input_len": input_len, "warmup": warmup,
                                     "seed": seed, "batch_sizes": sizes}  # fmt: skip
            ewl = EmbedWorkload(**{k: v for k, v in given.items() if v is not None})
        else:
            base = load_workload(workload).as_dict() if workload else {}
            overrides: dict[str, Any] = {
                "requests": requests,
                "duration_s": duration,
                "concurrency": _ints(concurrency, "--concurrency"),
                "rates": _floats(rate, "--rate"),
                "input_len": input_len,
                "output_len": output_len,
                "stream": stream,
                "warmup": warmup,
                "seed": seed,
            }
            if chat:
                overrides["mode"] = "chat"
            if structured:
                overrides["structured"] = True
            if overrides["rates"] and "arrival" not in base:
                overrides["arrival"] = {"process": "poisson"}
            if duration is not None and requests is None:
                base.pop("requests", None)
            wl = BenchWorkload(**{**base, **{k: v for k, v in overrides.items() if v is not None}})
        bar, update = _progress()
        if bar is not None:
            bar.start()
        try:
            if task == "embed":
                from unillm.bench._embed import bench_embed_backends

                assert model is not None
                chosen: list[str | None] = [b.strip() for b in (backends or "").split(",") if b.strip()]
                options, tables = _bench_options(option, config, chosen)
                results = bench_embed_backends(
                    model, chosen or [None], ewl, context_length=context, progress=update,
                    options=options, backend_options=tables,
                )  # fmt: skip
            elif servers is not None:
                from unillm.bench._servers import bench_servers

                assert model is not None
                peers = [s.strip() for s in servers.split(",") if s.strip()]
                results = bench_servers(
                    model, peers, wl, context_length=context, parallel=parallel, peer_python=peer_python,
                    price_per_hour=price_per_hour, progress=update,
                )  # fmt: skip
            elif url is not None:
                results = [
                    bench_url(
                        url, wl, model=served_model, model_path=model_path, tokenizer=tokenizer,
                        engine_name=engine, engine_version=engine_version, price_per_hour=price_per_hour,
                        progress=update,
                    )
                ]  # fmt: skip
            else:
                assert model is not None
                names: list[str | None] = [b.strip() for b in (backends or "").split(",") if b.strip()]
                options, tables = _bench_options(option, config, names)
                results = bench_backends(
                    model,
                    names or [None],
                    wl,
                    context_length=context,
                    price_per_hour=price_per_hour,
                    progress=update,
                    interleave=interleave,
                    options=options,
                    backend_options=tables,
                )
        finally:
            if bar is not None:
                bar.stop()
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        for result in results:
            meta = result["metadata"]
            engine_name = meta["engine"]["name"] or "server"
            name = f"bench-{_slug(meta['model']['name'])}-{_slug(engine_name)}-{stamp}.json"
            path = write_result(result, out / name)
            note = " (partial: interrupted)" if result["partial"] else ""
            _console(stderr=True).print(f"wrote {path}{note}", highlight=False)
        print(table(results))
        if servers is not None:
            from unillm.bench._servers import ratios

            for line in ratios(results):
                print(line)
        for result in results:
            if not result.get("output_lengths", {"enforced": True})["enforced"]:
                how = result["output_lengths"]["how"]
                print(f"note: {result['metadata']['engine']['name']}: output lengths {how}")
        if plots:
            for path in plot(results, out, stem=f"bench-{stamp}"):
                _console(stderr=True).print(f"wrote {path}", highlight=False)
    if any(r["partial"] for r in results):
        raise typer.Exit(_EXIT_INTERRUPTED)


def _embed_only(model: str | None, **given: Any) -> None:
    """``--task embed`` runs MODEL's engines here, by batch size: the flags that shape generation
    (or a server's run) do not apply, and are refused rather than ignored."""
    flags = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is not None]
    if flags:
        raise _bad(f"{', '.join(flags)} do{'es' * (len(flags) == 1)} not go with --task embed, which "
                   "calls engine.embed here on MODEL by batch size (--batch-sizes, --input-len, "
                   "--requests)")  # fmt: skip
    if model is None:
        raise _bad("--task embed benchmarks MODEL's engines in this process: give MODEL")


@bench_app.command("compare")
def compare_cmd(
    results: Annotated[list[Path], typer.Argument(help="Result files (JSON) to put side by side.")],
    force: Annotated[bool, typer.Option(help="Compare results whose workloads differ.")] = False,
    plots: Annotated[Path | None, typer.Option(help="Also draw the plots into this directory.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the flags as JSON.")] = False,
) -> None:
    """Put results side by side; refuses different workloads unless --force, and flags engine,
    driver, model or unillm version changes between runs (re-test after upgrades)."""
    from unillm.bench._report import plot, table
    from unillm.bench._result import compare, read_result

    with _reported():
        loaded = [read_result(p) for p in results]
        notes = compare(loaded, force=force)
    if as_json:
        print(json.dumps({"flags": notes}))
    else:
        print(table(loaded))
        for note in notes:
            print(f"flag: {note}")
    if plots is not None:
        for path in plot(loaded, plots, stem="compare"):
            _console(stderr=True).print(f"wrote {path}", highlight=False)


def _bench_options(
    pairs: list[str] | None, config: Path | None, names: list[str | None]
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(options for every backend, tables per backend) from --config's file and the --option
    flags; ``BACKEND:KEY=VALUE`` goes to that backend's table, a bare ``KEY=VALUE`` to every
    backend, which only one backend can take (another backend would refuse an option it lacks)."""
    from unillm._types import normalize_name
    from unillm.cli._run import _parse_options

    options: dict[str, Any] = {}
    tables: dict[str, dict[str, Any]] = {}
    if config is not None:
        from unillm import read_config

        cfg = read_config(config)
        options.update(cfg.options)
        tables = {k: dict(v) for k, v in cfg.backend_options.items()}
    known = {normalize_name(n): n for n in names if n}
    for pair in pairs or ():
        head, sep, rest = pair.partition(":")
        if sep and "=" not in head:  # BACKEND:KEY=VALUE
            name = known.get(normalize_name(head), head)
            tables.setdefault(name, {}).update(_parse_options([rest]))
        elif len(names) > 1:
            raise _bad(
                f"--option {pair!r} names no backend, and {len(names)} run: write BACKEND:KEY=VALUE, "
                f"e.g. --option {names[0]}:{pair}"
            )
        else:
            options.update(_parse_options([pair]))
    return options, tables
