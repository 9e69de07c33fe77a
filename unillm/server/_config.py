"""What ``unillm serve`` runs: the server's settings and the models it serves under aliases.

A TOML file holds both (``unillm serve --config server.toml``)::

    host = "127.0.0.1"
    max_queue = 32

    [models.chat]                # the alias clients name as "model"
    model = "qwen.gguf"          # the rest is the engine config load_engine takes
    backend = "llama.cpp"
    context_length = 4096

    [models.chat.options]
    n_threads = 8

A model table may also carry ``max_running`` and ``max_queue``, which override the server's for
that alias. Relative model paths are read from the file's directory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from unillm._config import model_in_file
from unillm._errors import ConfigError
from unillm._params import EngineConfig, Validated

__all__ = ["ModelSpec", "ServerConfig", "read_server_config"]

API_KEY_ENV = "UNILLM_API_KEY"
# An alias is a name, never a path: no slash, no dot first, nothing a shell or URL would mangle.
_ALIAS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
# Keys of a model table that belong to the server, not to the engine config.
_SERVER_KEYS = ("max_running", "max_queue")


class ModelSpec(Validated):
    """One served model: its alias, the engine config it loads from, and its admission limits."""

    alias: str = Field(description="The name clients pass as `model`.")
    engine: EngineConfig = Field(description="What load_engine loads.")
    max_running: int | None = Field(
        default=None, ge=1, le=100_000, description="Requests generating at once; default: the server's."
    )
    max_queue: int | None = Field(
        default=None, ge=0, le=100_000, description="Requests waiting at most; default: the server's."
    )

    @field_validator("alias")
    @classmethod
    def _alias_is_a_name(cls, value: str) -> str:
        if not _ALIAS.match(value):
            raise ValueError(
                f"{value!r} is not a model alias: use letters, digits and . _ : - (at most 128), "
                "starting with a letter or digit"
            )
        return value


class ServerConfig(Validated):
    """How the server listens, what it accepts, and the models it serves."""

    models: tuple[ModelSpec, ...] = Field(description="The served models, one alias each.")
    host: str = Field(default="127.0.0.1", description="Address to bind; 0.0.0.0 exposes it to the network.")
    port: int = Field(default=8000, ge=0, le=65535, description="TCP port; 0 picks a free one.")
    api_key: str | None = Field(
        default=None, repr=False, description=f"Bearer key clients must send; default: ${API_KEY_ENV}."
    )
    max_body_bytes: int = Field(default=4 << 20, ge=1024, description="Largest request body (413 above).")
    max_tokens: int = Field(default=4096, ge=1, description="Most new tokens one request may ask for.")
    max_running: int = Field(
        default=64,
        ge=1,
        le=100_000,
        description="Requests a batching engine generates at once (an engine that runs one at a time "
        "always takes 1).",
    )
    max_queue: int = Field(
        default=64, ge=0, le=100_000, description="Requests waiting per model; beyond it: 429."
    )
    lazy: bool = Field(default=False, description="Load each model on its first request, not at start.")
    ttl_s: float | None = Field(
        default=None, gt=0, description="Unload a model idle this long (it reloads on demand)."
    )
    max_loaded: int | None = Field(
        default=None, ge=1, description="Models loaded at once; the least recently used goes first."
    )
    grace_s: float = Field(
        default=30.0, ge=0, description="On shutdown, how long in-flight requests may finish."
    )
    access_log: bool = Field(default=True, description="One log line per request.")
    write_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A client that takes none of its streamed answer this long is cut "
        "off (its request cancelled, its connection closed); generation never waits on a client.",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="A connection's request headers must arrive within this many "
        "seconds (of the connection's start, or of the request's first byte); else it is closed.",
    )
    body_timeout_s: float = Field(
        default=30.0, gt=0, description="Longest wait for the next part of a request body (408 beyond)."
    )
    idle_timeout_s: float = Field(
        default=5.0, gt=0, description="A kept-alive connection with no request this long is closed."
    )
    max_connections: int = Field(
        default=1024, ge=1, le=1_000_000, description="Open connections at once; one more gets a 503."
    )
    max_header_bytes: int = Field(
        default=64 << 10, ge=1024, description="Largest request line and headers together (431 above)."
    )
    max_headers: int = Field(
        default=100, ge=8, le=10_000, description="Most headers a request may send (431 above)."
    )

    @field_validator("models")
    @classmethod
    def _one_alias_each(cls, value: tuple[ModelSpec, ...]) -> tuple[ModelSpec, ...]:
        if not value:
            raise ValueError("no models to serve: give a model, or [models.<alias>] tables in the config")
        seen: set[str] = set()
        for spec in value:
            if spec.alias in seen:
                raise ValueError(f"the alias {spec.alias!r} names two models; give each its own")
            seen.add(spec.alias)
        return value

    def spec(self, alias: str) -> ModelSpec | None:
        return next((s for s in self.models if s.alias == alias), None)

    def resolved_api_key(self, env: Mapping[str, str] | None = None) -> str | None:
        """The key clients must send: the configured one, else ``$UNILLM_API_KEY``, else None."""
        if self.api_key:
            return self.api_key
        key = (os.environ if env is None else env).get(API_KEY_ENV, "").strip()
        return key or None


def default_alias(model: str) -> str:
    """A model's alias when none is given: its file or directory name, without ``.gguf``."""
    name = Path(model.rstrip("/")).name
    name = name[: -len(".gguf")] if name.lower().endswith(".gguf") else name
    name = re.sub(r"[^A-Za-z0-9._:-]", "-", name).lstrip(".-_:")[:128]
    return name or "model"


def model_spec(alias: str, table: Mapping[str, Any], *, base: Path | None = None) -> ModelSpec:
    """A ``ModelSpec`` from a model table: engine config keys plus the server's own."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"[models.{alias}] must be a table of engine config keys, got {table!r}")
    engine = {k: v for k, v in table.items() if k not in _SERVER_KEYS}
    if "model" in engine and base is not None:
        engine["model"] = model_in_file(engine["model"], base)
    if "model" not in engine:
        raise ConfigError(
            f"[models.{alias}] needs `model`: the path of a .gguf file or model directory, or a model's name"
        )
    server = {k: table[k] for k in _SERVER_KEYS if k in table}
    return ModelSpec(alias=alias, engine=EngineConfig(**engine), **server)


def read_server_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> ServerConfig:
    """A ``ServerConfig`` from a TOML file (``[models.<alias>]`` tables), then ``overrides``.

    ``overrides`` set server fields (``host=``, ``port=``, ...; None leaves a field as it is);
    ``models=`` adds ``ModelSpec``s to the file's.
    """
    data: dict[str, Any] = {}
    specs: list[ModelSpec] = []
    if path is not None:
        from unillm._config import read_toml_table

        source = Path(path)
        data = read_toml_table(source)
        tables = data.pop("models", {})
        if not isinstance(tables, Mapping):
            raise ConfigError(f"`models` in {str(source)!r} must be tables: [models.<alias>]")
        specs = [model_spec(a, t, base=source.parent) for a, t in tables.items()]
    extra = overrides.pop("models", None) or ()
    specs.extend(extra)
    data.update({k: v for k, v in overrides.items() if v is not None})
    return ServerConfig(models=tuple(specs), **data)
