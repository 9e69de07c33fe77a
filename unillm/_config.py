"""Engine config from a dict, a TOML file, or the environment.

Precedence, lowest first: the file or dict, then keyword overrides given in code, then the
environment (``UNILLM_*``), so a deployed app can swap its engine without a code change::

    UNILLM_BACKEND=mlx python app.py

A TOML file holds the fields of ``EngineConfig`` at the top level or under a ``[unillm]`` table;
a relative ``model`` path is taken relative to the file's folder::

    model = "models/llama-3.2-1b-q4_k_m.gguf"
    backend = "llama.cpp"
    context_length = 8192

    [backend_options."llama.cpp"]
    n_threads = 8
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unillm._errors import ConfigError
from unillm._types import EngineConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = ["ENV_VARS", "read_config"]

#: environment variable -> EngineConfig field
ENV_VARS = {
    "UNILLM_MODEL": "model",
    "UNILLM_BACKEND": "backend",
    "UNILLM_CONTEXT_LENGTH": "context_length",
    "UNILLM_CHAT_TEMPLATE": "chat_template",
    "UNILLM_UNSUPPORTED_PARAMS": "unsupported_params",
    "UNILLM_OPTIONS": "options",
}


def read_config(
    source: EngineConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> EngineConfig:
    """Build an ``EngineConfig`` from ``source``, then ``overrides``, then the environment."""
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, EngineConfig):
        data = source.model_dump(exclude_unset=True)
    elif isinstance(source, Mapping):
        data = dict(source)
    elif isinstance(source, (str, os.PathLike)):
        data = _read_toml(Path(source))
    else:
        raise ConfigError(
            f"a config is an EngineConfig, a dict or the path of a TOML file, got {type(source).__name__}"
        )
    for key, value in overrides.items():
        if value is None:
            continue
        if key in ("options", "backend_options") and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}  # merge, as UNILLM_OPTIONS does
        else:
            data[key] = value
    from_env = _from_env(os.environ if env is None else env)
    if "options" in from_env:
        from_env["options"] = {**data.get("options", {}), **from_env["options"]}
    data.update(from_env)
    if "model" not in data:
        raise ConfigError("no model given: set `model` in the config, pass model=..., or set UNILLM_MODEL")
    return EngineConfig(**data)


def _read_toml(path: Path) -> dict[str, Any]:
    if path.suffix != ".toml":
        raise ConfigError(
            f"{str(path)!r} is not a .toml config file. To open a model directly use "
            f"auto_engine({str(path)!r}), or pass load_engine({{'model': {str(path)!r}}})"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {str(path)!r}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{str(path)!r} is not valid TOML: {exc}. Fix the file and retry.") from exc
    if isinstance(data.get("unillm"), dict):
        data = data["unillm"]
    model = data.get("model")
    if isinstance(model, str) and not Path(model).expanduser().is_absolute():
        data["model"] = str(path.parent / model)
    return data


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for var, field in ENV_VARS.items():
        value = env.get(var)
        if not value:
            continue
        if field == "options":
            try:
                parsed = json.loads(value)
            except ValueError as exc:
                raise ConfigError(f"{var} must be a JSON object, e.g. '{{\"n_threads\": 4}}': {exc}") from exc
            if not isinstance(parsed, dict):
                raise ConfigError(f"{var} must be a JSON object, e.g. '{{\"n_threads\": 4}}'")
            out[field] = parsed
        else:
            out[field] = value
    return out
