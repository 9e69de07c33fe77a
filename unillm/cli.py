"""The ``unillm`` command line. Everything here is a thin layer over the public API.

Every command reports a user's mistake (a bad path, option or profile) the same way: one
``error: Type: message`` line on stderr, the message printed literally, and exit status 2.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from unillm._engine import Engine
    from unillm._hardware import Hardware
    from unillm._plan import Workload
    from unillm._select import Selection
    from unillm._types import Availability, Completion, EngineConfig, SamplingParams

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
HardwareOpt = Annotated[
    Path | None,
    typer.Option(help="A hardware profile (JSON, or `unillm doctor --json` output); default: this machine."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
# ... and the ones generate and chat share.
RunModelArg = Annotated[
    str | None,
    typer.Argument(
        help="A .gguf file or a model directory; may be left out when --config or UNILLM_MODEL names one.",
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

testing_app = typer.Typer(help="Test fixtures: build the tiny models.", no_args_is_help=True)
app.add_typer(testing_app, name="testing")

_EXIT_BAD_INPUT = 2  # click's own status for a usage error: every user mistake exits with it
_EXIT_DOES_NOT_FIT = 1  # `unillm plan`: the model does not fit (grep's "no match")


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


def _console(*, stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(stderr=stderr)


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


@app.command("backends")
def backends_cmd(as_json: JsonOpt = False) -> None:
    """List every registered backend (built-in and plugin) and whether it runs here."""
    from rich.table import Table

    from unillm._plugins import default_registry

    reg = default_registry()
    if as_json:
        rows = {}
        for name, info in reg.backends().items():
            a = info.availability()
            rows[name] = {"source": info.source, "formats": sorted(info.cls.formats), **_asdict(a)}
        _dump({"backends": rows, "plugin_failures": reg.failures})
        return
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
def doctor(as_json: JsonOpt = False) -> None:
    """Check this machine: Python, hardware, installed engines, plugin failures.

    The --json output is also a hardware profile: `unillm select MODEL --hardware FILE` judges
    the machine it describes, its installed backends included.
    """
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
    backends_cmd(as_json=False)


def _workload(context: int | None, concurrency: int, goal: str) -> Workload:
    import typing

    from unillm._plan import Workload

    goals = typing.get_args(typing.get_type_hints(Workload)["goal"])
    if goal not in goals:
        raise _bad(f"unknown goal {goal!r}; use one of {', '.join(goals)}")
    if context is not None and context < 1:
        raise _bad(f"--context must be a positive number of tokens, not {context}")
    if concurrency < 1:
        raise _bad(f"--concurrency must be at least 1 (sequences at once), not {concurrency}")
    return Workload(context_length=context or 4096, concurrency=concurrency, goal=goal)  # type: ignore[arg-type]


def _hardware(profile: Path | None) -> Hardware:
    from unillm._hardware import detect_hardware, load_hardware

    return load_hardware(profile) if profile else detect_hardware()


def _profile_availability(profile: Path, registered: Iterable[str]) -> dict[str, Availability] | None:
    """The backends installed on a profile's machine, when the profile says (``doctor --json``
    lists them; one registered here but not listed there is not installed there); None for a
    hand-written profile, where every registered backend counts as installed."""
    import json

    from unillm._types import Availability

    data = json.loads(profile.read_text(encoding="utf-8"))  # load_hardware has read it already
    listed = data.get("backends") if "hardware" in data else None
    if listed is None:
        return None
    if not isinstance(listed, dict):
        raise _bad(f"{str(profile)!r}: backends must map each backend's name to its availability")
    out = {name: Availability(False, "not installed on the profile's machine") for name in registered}
    for name, entry in listed.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("available"), bool):
            raise _bad(f"{str(profile)!r}: backends.{name} is not an availability record")
        out[name] = Availability(
            entry["available"],
            str(entry.get("reason") or ""),
            entry.get("install_hint") or None,
            entry.get("version") or None,
        )
    return out


def _select(info: Any, hw: Hardware | None, wl: Workload, available: Any) -> Selection:
    from unillm._plan import plan
    from unillm._plugins import default_registry
    from unillm._select import select

    the_plan = plan(info, hw, wl) if hw is not None else None
    return select(hw, info, wl, default_registry().backends(), available=available, plan=the_plan)


def _asdict(obj: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(obj)


def _dump(value: Any, *, indent: int | None = 2) -> None:
    import dataclasses
    import json

    def default(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.asdict(obj)
        return str(obj)

    print(json.dumps(value, default=default, indent=indent))


@app.command("inspect")
def inspect_cmd(
    model: ModelArg,
    as_json: JsonOpt = False,
) -> None:
    """Read a model's format, quantization, size and shape from its headers (never its weights)."""
    from unillm._inspect import inspect_model

    with _reported():
        info = inspect_model(model)
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
    """Will MODEL fit, where, and how fast can decode be? (memory and bandwidth math)

    Exit status: 0 when it fits, 1 when it does not, 2 on bad input.
    """
    from unillm._inspect import inspect_model
    from unillm._plan import plan

    wl = _workload(context, concurrency, goal)
    with _reported():
        result = plan(inspect_model(model), _hardware(hardware), wl)
    if as_json:
        _dump(result)
    else:
        _print_plan(result)
    if not result.fits:
        raise typer.Exit(_EXIT_DOES_NOT_FIT)


