"""Swap the engine or the model through config and environment, not code.

    python examples/swap_engine.py [MODEL.gguf]

The script writes a ``unillm.toml`` into a temporary folder (the model, the backend, and llama.cpp's
own options in a ``[backend_options."llama.cpp"]`` table), then opens it with ``load_engine`` three
times, as if the same application were started three ways:

1. as the file says;
2. with ``UNILLM_MODEL`` and ``UNILLM_BACKEND`` set, which override the file;
3. with ``UNILLM_BACKEND`` naming a backend this machine lacks, which is refused with an error
   that says so (the environment still wins over the file).

Without MODEL it uses unillm's tiny test model, built once into ``$UNILLM_CACHE``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from unillm import UnillmError, load_engine

CONFIG = """\
model = "model.gguf"          # relative paths are relative to this file
backend = "llama.cpp"
context_length = 256

[backend_options."llama.cpp"]
n_threads = 1
"""


@contextmanager
def environment(**values: str | None) -> Iterator[None]:
    """Set (or, with None, remove) environment variables for the duration of the block."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run(label: str, config: Path) -> None:
    """What an application would do: open whatever the config (and environment) describe."""
    try:
        engine = load_engine(config)
    except UnillmError as exc:
        print(f"[{label}] refused: {type(exc).__name__}: {exc}")
        return
    with engine:
        reply = engine.generate("Hello", max_tokens=8, temperature=0.0)
        assert engine.selection is not None
        print(
            f"[{label}] ran on backend {engine.name} (chosen by {engine.selection.chosen_by}), "
            f"model {engine.config.model}, options {engine.config.options_for(engine.name)}: "
            f"{reply.usage.completion_tokens} tokens"
        )


def main(model: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        shutil.copyfile(model, folder / "model.gguf")
        config = folder / "unillm.toml"
        config.write_text(CONFIG, encoding="utf-8")
        print(f"{config}:\n{CONFIG}")

        with environment(UNILLM_MODEL=None, UNILLM_BACKEND=None):
            run("file", config)
        with environment(UNILLM_MODEL=str(model), UNILLM_BACKEND="llama-cpp"):
            run("UNILLM_MODEL + UNILLM_BACKEND", config)
        with environment(UNILLM_MODEL=None, UNILLM_BACKEND="no-such-engine"):
            run("UNILLM_BACKEND=no-such-engine", config)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        model_path = Path(sys.argv[1])
    else:
        from unillm.testing import tiny_model

        model_path = tiny_model().gguf_path
    main(model_path)
