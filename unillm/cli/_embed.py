"""``unillm embed``: load a model for embeddings and print the vectors of texts."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from unillm.cli._common import (
    BackendOpt,
    ConfigOpt,
    OptionOpt,
    RunContextOpt,
    RunModelArg,
    _bad,
    _console,
    _dump,
    _esc,
    _reported,
)

if TYPE_CHECKING:
    from unillm._contract._engine import Engine
    from unillm._types import Embeddings

__all__ = ["embed"]

_SHOWN = 5  # values of each vector the human output prints
_PREVIEW = 40  # characters of each text it prints


def embed(
    model: RunModelArg = None,
    texts: Annotated[
        list[str] | None,
        typer.Argument(
            help="The texts to embed; none, or -, reads them from stdin, one a line (blank lines skipped).",
            show_default=False,
        ),
    ] = None,
    backend: BackendOpt = None,
    config: ConfigOpt = None,
    option: OptionOpt = None,
    context: RunContextOpt = None,
    pooling: Annotated[
        Literal["mean", "last", "cls"] | None,
        typer.Option(help="How token states pool into one vector; default: the model's, else last."),
    ] = None,
    dimensions: Annotated[
        int | None, typer.Option(help="Keep the first N dimensions (Matryoshka), before normalizing.")
    ] = None,
    normalize: Annotated[
        bool, typer.Option("--normalize/--no-normalize", help="Scale each vector to unit length.")
    ] = True,
    truncate: Annotated[
        bool, typer.Option(help="Cut an input longer than the engine takes to its limit, instead of failing.")
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print one JSON object: model, backend, pooling, dimensions, normalized, usage, "
            "data (index, embedding).",
        ),
    ] = False,
) -> None:
    """Print the embedding vectors of TEXT... (or of stdin's lines), loading MODEL for embeddings.

    A generative model embeds too (last-token pooling). The default output is a line per text:
    its index, dimensions, norm and first values; then the load and embed times on stderr.
    """
    model, inputs = _model_and_texts(model, list(texts or ()), config)
    if dimensions is not None and dimensions < 1:
        raise _bad(f"--dimensions is a positive number (the leading dimensions kept), got {dimensions}")
    from unillm.cli._run import _open_engine

    t0 = time.perf_counter()
    engine = _open_engine(
        model, config=config, backend=backend, context=context, options=option, task="embed", pooling=pooling
    )
    load_s = time.perf_counter() - t0
    with _reported(), engine:
        t1 = time.perf_counter()
        result = engine.embed(inputs, normalize=normalize, dimensions=dimensions, truncate=truncate)
        embed_s = time.perf_counter() - t1
        if as_json:
            _dump(_record(engine, result), indent=None)
        else:
            _print_vectors(inputs, result)
            _console(stderr=True).print(
                f"[{len(result)} text{'s' * (len(result) != 1)}, {result.usage.prompt_tokens} tokens; "
                f"{_esc(engine.name)}, {result.pooling} pooling"
                f"{', normalized' if result.normalized else ''}; load {load_s:.2f} s; "
                f"embed {embed_s * 1000:.1f} ms]",
                highlight=False,
                soft_wrap=True,
            )


def _names_a_model(arg: str) -> bool:
    """Whether ``arg`` is a model (a file or directory there, or a Hugging Face name), not a text."""
    from unillm._names import parse_model_name

    try:
        there = os.path.exists(os.path.expanduser(arg))
    except (OSError, ValueError):
        there = False
    return there or parse_model_name(arg) is not None


def _model_and_texts(
    model: str | None, texts: list[str], config: Path | None
) -> tuple[str | None, list[str]]:
    """``embed MODEL TEXT...``; when --config or UNILLM_MODEL names the model, ``embed TEXT...``
    (the first argument is MODEL only if it names one: a path that is there, or org/name)."""
    named = config is not None or bool(os.environ.get("UNILLM_MODEL"))
    if model is None and not named:
        raise _bad("give MODEL, then TEXT... or the texts on stdin (MODEL may be left out when "
                   "--config or UNILLM_MODEL names one)")  # fmt: skip
    if model is not None and named and not _names_a_model(model):
        texts = [model, *texts]
        model = None
    if not texts or texts == ["-"]:
        texts = _stdin_lines()
        if not texts:
            raise _bad("no text to embed: give TEXT... or lines on stdin")
    return model, texts


def _stdin_lines() -> list[str]:
    isatty = getattr(sys.stdin, "isatty", None)
    if isatty and isatty():
        _console(stderr=True).print("reading texts from stdin, one a line; Ctrl-D ends", highlight=False)
    return [line for line in sys.stdin.read().splitlines() if line.strip()]


def _record(engine: Engine[Any], result: Embeddings) -> dict[str, Any]:
    """The ``--json`` object: OpenAI's /v1/embeddings shape, with what the vectors are."""
    return {
        "model": engine.config.model,
        "backend": engine.name,
        "pooling": result.pooling,
        "dimensions": result.dimensions,
        "normalized": result.normalized,
        "truncated": list(result.truncated),
        "usage": {"prompt_tokens": result.usage.prompt_tokens},
        "data": [{"index": i, "embedding": v} for i, v in enumerate(result.vectors)],
    }


def _print_vectors(texts: list[str], result: Embeddings) -> None:
    import numpy as np

    array = result.array()
    norms = np.linalg.norm(array.astype(np.float64), axis=1)
    cut = set(result.truncated)
    width = len(str(len(texts) - 1))
    for i, text in enumerate(texts):
        preview = text if len(text) <= _PREVIEW else text[: _PREVIEW - 3] + "..."
        head = ", ".join(f"{x:.4f}" for x in array[i, :_SHOWN])
        more = ", ..." if result.dimensions > _SHOWN else ""
        note = " (truncated)" if i in cut else ""
        row = f"{i:>{width}}  {result.dimensions} dims  norm {norms[i]:.4f}  [{head}{more}]"
        print(f"{row}  {preview!r}{note}")
