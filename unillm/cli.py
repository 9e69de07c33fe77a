"""The ``unillm`` command line. Everything here is a thin layer over the public API."""

from __future__ import annotations

import os
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
testing_app = typer.Typer(help="Test fixtures: build the tiny models.", no_args_is_help=True)
app.add_typer(testing_app, name="testing")


def _console() -> Any:
    from rich.console import Console

    return Console()


def _fail(exc: Exception) -> typer.Exit:
    _console().print(f"[bold red]error:[/] {type(exc).__name__}: {exc}", highlight=False)
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
            info.name,
            info.source,
            ", ".join(sorted(info.cls.formats)),
            "[green]yes[/]" if a.available else "[red]no[/]",
            detail,
        )
    console = _console()
    console.print(table)
    for f in reg.failures:
        console.print(f"[yellow]plugin {f.plugin!r} skipped:[/] {f.reason}")


@app.command()
def doctor() -> None:
    """Check this machine: Python, memory, installed engines, plugin failures."""
    console = _console()
    console.print(f"python   {platform.python_version()} ({sys.executable})")
    console.print(f"platform {platform.platform()} {platform.machine()}, {os.cpu_count()} CPUs")
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        console.print(f"memory   {mem / 2**30:.1f} GiB")
    except (ValueError, OSError, AttributeError):
        console.print("memory   unknown")
    backends_cmd()


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
