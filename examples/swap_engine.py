"""Swap the engine through config and environment, not code: one variable moves the same
application from llama.cpp to MLX on the same model.

    python examples/swap_engine.py [MODEL_DIR]

MODEL_DIR holds one model in two formats side by side (a GGUF file and an HF directory, as
``unillm testing build-tiny`` writes them); each backend reads the one it can. The script writes a
``unillm.toml`` into a temporary folder (the model directory, the backend, and each engine's own
options in ``[backend_options.<name>]`` tables), then opens it with ``load_engine`` three times,
as if the same application were started three ways:

1. as the file says (llama.cpp, reading the GGUF);
2. with ``UNILLM_BACKEND=mlx``, which overrides the file: MLX reads the HF copy, with its own
   table's options (on a machine without MLX, it is refused with the way to install it);
3. with ``UNILLM_BACKEND`` naming a backend no one registered, refused with an error that says so.

Without MODEL_DIR it uses unillm's tiny test model, built once into ``$UNILLM_CACHE``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from unillm import UnillmError, load_engine

CONFIG = """\
model = "model"               # a directory holding a GGUF and an HF copy; relative to this file
backend = "llama.cpp"
context_length = 256

[backend_options."llama.cpp"]
n_threads = 1

[backend_options.mlx]
batch_size = 1
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
        (folder / "model").symlink_to(model.resolve(), target_is_directory=True)
        config = folder / "unillm.toml"
        config.write_text(CONFIG, encoding="utf-8")
        print(f"{config}:\n{CONFIG}")

        with environment(UNILLM_MODEL=None, UNILLM_BACKEND=None):
            run("file", config)
        with environment(UNILLM_MODEL=None, UNILLM_BACKEND="mlx"):
            run("UNILLM_BACKEND=mlx", config)
        with environment(UNILLM_MODEL=None, UNILLM_BACKEND="no-such-engine"):
            run("UNILLM_BACKEND=no-such-engine", config)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        model_dir = Path(sys.argv[1])
    else:
        from unillm.testing import tiny_model

        model_dir = tiny_model().root  # the GGUF and the HF directory side by side
    main(model_dir)