def _print_plan(result: Any) -> None:
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
    """Which backend should run MODEL here (or on the --hardware machine), and why.

    With --hardware the choice is the profile machine's: the backends a `doctor --json` profile
    lists as installed, or every registered backend for a hand-written profile, as
    `unillm.select()` does; without it, this machine and the backends installed here.
    """
    from unillm._inspect import inspect_model
    from unillm._plugins import default_registry

    wl = _workload(context, concurrency, goal)
    with _reported():
        info = inspect_model(model)
        hw = _hardware(hardware)
        if hardware is not None:
            available = _profile_availability(hardware, default_registry().backends())
        else:
            available = {n: b.availability() for n, b in default_registry().backends().items()}
        result = _select(info, hw, wl, available)
    if as_json:
        _dump(result)
    elif explain:
        print(result.explain())
    else:
        print(result.backend or f"none installed; {result.recommendation}")


def _parse_options(pairs: list[str] | None) -> dict[str, Any]:
    import json

    options: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise _bad(f"--option takes KEY=VALUE, e.g. --option n_threads=4; got {pair!r}")
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text  # a bare word such as q8_0 is the string it reads as
        options[key.strip()] = value
    return options


def _open_engine(
    model: str | None,
    *,
    config: Path | None,
    backend: str | None,
    context: int | None,
    options: list[str] | None,
) -> Engine[Any]:
    """Load the engine the command line describes: --config, then the flags, then UNILLM_*."""
    from unillm import load_engine, read_config

    opts = _parse_options(options)
    with _reported():
        cfg = read_config(
            str(config) if config else None,
            model=model,
            backend=backend,
            context_length=context,
            options=opts or None,
        )
        with _loading(cfg):
            return load_engine(cfg)


@contextlib.contextmanager
def _loading(cfg: EngineConfig) -> Iterator[None]:
    """A spinner on stderr while the engine starts (vLLM takes 30-60 s), only on a terminal: a
    log file or a pipe gets nothing."""
    isatty = getattr(sys.stderr, "isatty", None)
    if not (isatty and isatty()):
        yield
        return
    from rich.console import Console

    # the environment (FORCE_COLOR, TTY_COMPATIBLE) must not turn a pipe into a terminal, nor
    # the reverse: the check above decides
    console = Console(stderr=True, force_terminal=True)
    with console.status(f"loading {_esc(cfg.model)} with {_esc(cfg.backend or _likely_backend(cfg))}..."):
        yield


def _likely_backend(cfg: EngineConfig) -> str:
    """The backend auto_engine will try first, found the way it finds it (headers only)."""
    from unillm._auto import _machine, _workload
    from unillm._inspect import inspect_model
    from unillm._plugins import default_registry

    try:
        available = {n: b.availability() for n, b in default_registry().backends().items()}
        info = inspect_model(cfg.model)
        chosen = _select(info, _machine(), _workload(cfg, info), available).backend
    except Exception:  # only a label: the load reports the real problem
        chosen = ""
    return chosen or "the best installed backend"


def _model_and_prompt(model: str | None, prompt: str | None, config: Path | None) -> tuple[str | None, str]:
    """``generate PROMPT`` when --config or UNILLM_MODEL names the model, else ``MODEL PROMPT``."""
    if prompt is not None:
        return model, prompt
    if model is not None and (config is not None or os.environ.get("UNILLM_MODEL")):
        return None, model
    raise _bad("give MODEL and PROMPT (MODEL may be left out when --config or UNILLM_MODEL names one)")


@app.command()
def generate(
    model: RunModelArg = None,
    prompt: Annotated[str | None, typer.Argument(help="The prompt text.", show_default=False)] = None,
    backend: BackendOpt = None,
    config: ConfigOpt = None,
    option: OptionOpt = None,
    context: RunContextOpt = None,
    max_tokens: Annotated[int, typer.Option(help="Most new tokens.")] = 128,
    temperature: TemperatureOpt = 0.8,
    seed: SeedOpt = None,
    stop: StopOpt = None,
    explain: Annotated[bool, typer.Option(help="Print why the backend was chosen (stderr).")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object: text, token ids, usage, timings.")
    ] = False,
) -> None:
    """Stream a completion of PROMPT."""
    model, text = _model_and_prompt(model, prompt, config)
    params = _sampling(max_tokens=max_tokens, temperature=temperature, seed=seed, stop=stop)
    engine = _open_engine(model, config=config, backend=backend, context=context, options=option)
    with _reported(), engine:
        if explain and engine.selection:
            print(engine.selection.explain(), file=sys.stderr)
        if as_json:
            _dump(_completion_record(engine, engine.generate(text, params)))
        else:
            _print_stream(engine.stream(text, params))


