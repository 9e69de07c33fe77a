"""The ``unillm`` command line. Everything here is a thin layer over the public API."""

from __future__ import annotations

import platform
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(
    help="unillm: one interface over local LLM inference engines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Arguments the inspect / plan / select commands share.
ModelArg = Annotated[str, typer.Argument(help="A .gguf file, a model directory or a cached HF id.")]
ContextOpt = Annotated[int | None, typer.Option(help="Context length per sequence.")]
ConcurrencyOpt = Annotated[int, typer.Option(help="Sequences at once.")]
GoalOpt = Annotated[str, typer.Option(help="latency, throughput, cost or portability.")]
HardwareOpt = Annotated[Path | None, typer.Option(help="A hardware profile (JSON); default: this machine.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]

testing_app = typer.Typer(help="Test fixtures: build the tiny models.", no_args_is_help=True)
app.add_typer(testing_app, name="testing")


def _console() -> Any:
    from rich.console import Console

    return Console()


def _esc(text: object) -> str:
    """Text from data (install hints like ``unillm[vllm]``, errors) shown literally, not as markup."""
    from rich.markup import escape

    return escape(str(text))


def _fail(exc: Exception) -> typer.Exit:
    _console().print(f"[bold red]error:[/] {type(exc).__name__}: {_esc(exc)}", highlight=False)
    return typer.Exit(2)


@app.command("backends")
def backends_cmd() -> None:
    """List every registered backend (built-in and plugin) and whether it runs here."""
    from rich.table import Table

    from unillm._plugins import default_registry

    reg = default_registry()
    table = Table("backend", "source", "formats", "available", "detail")
    for info in reg.backends().values():
        a = info.availability()
        detail = a.version or "" if a.available else f"{a.reason}; {a.install_hint or ''}"
        table.add_row(
            _esc(info.name),
            _esc(info.source),
            _esc(", ".join(sorted(info.cls.formats))),
            "[green]yes[/]" if a.available else "[red]no[/]",
            _esc(detail),
        )
    console = _console()
    console.print(table)
    for f in reg.failures:
        console.print(f"[yellow]plugin {_esc(repr(f.plugin))} skipped:[/] {_esc(f.reason)}")


@app.command()
def doctor(
    as_json: JsonOpt = False,
) -> None:
    """Check this machine: Python, hardware, installed engines, plugin failures."""
    from unillm._hardware import detect_hardware
    from unillm._plugins import default_registry

    hw = detect_hardware()
    if as_json:
        reg = default_registry()
        _dump(
            {
                "python": platform.python_version(),
                "hardware": hw,
                "backends": {n: i.availability() for n, i in reg.backends().items()},
                "plugin_failures": reg.failures,
            }
        )
        return
    console = _console()
    console.print(f"python   {platform.python_version()} ({sys.executable})")
    console.print(f"platform {platform.platform()}")
    for line in hw.summary_lines():
        console.print(_esc(line), highlight=False)
    backends_cmd()


def _workload(context: int | None, concurrency: int, goal: str) -> Any:
    from unillm._plan import Workload

    if goal not in ("latency", "throughput", "cost", "portability"):
        raise _fail(ValueError(f"unknown goal {goal!r}; use latency, throughput, cost or portability"))
    return Workload(context_length=context or 4096, concurrency=concurrency, goal=goal)  # type: ignore[arg-type]


def _hardware(profile: Path | None) -> Any:
    from unillm._hardware import detect_hardware, load_hardware

    return load_hardware(profile) if profile else detect_hardware()


def _dump(value: Any) -> None:
    import dataclasses
    import json

    def default(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.asdict(obj)
        return str(obj)

    print(json.dumps(value, default=default, indent=2))


@app.command("inspect")
def inspect_cmd(
    model: ModelArg,
    as_json: JsonOpt = False,
) -> None:
    """Read a model's format, quantization, size and shape from its headers (never its weights)."""
    from unillm import UnillmError
    from unillm._inspect import inspect_model

    try:
        info = inspect_model(model)
    except UnillmError as exc:
        raise _fail(exc) from exc
    if as_json:
        _dump(info)
        return
    for name, value in _fields(info):
        if value not in (None, (), False):
            print(f"{name:18s} {value}")
    kv = info.kv_bytes_per_token()
    if kv:
        print(f"{'kv bytes/token':18s} {kv} (f16)")


def _fields(obj: Any) -> list[tuple[str, Any]]:
    import dataclasses

    return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]


@app.command("plan")
def plan_cmd(
    model: ModelArg,
    context: ContextOpt = None,
    concurrency: ConcurrencyOpt = 1,
    goal: GoalOpt = "latency",
    hardware: HardwareOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Will MODEL fit, where, and how fast can decode be? (memory and bandwidth math)"""
    from unillm import UnillmError
    from unillm._inspect import inspect_model
    from unillm._plan import plan

    try:
        result = plan(inspect_model(model), _hardware(hardware), _workload(context, concurrency, goal))
    except UnillmError as exc:
        raise _fail(exc) from exc
    if as_json:
        _dump(result)
        return
    gib = 2**30
    print(f"weights   {result.weights_bytes / gib:8.2f} GiB")
    print(f"kv cache  {result.kv_bytes / gib:8.2f} GiB ({result.kv_bytes_per_token} bytes/token)")
    print(f"overhead  {result.overhead_bytes / gib:8.2f} GiB")
    print(
        f"total     {result.total_bytes / gib:8.2f} GiB: {'fits' if result.fits else 'does NOT fit'}, "
        f"headroom {result.headroom_bytes / gib:.2f} GiB"
    )
    for p in result.placements:
        print(f"  {p.device}: weights {p.weights_bytes / gib:.2f} GiB, kv {p.kv_bytes / gib:.2f} GiB")
    if result.gpu_layers is not None:
        print(f"gpu layers {result.gpu_layers}")
    if result.decode_tokens_per_s_ceiling:
        print(f"decode ceiling {result.decode_tokens_per_s_ceiling:.0f} tok/s per sequence")
    for note in result.notes:
        print(f"note: {note}")


@app.command("select")
def select_cmd(
    model: ModelArg,
    context: ContextOpt = None,
    concurrency: ConcurrencyOpt = 1,
    goal: GoalOpt = "latency",
    hardware: HardwareOpt = None,
    explain: Annotated[bool, typer.Option(help="Print every candidate and the ten questions.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Which backend should run MODEL here, and why."""
    from unillm import UnillmError
    from unillm._inspect import inspect_model
    from unillm._plan import plan
    from unillm._plugins import default_registry
    from unillm._select import select

    try:
        info = inspect_model(model)
        hw = _hardware(hardware)
        wl = _workload(context, concurrency, goal)
        backends = default_registry().backends()
        available = {n: b.availability() for n, b in backends.items()}
        result = select(hw, info, wl, backends, available=available, plan=plan(info, hw, wl))
    except UnillmError as exc:
        raise _fail(exc) from exc
    if as_json:
        _dump(result)
    elif explain:
        print(result.explain())
    else:
        print(result.backend or f"none installed; {result.recommendation}")


@app.command()
def generate(
    model: Annotated[str, typer.Argument(help="A .gguf file or a model directory.")],
    prompt: Annotated[str, typer.Argument(help="The prompt text.")],
    backend: Annotated[str | None, typer.Option(help="Force a backend.")] = None,
    max_tokens: Annotated[int, typer.Option(help="Most new tokens.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.8,
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    explain: Annotated[bool, typer.Option(help="Print why the backend was chosen.")] = False,
) -> None:
    """Stream a completion of PROMPT."""
    from unillm import UnillmError, auto_engine

    try:
        with auto_engine(model, backend=backend) as engine:
            if explain and engine.selection:
                print(engine.selection.explain(), file=sys.stderr)
            _print_stream(engine.stream(prompt, max_tokens=max_tokens, temperature=temperature, seed=seed))
    except UnillmError as exc:
        raise _fail(exc) from exc


@app.command()
def chat(
    model: Annotated[str, typer.Argument(help="A .gguf file or a model directory.")],
    message: Annotated[str | None, typer.Option("-m", "--message", help="One message; else a REPL.")] = None,
    system: Annotated[str | None, typer.Option(help="A system prompt.")] = None,
    backend: Annotated[str | None, typer.Option(help="Force a backend.")] = None,
    max_tokens: Annotated[int, typer.Option(help="Most new tokens per reply.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.8,
) -> None:
    """Chat with MODEL using its own chat template."""
    from unillm import UnillmError, auto_engine

    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    try:
        with auto_engine(model, backend=backend) as engine:
            while True:
                text = message if message is not None else _ask()
                if text is None:
                    return
                history.append({"role": "user", "content": text})
                reply = _print_stream(
                    engine.stream_chat(history, max_tokens=max_tokens, temperature=temperature)
                )
                history.append({"role": "assistant", "content": reply})
                if message is not None:
                    return
    except UnillmError as exc:
        raise _fail(exc) from exc


def _ask() -> str | None:
    try:
        return input("> ")
    except EOFError:
        return None


def _print_stream(chunks: Any) -> str:
    parts = []
    last = None
    for last in chunks:
        parts.append(last.text)
        sys.stdout.write(last.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if last is not None and last.usage and last.timings:
        t = last.timings
        rate = f"{t.decode_tokens_per_s:.1f} tok/s" if t.decode_tokens_per_s else "n/a"
        print(
            f"[{last.finish_reason}; {last.usage.prompt_tokens} prompt + {last.usage.completion_tokens} "
            f"completion tokens; TTFT {t.ttft_s * 1000:.1f} ms; decode {rate}]",
            file=sys.stderr,
        )
    return "".join(parts)


@app.command()
def demo(
    size: Annotated[str, typer.Option(help="Tiny model size: small or bench.")] = "small",
) -> None:
    """Run unillm end to end on a tiny model built on first use (no download)."""
    from unillm._demo import run_demo

    run_demo(size)


@testing_app.command("build-tiny")
def build_tiny(
    directory: Annotated[Path, typer.Argument(help="Where to write hf/ and the .gguf file.")],
    size: Annotated[str, typer.Option(help="small (~2 MB) or bench (~50 MB).")] = "small",
    force: Annotated[bool, typer.Option(help="Rebuild even if present.")] = False,
) -> None:
    """Build the deterministic tiny Llama as an HF directory and a GGUF."""
    from unillm.testing import SIZES, build_tiny_model

    if size not in SIZES:
        raise _fail(ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}"))
    model = build_tiny_model(directory, size, force=force)  # type: ignore[arg-type]
    print(f"hf directory: {model.hf_dir}\ngguf:         {model.gguf_path}")


def main() -> None:
    """Entry point of the ``unillm`` script."""
    app()


if __name__ == "__main__":
    main()
