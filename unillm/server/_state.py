"""What the server's routes share: the config, the models' pool, the metrics."""

from __future__ import annotations

from unillm.server._config import ServerConfig
from unillm.server._metrics import Metrics
from unillm.server._pool import Pool

__all__ = ["State"]


class State:
    """What the routes share: the config, the models, the metrics."""

    def __init__(self, config: ServerConfig, pool: Pool) -> None:
        self.config = config
        self.pool = pool
        self.metrics = Metrics(pool)
        self.api_key = config.resolved_api_key()
        # each served model's path, shown as its alias in any message a client sees
        self.paths = {s.engine.model: s.alias for s in config.models}
        self.load_error: str | None = None