def _sampling(
    *, max_tokens: int, temperature: float, seed: int | None, stop: list[str] | None
) -> SamplingParams:
    """The request's sampling, checked before an engine is started (vLLM's start takes a minute)."""
    from unillm import SamplingParams

    with _reported():
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=seed, stop=tuple(stop or ())
        )


def _completion_record(engine: Engine[Any], c: Completion) -> dict[str, Any]:
    return {
        "backend": engine.name,
        "model": engine.config.model,
        "text": c.text,
        "token_ids": list(c.token_ids),
        "finish_reason": c.finish_reason,
        "usage": {**_asdict(c.usage), "total_tokens": c.usage.total_tokens},
        "timings": c.timings,
        "logprobs": c.logprobs,
    }


@app.command()
def chat(
    model: RunModelArg = None,
    message: Annotated[str | None, typer.Option("-m", "--message", help="One message; else a REPL.")] = None,
    system: Annotated[str | None, typer.Option(help="A system prompt.")] = None,
    backend: BackendOpt = None,
    config: ConfigOpt = None,
    option: OptionOpt = None,
    context: RunContextOpt = None,
    max_tokens: Annotated[int, typer.Option(help="Most new tokens per reply.")] = 256,
    temperature: TemperatureOpt = 0.8,
    seed: SeedOpt = None,
    stop: StopOpt = None,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Print each reply as one JSON line (text, token ids, usage, ...)."),
    ] = False,
) -> None:
    """Chat with MODEL using its own chat template.

    In the REPL, /reset starts the conversation over (and empties the engine's KV cache), /exit,
    Ctrl-D or Ctrl-C quits.
    """
    base: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    params = _sampling(max_tokens=max_tokens, temperature=temperature, seed=seed, stop=stop)
    engine = _open_engine(model, config=config, backend=backend, context=context, options=option)
    with _reported(), engine:
        if message is not None:
            _reply(engine, [*base, {"role": "user", "content": message}], params, as_json)
            return
        _repl(engine, base, params, as_json)


_REPL_HELP = "/reset starts over, /exit (or Ctrl-D) quits"


def _repl(engine: Engine[Any], base: list[dict[str, str]], params: SamplingParams, as_json: bool) -> None:
    console = _console(stderr=True)
    console.print(f"chatting with {_esc(engine.config.model)} on {_esc(engine.name)}: {_REPL_HELP}")
    history = list(base)
    while True:
        text = _ask(as_json)
        if text is None or text.strip() in ("/exit", "/quit"):
            return
        if text.strip() == "/reset":
            history = list(base)
            engine.reset()
            console.print("(history cleared)")
            continue
        if text.strip() == "/help":
            console.print(_REPL_HELP)
            continue
        if not text.strip():
            continue
        history.append({"role": "user", "content": text})
        try:
            reply = _reply(engine, history, params, as_json)
        except KeyboardInterrupt:  # Ctrl-C stops this reply, not the session
            history.pop()
            console.print("\n(interrupted)")
            continue
        history.append({"role": "assistant", "content": reply})


def _reply(engine: Engine[Any], history: list[dict[str, str]], params: SamplingParams, as_json: bool) -> str:
    if as_json:
        completion = engine.chat(history, params)
        _dump(_completion_record(engine, completion), indent=None)
        return completion.text
    return _print_stream(engine.stream_chat(history, params))


def _ask(as_json: bool) -> str | None:
    """The next line typed, or None at end of input or on Ctrl-C at the prompt."""
    try:
        if as_json:  # stdout carries only the JSON lines
            sys.stderr.write("> ")
            sys.stderr.flush()
            return input()
        return input("> ")
    except (EOFError, KeyboardInterrupt):
        sys.stderr.write("\n")
        return None


def _print_stream(chunks: Any) -> str:
    parts = []
    last = None
    # closed on the way out, so a reply interrupted between two chunks cancels its request
    with contextlib.closing(chunks) if hasattr(chunks, "close") else contextlib.nullcontext():
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


def _size(size: str) -> str:
    from unillm.testing import SIZES

    if size not in SIZES:
        raise _bad(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    return size


@app.command()
def demo(
    size: Annotated[str, typer.Option(help="Tiny model size: small or bench.")] = "small",
) -> None:
    """Run unillm end to end on a tiny model built on first use (no download)."""
    from unillm._demo import run_demo

    size = _size(size)
    with _reported():
        run_demo(size)


@testing_app.command("build-tiny")
def build_tiny(
    directory: Annotated[Path, typer.Argument(help="Where to write hf/ and the .gguf file.")],
    size: Annotated[str, typer.Option(help="small (~2 MB) or bench (~50 MB).")] = "small",
    force: Annotated[bool, typer.Option(help="Rebuild even if present.")] = False,
) -> None:
    """Build the deterministic tiny Llama as an HF directory and a GGUF."""
    from unillm.testing import build_tiny_model

    size = _size(size)
    with _reported():
        model = build_tiny_model(directory, size, force=force)  # type: ignore[arg-type]
    print(f"hf directory: {model.hf_dir}\ngguf:         {model.gguf_path}")


def main() -> None:
    """Entry point of the ``unillm`` script."""
    app()


if __name__ == "__main__":
    main()
