"""The ``unillm`` command line. Everything here is a thin layer over the public API.

Every command reports a user's mistake (a bad path, option or profile) the same way: one
``error: Type: message`` line on stderr, the message printed literally, and exit status 2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Annotated

import typer

from unillm.cli._bench import bench_app
from unillm.cli._common import _console, _esc
from unillm.cli._demo import build_tiny, demo
from unillm.cli._doctor import backends_cmd, doctor
from unillm.cli._embed import embed
from unillm.cli._models import models_cmd, pull, rm
from unillm.cli._plan import inspect_cmd, plan_cmd, select_cmd
from unillm.cli._run import chat, generate
from unillm.cli._serve import serve

app = typer.Typer(
    help="unillm: one interface over local LLM inference engines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

testing_app = typer.Typer(help="Test fixtures: build the tiny models.", no_args_is_help=True)
app.add_typer(testing_app, name="testing")


def _version(value: bool) -> None:
    if value:
        from unillm import __version__

        print(f"unillm {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    ctx: typer.Context,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    # Warnings read as one line each ("warning: ...") for the length of the command, not as
    # Python's "file:line: Category: message" followed by the warn() call's source line.
    ctx.with_resource(_readable_warnings())


@contextlib.contextmanager
def _readable_warnings() -> Iterator[None]:
    import warnings

    def show(message: Warning | str, category: type[Warning], *_: object, **__: object) -> None:
        kind = "" if category.__module__.startswith("unillm") else f"{category.__name__}: "
        _console(stderr=True).print(
            f"[yellow]warning:[/] {kind}{_esc(message)}", highlight=False, soft_wrap=True
        )

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


# The commands, each in the module of its group, registered in the order `unillm --help` lists them.
app.command("backends")(backends_cmd)
app.command()(doctor)
app.command("inspect")(inspect_cmd)
app.command("plan")(plan_cmd)
app.command("select")(select_cmd)
app.command()(generate)
app.command()(chat)
app.command()(embed)
app.command()(serve)
app.command()(pull)
app.command("models")(models_cmd)
app.command()(rm)
app.add_typer(bench_app, name="bench")
app.command()(demo)
testing_app.command("build-tiny")(build_tiny)


def main() -> None:
    """Entry point of the ``unillm`` script."""
    app()


if __name__ == "__main__":
    main()
