"""What the server's routes share: the config, the models' pool, the metrics."""

from __future__ import annotations

import asyncio

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
        #: shutting down: new requests get a 503, queued ones too; ``cut`` once the grace has
        #: passed, when the requests still running end with the protocol's error
        self.stopping = False
        self.cut = False

    def begin_shutdown(self) -> None:
        """Refuse what is new or waiting; what runs has ``grace_s`` to finish, then ends in a
        protocol error (a 503, or a stream's error event) rather than a cut connection."""
        if self.stopping:
            return
        self.stopping = True
        for slot in self.pool.slots.values():
            if slot.admission is not None:
                slot.admission.close()
        asyncio.get_running_loop().call_later(self.config.grace_s, self._cut)

    def _cut(self) -> None:
        self.cut = True
