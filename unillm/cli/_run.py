"""``unillm generate`` and ``unillm chat``: load an engine and run it."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from unillm.cli._common import (
    BackendOpt,
    ConfigOpt,
    OptionOpt,
    RunContextOpt,
    RunModelArg,
    SeedOpt,
    StopOpt,
    TemperatureOpt,
    _asdict,
    _bad,
    _console,
    _dump,
    _esc,
    _reported,
)

if TYPE_CHECKING:
    from unillm._contract._engine import Engine
    from unillm._types import Completion, EngineConfig, SamplingParams

__all__ = ["chat", "generate"]


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
    task: str | None = None,
    pooling: str | None = None,
) -> Engine[Any]:
    """Load the engine the command line describes: --config, then the flags, then UNILLM_*
    (``task`` and ``pooling``: what ``unillm embed`` loads for)."""
    from unillm import load_engine, read_config

    opts = _parse_options(options)
    with _reported():
        cfg = read_config(
            str(config) if config else None,
            model=model,
            backend=backend,
            context_length=context,
            options=opts or None,
            task=task,
            pooling=pooling,
        )
        with _loading(cfg):
            return load_engine(cfg)


def _download(cfg: EngineConfig) -> None:
    """A model name's files fetched before the spinner starts: bars on a terminal, lines otherwise."""
    from unillm._names import parse_model_name

    if parse_model_name(cfg.model) is None and not cfg.variants:
        return
    from unillm._choose._auto import choose, resolve_name
    from unillm._contract._facts import machine
    from unillm.cli._models import _log_lines

    with _log_lines():
        if cfg.variants:  # the copy that will be loaded, not the first named
            source = choose(cfg).source
        else:
            _, source = resolve_name(cfg, machine())
        if source is not None and source.local is None:
            source.fetch()


@contextlib.contextmanager
def _loading(cfg: EngineConfig, *, label: str | None = None) -> Iterator[None]:
    """A spinner on stderr while the engine starts (vLLM takes 30-60 s) on a terminal; elsewhere
    (a log file, a pipe, a service manager) with ``label`` (``unillm serve``'s alias) a line as
    the load starts and one when it is done, with its time. A model name's files are downloaded
    first, with their own progress (``unillm generate``, ``chat`` and ``serve`` all start engines
    here)."""
    _download(cfg)
    isatty = getattr(sys.stderr, "isatty", None)
    if not (isatty and isatty()):
        if label is None:
            yield
            return
        import time

        print(f"unillm serve: loading {label!r} ({cfg.model}) with {cfg.backend or _likely_backend(cfg)}",
              file=sys.stderr, flush=True)  # fmt: skip
        t0 = time.monotonic()
        yield
        print(f"unillm serve: {label!r} loaded in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
        return
    from rich.console import Console

    # the environment (FORCE_COLOR, TTY_COMPATIBLE) must not turn a pipe into a terminal, nor
    # the reverse: the check above decides
    console = Console(stderr=True, force_terminal=True)
    with console.status(f"loading {_esc(cfg.model)} with {_esc(cfg.backend or _likely_backend(cfg))}..."):
        yield


def _likely_backend(cfg: EngineConfig) -> str:
    """The backend auto_engine will try first, found the way it finds it (headers only)."""
    from unillm._choose._auto import choose

    try:
        chosen = choose(cfg).selection.backend
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
