"""``unillm pull``, ``unillm models`` and ``unillm rm``: models by name in the Hugging Face cache
(``HF_HUB_CACHE``), fetched, listed and removed."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Annotated

import typer

from unillm.cli._common import (
    ConcurrencyOpt,
    ContextOpt,
    HardwareOpt,
    JsonOpt,
    _bad,
    _dump,
    _reported,
)

__all__ = ["models_cmd", "pull", "rm"]

NameArg = Annotated[str, typer.Argument(help="A model name: org/name, org/name@revision, org/name:QUANT.")]


def _name(model: str) -> object:
    from unillm._names import parse_model_name

    name = parse_model_name(model)
    if name is None:
        raise _bad(f"{model!r} is not a model name: org/name, org/name@revision or org/name:QUANT")
    return name


@contextlib.contextmanager
def _log_lines() -> Iterator[None]:
    """Download progress as lines on stderr for the command's length (a terminal gets bars)."""
    import logging

    log = logging.getLogger("unillm.hub")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def pull(
    model: NameArg,
    context: ContextOpt = None,
    concurrency: ConcurrencyOpt = 1,
    hardware: HardwareOpt = None,
) -> None:
    """Download MODEL into the Hugging Face cache (resumable) and print where it went.

    With no :QUANT tag, the GGUF quantization that fits this machine (or the --hardware one) at
    --context and --concurrency is chosen, as `auto_engine` would choose it.
    """
    from unillm._choose._auto import resolve_name
    from unillm._contract._facts import machine
    from unillm._hardware import load_hardware
    from unillm._types import EngineConfig

    _name(model)
    with _reported(), _log_lines():
        cfg = EngineConfig(model=model, context_length=context, concurrency=concurrency)
        _, source = resolve_name(cfg, load_hardware(hardware) if hardware else machine())
        assert source is not None
        for line in source.lines():
            print(line, file=sys.stderr)
        path = source.local or source.fetch()
    print(path)


def models_cmd(as_json: JsonOpt = False) -> None:
    """List the models in the Hugging Face cache: id, revision, files, size, format,
    quantization, and the backend that would run it here."""
    from unillm._hub import cached_models

    found = [{**m.as_dict(), "backend": _backend(m)} for m in cached_models()]
    if as_json:
        _dump(found)
        return
    if not found:
        print("no models cached (HF_HUB_CACHE); `unillm pull org/name` downloads one")
        return
    rows = [("id", "revision", "files", "size", "format", "quantization", "backend")]
    for m in found:
        refs: list[str] = m["refs"]  # type: ignore[assignment]
        rev = str(m["revision"])[:12] + (f" ({','.join(refs)})" if refs else "")
        size, files = _human(m["size"]), str(len(m["files"]))  # type: ignore[arg-type]
        quant, backend = str(m["quantization"] or "-"), str(m["backend"] or "-")
        rows.append((str(m["id"]), rev, files, size, str(m["format"]), quant, backend))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def _backend(model: object) -> str | None:
    """The backend ``auto_engine`` would run a cached model with here (its first GGUF, or the
    snapshot folder), from headers; None when none can."""
    from pathlib import Path

    from unillm._choose._auto import choose
    from unillm._hub._files import gguf_files
    from unillm._types import EngineConfig

    snapshot = Path(model.path)  # type: ignore[attr-defined]
    ggufs = gguf_files(dict.fromkeys(model.files, 0))  # type: ignore[attr-defined]
    path = snapshot / ggufs[0].path if ggufs else snapshot
    try:
        return choose(EngineConfig(model=str(path))).selection.backend or None
    except Exception:  # a listing: a model that cannot be read says "-", the rest still list
        return None


def _human(n: int) -> str:
    from unillm._hub._fit import human

    return human(n)


def rm(model: NameArg) -> None:
    """Remove MODEL from the Hugging Face cache: the whole repo, or with :QUANT that file only."""
    from unillm._hub import remove

    name = _name(model)
    with _reported():
        removed = remove(name)  # type: ignore[arg-type]
    print(f"removed {model} ({len(removed)} paths)")
