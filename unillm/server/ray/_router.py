"""Prefix-aware routing: a request whose prompt starts like an earlier one goes to the replica that
served that one, whose KV cache still holds the prefix; otherwise to the least loaded replica.

The ingress cuts the prompt (the model's alias, then the system prompt and the messages as sent, or
the completion prompt) into blocks of ``BLOCK_CHARS`` characters and hashes each block together with
all before it (:func:`prefix_hashes`), so that hash ``i`` names the first ``i + 1`` blocks. The router
remembers the replica each hash first went to and sends a request to the replica of its longest
known hash (a request that overflows elsewhere, below, leaves the prefix where it was). Characters
stand in for tokens: the chat template renders the system prompt and the messages in the order they
are sent, so equal leading text is an equal leading prompt.

Load comes first when it must: a replica whose queue is ``imbalance`` requests longer than the
shortest, or whose KV cache is full (``kv_usage`` in the replica's latest report, made from its
engine's ``kv_stats``: unillm/server/ray/_metrics.py), loses the request to the least loaded one.
A prefix seen for the first time goes to the replica holding the fewest prefixes, then the least
loaded: prefixes spread over the replicas.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, OrderedDict
from typing import Any

from ray.serve._private.common import ReplicaID
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import RequestRouter

__all__ = ["BLOCK_CHARS", "PrefixRouter", "prefix_hashes", "prefix_text"]

BLOCK_CHARS = 256
"""Characters per hashed block: a prefix shorter than one block is not routed by prefix."""
MAX_BLOCKS = 64
"""Blocks hashed per request (16k characters): longer prompts are routed by their first 64 blocks."""
KV_FULL = 0.95
"""A replica whose KV cache is this full evicts prefixes as fast as it takes them: routed by load."""


def prefix_text(path: str | None, body: Any) -> str | None:
    """What a request's prompt starts with, as text, or ``None`` when it has no prompt to route by.
    ``path`` ``None``: the route is told by the body's fields (the direct router sees no path)."""
    if not isinstance(body, dict):
        return None
    if path is None:
        path = _route_of(body)
    parts: list[Any] = [body.get("model")]
    if path.endswith("/messages"):  # Anthropic's: the system prompt is a field of its own
        parts += [body.get("system"), body.get("messages")]
    elif path.endswith("/chat/completions"):
        parts.append(body.get("messages"))
    elif path.endswith("/completions"):
        parts.append(body.get("prompt"))
    else:
        return None
    try:
        return json.dumps(parts, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    except (TypeError, ValueError):
        return None


def _route_of(body: dict[str, Any]) -> str:
    """The route a request body was sent to, by its fields: a ``prompt`` is a completion, a
    ``system`` field Anthropic's, other ``messages`` a chat."""
    if "prompt" in body:
        return "/v1/completions"
    if "messages" in body:
        return "/v1/messages" if "system" in body else "/v1/chat/completions"
    return "/"


def prefix_hashes(text: str | None) -> list[bytes]:
    """One hash per whole block of ``text``, each over all the blocks up to it."""
    if not text:
        return []
    out: list[bytes] = []
    h = hashlib.blake2b(digest_size=16)
    for i in range(min(len(text) // BLOCK_CHARS, MAX_BLOCKS)):
        h.update(text[i * BLOCK_CHARS : (i + 1) * BLOCK_CHARS].encode("utf-8", "surrogatepass"))
        out.append(h.copy().digest())
    return out


class PrefixRouter(RequestRouter):
    """Serve's request router for unillm's model deployment (the module docstring says how it
    chooses). Its kwargs (``RequestRouterConfig.request_router_kwargs``): ``imbalance`` (default 8)
    and ``capacity`` (hashes remembered, default 100,000; the oldest go first). ``decisions``
    counts what it decided (and ``_metrics.DECISIONS`` for the whole process).

    The replica chosen for a request goes to that request (Serve's default matching; its
    ``FIFOMixin`` would hand it to the oldest request waiting, whatever its prefix).

    Serve pickles this class by value (its module's globals are copies where it runs): what it
    shares with the ingress (``REPORTS``, ``DECISIONS``, ``SEEN``) it imports from ``_metrics``
    when called."""

    def initialize_state(self, imbalance: int = 8, capacity: int = 100_000, **_: Any) -> None:
        self._imbalance = max(1, int(imbalance))
        self._capacity = max(1, int(capacity))
        self._owner: OrderedDict[bytes, ReplicaID] = OrderedDict()
        self._prefixes: dict[ReplicaID, int] = {}
        self.decisions: Counter[str] = Counter()

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        from unillm.server.ray._metrics import SEEN

        super().update_replicas(replicas)
        SEEN["replicas"] = len(self._replicas)
        gone = [h for h, r in self._owner.items() if r not in self._replicas]
        for h in gone:  # a replaced replica's cache is gone with it
            del self._owner[h]
        self._prefixes = {r: n for r, n in self._prefixes.items() if r in self._replicas}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        load = {r.replica_id: self._load(r) for r in candidate_replicas}
        by_load = sorted(candidate_replicas, key=lambda r: load[r.replica_id])
        least = load[by_load[0].replica_id]
        hashes = _hashes_of(pending_request)
        owner = next((self._owner[h] for h in reversed(hashes) if h in self._owner), None)
        chosen = next((r for r in candidate_replicas if r.replica_id == owner), None)
        if chosen is not None:
            if load[chosen.replica_id] - least < self._imbalance and not _kv_full(chosen):
                self._decided("prefix")
                return [[chosen], [r for r in by_load if r is not chosen]]
            self._decided("overflow")  # the others by load, its own replica last
            return [[r] for r in by_load if r is not chosen] + [[chosen]]
        if hashes:
            self._decided("new")
            fewest = sorted(
                candidate_replicas, key=lambda r: (self._prefixes.get(r.replica_id, 0), load[r.replica_id])
            )
            # claimed now, not once routed: the requests routed meanwhile see it taken
            self._claim(hashes, fewest[0].replica_id)
            return [[fewest[0]], [r for r in by_load if r is not fewest[0]]]
        self._decided("load")
        # the least loaded first; Serve asks each in turn whether it takes the request
        return [[r] for r in by_load]

    def _decided(self, what: str) -> None:
        from unillm.server.ray._metrics import DECISION_KINDS, DECISIONS

        assert what in DECISION_KINDS, what
        self.decisions[what] += 1
        DECISIONS[what] += 1

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._claim(_hashes_of(pending_request), replica_id)

    def _claim(self, hashes: list[bytes], replica_id: ReplicaID) -> None:
        """Record that ``replica_id`` holds (or is about to) the prefixes ``hashes`` name that no
        replica holds yet. A prefix keeps its replica when a request of it overflows to another:
        otherwise the prefixes would drift, one overflow at a time, to whichever replica took the
        last one, and pile up there once the load drops."""
        if not hashes:
            return
        if hashes[0] not in self._owner:
            self._prefixes[replica_id] = self._prefixes.get(replica_id, 0) + 1
        for h in hashes:
            self._owner.setdefault(h, replica_id)
            self._owner.move_to_end(h)
        while len(self._owner) > self._capacity:
            self._owner.popitem(last=False)

    def _load(self, replica: RunningReplica) -> int:
        queued = self._replica_queue_len_cache.get(replica.replica_id)
        return 0 if queued is None else int(queued)


def _hashes_of(pending: PendingRequest | None) -> list[bytes]:
    if pending is None:
        return []
    found = pending.kwargs.get("prefix")
    return list(found) if isinstance(found, (list, tuple)) else []


def _kv_full(replica: RunningReplica) -> bool:
    from unillm.server.ray._metrics import REPORTS

    usage = REPORTS.get(replica.replica_id.unique_id, {}).get("kv_usage")
    return isinstance(usage, (int, float)) and usage >= KV_FULL
