"""unillm's server on Ray Serve (``pip install 'unillm[ray]'``): an ingress and a model deployment
whose replicas each run one engine, chosen by the usual selection on the node the replica lands on,
routed by prompt prefix, scaled by Serve. docs/scaling-out.md shows it run.

    serve run unillm.server.ray:build_app model=qwen.gguf num_replicas=2
    unillm serve qwen.gguf --ray auto --replicas auto

Every route, limit, key and error is ``unillm serve``'s: each replica answers through the same app.
"""

from __future__ import annotations

from unillm.server.ray._build import RayAppArgs, build_app, replica_resources, split_args

__all__ = ["RayAppArgs", "build_app", "replica_resources", "split_args"]
