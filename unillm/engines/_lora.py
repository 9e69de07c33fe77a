"""LoRA adapters for the engines: which of the config's adapters a backend takes, in the format it
reads (a GGUF file for llama.cpp, a PEFT directory for vLLM and ExLlamaV2, mlx-lm's adapter
directory or a PEFT one for MLX), refused with a ``ConfigError`` naming the file it wants.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from unillm._errors import ConfigError
from unillm._facts import Facts
from unillm._params import EngineConfig

__all__ = ["apply_peft_mlx", "gguf_adapter", "mlx_adapter", "one_adapter", "peft_adapter"]

PEFT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def one_adapter(config: EngineConfig, backend: str) -> Path | None:
    """The one adapter a backend that applies a single adapter to every request loads, or None."""
    adapters = config.lora_adapters()
    if len(adapters) > 1:
        raise ConfigError(
            f"{backend} applies one LoRA adapter to every request, and lora names {len(adapters)} "
            f"({', '.join(adapters)}); give lora one path, or use a backend that switches adapters "
            "per request (capabilities.sampling has 'lora')"
        )
    return next(iter(adapters.values()), None)


def gguf_adapter(path: Path, backend: str, facts: Facts) -> Path:
    """``path`` if it is a GGUF LoRA adapter (``general.type`` adapter), else a ConfigError: llama.cpp
    loads a model's GGUF as an adapter without a word, one that changes nothing."""
    want = (
        f"{backend} reads a LoRA adapter as one GGUF file (general.type 'adapter'; llama.cpp's "
        "convert_lora_to_gguf.py writes one from a PEFT adapter)"
    )
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) != 1:
            raise ConfigError(f"{want}; {str(path)!r} is a directory holding {len(found)} .gguf files")
        path = found[0]
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ConfigError(f"{want}; {str(path)!r} is not a GGUF file")
    kind = facts.for_path(str(path)).gguf_header.metadata.get("general.type")
    if kind != "adapter":
        raise ConfigError(f"{want}; {str(path)!r} is a GGUF of type {kind!r}, not an adapter")
    return path


def _peft_config(path: Path) -> dict[str, Any] | None:
    config = path / "adapter_config.json"
    if not (path.is_dir() and config.is_file() and any((path / f).is_file() for f in PEFT_FILES)):
        return None
    data = json.loads(config.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) and ("peft_type" in data or "r" in data) else None


def peft_adapter(path: Path, backend: str) -> Path:
    """``path`` if it is a PEFT LoRA directory, else a ConfigError saying what the backend reads."""
    config = _peft_config(path)
    if config is None:
        raise ConfigError(
            f"{backend} reads a LoRA adapter as a PEFT directory (adapter_config.json and "
            f"adapter_model.safetensors, as PEFT's save_pretrained writes it); {str(path)!r} is not one"
        )
    if str(config.get("peft_type", "LORA")).upper() != "LORA" or config.get("use_dora"):
        raise ConfigError(f"{str(path)!r} is a {config.get('peft_type')} adapter; {backend} takes LoRA ones")
    return path


def mlx_adapter(path: Path, backend: str) -> tuple[Path, bool]:
    """``(path, is_peft)``: an mlx-lm adapter directory (``adapters.safetensors``) or a PEFT one,
    which ``apply_peft_mlx`` puts on the model."""
    if (path / "adapters.safetensors").is_file() and (path / "adapter_config.json").is_file():
        return path, False
    if _peft_config(path) is not None:
        return peft_adapter(path, backend), True
    raise ConfigError(
        f"{backend} reads a LoRA adapter as mlx-lm's adapter directory (adapter_config.json and "
        f"adapters.safetensors) or a PEFT directory (adapter_model.safetensors); {str(path)!r} is neither"
    )


def apply_peft_mlx(model: Any, path: Path | None) -> None:
    """Put the PEFT LoRA adapter in ``path`` on an mlx-lm model: mlx-lm's LoRA layers, with A and B
    transposed into its ``(in, rank)`` / ``(rank, out)`` layout and scaled by ``alpha / r``. Then
    evaluate the parameters: mlx-lm leaves an adapter's lazy, and a lazy array made on one thread
    cannot be evaluated on another (MLX's streams are per thread)."""
    import mlx.core as mx

    if path is None:
        mx.eval(model.parameters())
        return
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    config = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
    if not (path / PEFT_FILES[0]).is_file():
        raise ConfigError(f"MLX reads a PEFT adapter's {PEFT_FILES[0]}; {str(path)!r} has only a .bin")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights: dict[str, Any] = {}
    keys: set[str] = set()
    loaded: dict[str, Any] = mx.load(str(path / PEFT_FILES[0]))  # type: ignore[assignment]
    for name, w in loaded.items():
        inner = name.removeprefix("base_model.model.")
        for peft_leaf, leaf in ((".lora_A.weight", "lora_a"), (".lora_B.weight", "lora_b")):
            if inner.endswith(peft_leaf):
                module = inner.removesuffix(peft_leaf)
                weights[f"{module}.{leaf}"] = w.T
                parts = module.split(".")
                if len(parts) > 3 and parts[:2] == ["model", "layers"]:
                    keys.add(".".join(parts[3:]))
    if not weights or not keys:
        raise ConfigError(f"{str(path)!r} holds no LoRA weights on the model's layers that MLX can apply")
    params = {"rank": rank, "scale": scale, "dropout": 0.0, "keys": sorted(keys)}
    linear_to_lora_layers(model, len(model.layers), params)
    have = dict(tree_flatten(model.parameters()))
    misfit = [n for n, w in weights.items() if n not in have or have[n].shape != w.shape]
    if misfit:
        raise ConfigError(
            f"the LoRA adapter {str(path)!r} does not fit the model: {', '.join(misfit[:3])} "
            "name no adapter weight of its shape; was it trained on another model?"
        )
    model.load_weights(list(weights.items()), strict=False)
    mx.eval(model.parameters())


def mlx_lora(config: EngineConfig, adapter_path: str | None, backend: str) -> tuple[str | None, Path | None]:
    """``(adapter_path for mlx_lm.load, PEFT directory for apply_peft_mlx)`` from the config's
    ``lora`` or the backend's own ``adapter_path`` option (one of them)."""
    lora = one_adapter(config, backend)
    if lora is None:
        return adapter_path, None
    if adapter_path is not None:
        raise ConfigError(
            f"lora={str(lora)!r} and options adapter_path={adapter_path!r} both name an adapter; "
            "set only lora"
        )
    path, is_peft = mlx_adapter(lora, backend)
    return (None, path) if is_peft else (str(path), None)


def exllamav2_lora(exl: Any, model: Any, generator: Any, config: EngineConfig, backend: str) -> Any:
    """The config's adapter read by ``ExLlamaV2Lora.from_directory`` and enabled for every job of
    ``generator`` (exllamav2's dynamic generator sets LoRAs for its whole queue), or None."""
    lora = one_adapter(config, backend)
    if lora is None:
        return None
    path = peft_adapter(lora, backend)
    try:
        adapter = exl.ExLlamaV2Lora.from_directory(model, str(path))
    except (ValueError, KeyError, AssertionError) as exc:
        raise ConfigError(f"exllamav2 could not apply the LoRA adapter {str(path)!r}: {exc!r}") from exc
    generator.set_loras([adapter])
    return adapter
