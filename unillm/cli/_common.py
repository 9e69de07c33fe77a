"""What every ``unillm`` command shares: the argument and option types, the exit statuses, and
the one way output is printed and a user's mistake reported (see ``unillm.cli``)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

# Arguments the inspect / plan / select commands share.
ModelArg = Annotated[
    str, typer.Argument(help="A .gguf file, a model directory, or a name: org/name[@revision][:QUANT].")
]
ContextOpt = Annotated[int | None, typer.Option(help="Context length per sequence.")]
ConcurrencyOpt = Annotated[int, typer.Option(help="Sequences at once.")]
GoalOpt = Annotated[str, typer.Option(help="latency, throughput, cost or portability.")]
HardwareOpt = Annotated[
    Path | None,
    typer.Option(help="A hardware profile (JSON, or `unillm doctor --json` output); default: this machine."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
# ... and the ones generate and chat share.
RunModelArg = Annotated[
    str | None,
    typer.Argument(
        help="A .gguf file, a model directory or a name (org/name[:QUANT]); may be left out when "
        "--config or UNILLM_MODEL names one.",
        show_default=False,
    ),
]
BackendOpt = Annotated[str | None, typer.Option(help="Force a backend.")]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config", help="A TOML engine config; the flags here override it, UNILLM_* variables override both."
    ),
]
OptionOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--option",
        help="A backend load option KEY=VALUE (repeatable); VALUE is read as JSON when it parses, "
        "else as a string.",
    ),
]
RunContextOpt = Annotated[int | None, typer.Option("--context", help="Context window to allocate.")]
StopOpt = Annotated[
    list[str] | None, typer.Option("--stop", help="A string that ends the completion (repeatable).")
]
TemperatureOpt = Annotated[float, typer.Option(help="0 is greedy.")]
SeedOpt = Annotated[int | None, typer.Option(help="Sampling seed.")]

_EXIT_BAD_INPUT = 2  # click's own status for a usage error: every user mistake exits with it
_EXIT_DOES_NOT_FIT = 1  # `unillm plan`: the model does not fit (grep's "no match")


#: the width of a console that is no terminal (a pipe, a file): wide enough that a table's rows
#: stay one line each, so what is piped to grep or a file is whole (COLUMNS still sets it)
PIPE_WIDTH = 1000


def _console(*, stderr: bool = False) -> Any:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    isatty = getattr(stream, "isatty", None)
    piped = not (isatty and isatty()) and not os.environ.get("COLUMNS")
    return Console(stderr=stderr, width=PIPE_WIDTH if piped else None)


def _esc(text: object) -> str:
    """Text from data (install hints like ``unillm[vllm]``, errors) shown literally, not as markup."""
    from rich.markup import escape

    return escape(str(text))


def _fail(exc: BaseException) -> typer.Exit:
    """The one way a command reports a user's mistake: the error's type and message on stderr,
    literally (no markup, no wrapping inside the message)."""
    from unillm._errors import UnillmError

    text = str(exc)
    if isinstance(exc, OSError) and not isinstance(exc, UnillmError) and exc.strerror:
        name = str(exc.filename or "")  # the OS's own message repeats a path that may be huge
        text = f"{exc.strerror}: {name[:120] + '...' if len(name) > 120 else name!r}"
    _console(stderr=True).print(
        f"[bold red]error:[/] {type(exc).__name__}: {_esc(text)}", highlight=False, soft_wrap=True
    )
    return typer.Exit(_EXIT_BAD_INPUT)


@contextlib.contextmanager
def _reported() -> Iterator[None]:
    """Turn unillm's errors, and the OS's about a path the user gave, into ``_fail``."""
    from unillm import UnillmError

    try:
        yield
    except (UnillmError, OSError) as exc:
        raise _fail(exc) from exc


def _bad(message: str) -> typer.Exit:
    from unillm import ConfigError

    return _fail(ConfigError(message))


def _asdict(obj: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(obj)


def _dump(value: Any, *, indent: int | None = 2) -> None:
    import dataclasses
    import json

    def default(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.asdict(obj)
        if isinstance(obj, (set, frozenset)):  # a set is JSON's sorted list, not its repr
            return sorted(obj, key=str)
        return str(obj)

    print(json.dumps(value, default=default, indent=indent))
