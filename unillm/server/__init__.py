"""``unillm serve``: an OpenAI- and Anthropic-compatible HTTP server over any backend.

    from unillm.server import ServerConfig, create_app, model_spec

    app = create_app(ServerConfig(models=(model_spec("tiny", {"model": "tiny.gguf"}),)))

Run ``app`` under uvicorn, or let ``unillm serve MODEL`` do it all (docs/server.md). Needs the
``server`` extra (FastAPI, uvicorn, prometheus-client).
"""

from __future__ import annotations

from unillm.server._app import create_app
from unillm.server._config import ModelSpec, ServerConfig, default_alias, model_spec, read_server_config
from unillm.server._pool import Busy, Pool, UnknownModel, served_config

__all__ = [
    "Busy",
    "ModelSpec",
    "Pool",
    "ServerConfig",
    "UnknownModel",
    "create_app",
    "default_alias",
    "model_spec",
    "read_server_config",
    "served_config",
]
