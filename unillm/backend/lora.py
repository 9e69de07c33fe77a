"""LoRA adapters as engines take them: the one adapter a single-adapter engine loads, and the
PEFT directory (``adapter_config.json`` beside ``adapter_model.safetensors``, as PEFT's
``save_pretrained`` writes it) checked before an engine reads it, refused with a ``ConfigError``
naming the file the engine wants.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from unillm._errors import ConfigError
from unillm._params import EngineConfig

__all__ = ["PEFT_FILES", "one_adapter", "peft_adapter", "peft_config"]

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


def peft_config(path: Path) -> dict[str, Any] | None:
    """A PEFT directory's ``adapter_config.json`` when ``path`` is one, else None."""
    config = path / "adapter_config.json"
    if not (path.is_dir() and config.is_file() and any((path / f).is_file() for f in PEFT_FILES)):
        return None
    data = json.loads(config.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) and ("peft_type" in data or "r" in data) else None


def peft_adapter(path: Path, backend: str) -> Path:
    """``path`` if it is a PEFT LoRA directory, else a ConfigError saying what the backend reads."""
    config = peft_config(path)
    if config is None:
        raise ConfigError(
            f"{backend} reads a LoRA adapter as a PEFT directory (adapter_config.json and "
            f"adapter_model.safetensors, as PEFT's save_pretrained writes it); {str(path)!r} is not one"
        )
    if str(config.get("peft_type", "LORA")).upper() != "LORA" or config.get("use_dora"):
        raise ConfigError(f"{str(path)!r} is a {config.get('peft_type')} adapter; {backend} takes LoRA ones")
    return path
