"""LoRA on MLX: mlx-lm's adapter directory (``adapters.safetensors``), or a PEFT one whose A and B
matrices this module puts on mlx-lm's LoRA layers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from unillm import ConfigError, EngineConfig
from unillm.backend.lora import PEFT_FILES, one_adapter, peft_adapter, peft_config

__all__ = ["apply_peft_mlx", "mlx_adapter", "mlx_lora"]


def mlx_adapter(path: Path, backend: str) -> tuple[Path, bool]:
    """``(path, is_peft)``: an mlx-lm adapter directory (``adapters.safetensors``) or a PEFT one,
    which ``apply_peft_mlx`` puts on the model."""
    if (path / "adapters.safetensors").is_file() and (path / "adapter_config.json").is_file():
        return path, False
    if peft_config(path) is not None:
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
