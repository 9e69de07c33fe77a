"""What the MLX backend needs to know of a model before and after mlx-lm loads it: the HF directory
mlx-lm reads, from the facts (``engine.facts``: no config.json is read again here), the tokenizer
it needs beside it, the KV cache's element type and the prompt cache's length.

Used by ``unillm.engines.mlx`` only; it does not import that module.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from unillm import ModelFormatError, ModelNotFound
from unillm.backend import exists, hf_dir_in, is_dir, is_file, kv_dtype

if TYPE_CHECKING:
    from unillm import ModelInfo
    from unillm.backend import Facts

__all__ = [
    "activation_dtype",
    "bits_dtype",
    "cache_offset",
    "check_tokenizer",
    "has_batch_generator",
    "import_mlx_lm",
    "model_dir",
]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


# ---- the model directory, from the facts ----


def model_dir(model: str, facts: Facts) -> tuple[Path, ModelInfo]:
    """The HF directory mlx-lm loads for ``model`` (a local directory, one holding the model's formats
    side by side, or a repo id in the local HF cache: never downloaded) and what unillm read of it.

    :raises ModelNotFound: for a path that does not exist or a repo id that is not cached.
    :raises ModelFormatError: for a file, a directory without config.json, or a model unillm cannot
        read.
    """
    given = Path(model).expanduser()
    hf = hf_dir_in(given)  # a directory holding the model's formats side by side: its HF one
    if hf is None:
        if is_file(given):
            raise _a_file(model)
        if is_dir(given):
            raise ModelFormatError(f"{model!r} has no config.json: not a Hugging Face-style model directory")
    elif hf != given:
        facts = facts.for_path(str(hf))
    info = facts.model
    if info is None:
        if hf is None and not exists(given):
            raise ModelNotFound(model)  # not here, and not in the local HF cache
        where = str(hf or given)
        raise ModelFormatError(
            f"{where!r} is not a model unillm can read (unillm.inspect_model says why); MLX reads "
            "Hugging Face-style model directories (config.json, *.safetensors, tokenizer)"
        )
    path = Path(info.path)
    if not is_dir(path):  # a repo id whose snapshot holds a single file
        raise _a_file(info.path)
    return path, info


def check_tokenizer(path: Path) -> None:
    """mlx-lm needs a tokenizer beside the weights: say so before it is imported."""
    if not any(is_file(path / name) for name in _TOKENIZER_FILES):
        raise ModelFormatError(
            f"{str(path)!r} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)"
        )


def _a_file(model: str) -> ModelFormatError:
    return ModelFormatError(
        f"{model!r} is a file; MLX reads Hugging Face-style model directories "
        "(config.json, *.safetensors, tokenizer). For a .gguf file use backend='llama.cpp'."
    )


def import_mlx_lm() -> Any:
    """``mlx_lm``, imported without lowering this process's open-file limit. Its ``utils`` module
    sets ``RLIMIT_NOFILE`` to (2048, 4096) when first imported (mlx-lm 0.31: meant to raise the
    limit for models of many files), which lowers a higher one, and a hard limit once lowered stays
    lowered: a server could then hold fewer connections, and every process it starts inherits it
    (Ray Serve's HAProxy refused to start under it). While it imports, a limit is only raised."""
    import resource

    real = resource.setrlimit

    def only_raise(which: int, limits: tuple[int, int]) -> None:
        if which != resource.RLIMIT_NOFILE:
            return real(which, limits)
        soft, hard = resource.getrlimit(which)
        wanted = (_higher(soft, limits[0]), _higher(hard, limits[1]))
        if wanted != (soft, hard):
            real(which, wanted)

    resource.setrlimit = only_raise  # type: ignore[assignment]
    try:
        import mlx_lm
    finally:
        resource.setrlimit = real
    return mlx_lm


def _higher(a: int, b: int) -> int:
    import resource

    return resource.RLIM_INFINITY if resource.RLIM_INFINITY in (a, b) else max(a, b)


# ---- after the load ----


def has_batch_generator() -> bool:
    """Whether this mlx-lm has ``BatchGenerator`` (continuous batching)."""
    try:
        from mlx_lm.generate import BatchGenerator  # noqa: F401
    except ImportError:
        return False
    return True


def activation_dtype(model: Any, info: ModelInfo) -> str | None:
    """The KV cache's element type as ``kv_dtype`` names it: mlx-lm caches K and V in the model's
    activation dtype, that of its embedding (the scales' of a quantized one); else the dtype the
    facts name for unquantized weights. None when neither says."""
    names: list[str] = []
    try:
        embed = model.parameters()["model"]["embed_tokens"]
        names.append(str((embed.get("scales") if "scales" in embed else embed["weight"]).dtype))
    except (KeyError, TypeError, AttributeError):
        pass
    names.append(info.quantization or "")
    for name in names:
        try:
            return kv_dtype(name.rsplit(".", 1)[-1])  # "mlx.core.float32" -> "f32"
        except ValueError:
            continue
    return None


def bits_dtype(bits: int) -> str | None:
    """``kv_bits`` as ``kv_dtype`` names it (8 -> q8: mlx-lm's f16 scale and bias per 64 values
    come to the table's bytes); None for the widths the table has no entry for (2 and 3 bits)."""
    try:
        return kv_dtype(bits)
    except ValueError:
        return None


def cache_offset(cache: list[Any] | None) -> int | None:
    """Tokens a prompt cache holds (its first layer's offset), or None without one."""
    if not cache:
        return None
    offset = getattr(cache[0], "offset", None)
    return int(offset) if offset is not None else None
