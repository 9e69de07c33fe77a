"""Engine config from a dict, a TOML file, or the environment.

Precedence, lowest first: the file or dict, then keyword overrides given in code, then the
environment (``UNILLM_*``), so a deployed app can swap its engine without a code change::

    UNILLM_BACKEND=mlx python app.py

It holds for every option key too: a layer's ``options`` beat every lower layer's ``options`` and
``backend_options`` tables, and within one layer a backend's own table beats ``options``.

A TOML file holds the fields of ``EngineConfig`` at the top level or under a ``[unillm]`` table;
a relative ``model`` path is taken relative to the file's folder (a model name such as
``Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M`` is left as it is)::

    model = "models/llama-3.2-1b-q4_k_m.gguf"
    backend = "llama.cpp"
    context_length = 8192

    [backend_options."llama.cpp"]
    n_threads = 8
"""

from __future__ import annotations

import errno
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unillm._errors import ConfigError
from unillm._names import parse_model_name
from unillm._types import EngineConfig, normalize_name

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
    "UNILLM_CONCURRENCY": "concurrency",
    "UNILLM_GOAL": "goal",
}


def read_config(
    source: EngineConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> EngineConfig:
    """Build an ``EngineConfig`` from ``source``, then ``overrides``, then the environment.

    Each layer replaces the fields the layers below it set; ``options`` and ``backend_options``
    are merged key by key, with the higher layer winning every key it sets (see the module
    docstring). Raises ``ConfigError`` for an unreadable file, a wrong type or a missing model.
    """
    if source is None:
        data: dict[str, Any] = {}
        where = "the config"
    elif isinstance(source, EngineConfig):
        data, where = source.model_dump(exclude_unset=True), "the EngineConfig"
    elif isinstance(source, Mapping):
        data, where = dict(source), "the config dict"
    elif isinstance(source, (str, os.PathLike)):
        data, where = _read_toml(Path(source)), repr(os.fspath(source))
    else:
        raise ConfigError(
            f"a config is an EngineConfig, a dict or the path of a TOML file, got {type(source).__name__}"
        )
    layers = [
        (data, where),
        ({k: v for k, v in overrides.items() if v is not None}, "the keyword arguments"),
        (_from_env(os.environ if env is None else env), "the environment"),
    ]
    merged: dict[str, Any] = {}
    for layer, name in layers:
        _merge(merged, layer, name)
    if "model" not in merged:
        raise ConfigError("no model given: set `model` in the config, pass model=..., or set UNILLM_MODEL")
    return EngineConfig(**merged)


def _merge(into: dict[str, Any], layer: Mapping[str, Any], where: str) -> None:
    """Lay ``layer`` over ``into``. Its ``options`` keys are taken out of the lower layers'
    per-backend tables first: otherwise ``options_for`` would let a file's table beat the
    environment, since a backend's table is merged over ``options``."""
    for key, value in layer.items():
        if key == "options":
            options = _table(value, f"options in {where}")
            for table in into.get("backend_options", {}).values():
                for name in options:
                    table.pop(name, None)
            into["options"] = {**into.get("options", {}), **options}
        elif key == "backend_options":
            tables = into.setdefault("backend_options", {})
            for backend, raw in _table(value, f"backend_options in {where}").items():
                table = _table(raw, f"backend_options.{backend} in {where}")
                # one table per backend however its name is spelled, so the higher layer's keys land on it
                same = next((b for b in tables if normalize_name(b) == normalize_name(str(backend))), backend)
                tables[same] = {**tables.get(same, {}), **table}
        else:
            into[key] = value


def _table(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{what} must be a table of name = value pairs (a dict), got {type(value).__name__} "
            f"{value!r}; in TOML, for example: [options] then n_threads = 4 on the next line"
        )
    return dict(value)


def read_toml_table(path: Path) -> dict[str, Any]:
    """A TOML file's top-level table, every way of failing to read it a ``ConfigError``."""
    shown = repr(str(path)) if len(str(path)) <= 200 else repr(str(path)[:200] + "...")
    if path.suffix != ".toml":
        raise ConfigError(
            f"{shown} is not a .toml config file. To open a model directly use "
            f"auto_engine({shown}), or pass load_engine({{'model': {shown}}})"
        )
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {shown}; check the path") from None
    except IsADirectoryError:
        raise ConfigError(
            f"{shown} is a directory, not a TOML config file; pass the path of the .toml file in it"
        ) from None
    except PermissionError:
        raise ConfigError(
            f"config file {shown} cannot be read: permission denied; make it readable "
            "(chmod u+r) or run as a user who may read it"
        ) from None
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise ConfigError(
                f"config path is too long ({len(str(path))} characters, more than the system allows): "
                f"{shown}; move the file to a shorter path"
            ) from None
        raise ConfigError(f"config file {shown} cannot be read: {exc.strerror or exc}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{shown} is not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start}); "
            "TOML files are UTF-8: save it as UTF-8 and retry"
        ) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{shown} is not valid TOML: {exc}. Fix the file and retry.") from exc
    return data


def _read_toml(path: Path) -> dict[str, Any]:
    data = read_toml_table(path)
    shown = repr(str(path)) if len(str(path)) <= 200 else repr(str(path)[:200] + "...")
    if "unillm" in data:
        if not isinstance(data["unillm"], dict):
            raise ConfigError(
                f"`unillm` in {shown} must be a table ([unillm] followed by its fields), "
                f"got {type(data['unillm']).__name__} {data['unillm']!r}"
            )
        data = data["unillm"]
    if "model" in data:
        data["model"] = model_in_file(data["model"], path.parent)
    if isinstance(data.get("variants"), list):
        data["variants"] = [model_in_file(v, path.parent) for v in data["variants"]]
    return data


def model_in_file(model: Any, folder: Path) -> Any:
    """A ``model`` written in a config file in ``folder``: a relative path is the file's folder's
    (so a config works from any working directory); a name (org/name:Q4_K_M) stays one, unless
    the folder holds a path spelled so. Every config file (engine, server) reads it by this rule."""
    if not isinstance(model, str) or Path(model).expanduser().is_absolute():
        return model
    beside = folder / model
    return str(beside) if parse_model_name(model) is None or beside.exists() else model


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
