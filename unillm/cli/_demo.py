"""``unillm demo`` and ``unillm testing build-tiny``: the tiny models."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from unillm.cli._common import _bad, _reported

__all__ = ["build_tiny", "demo"]


def _size(size: str) -> str:
    from unillm.testing import SIZES

    if size not in SIZES:
        raise _bad(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    return size


def demo(
    size: Annotated[str, typer.Option(help="Tiny model size: small or bench.")] = "small",
) -> None:
    """Run unillm end to end on a tiny model built on first use (no download)."""
    from unillm.cli._demo_run import run_demo

    size = _size(size)
    with _reported():
        run_demo(size)


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
