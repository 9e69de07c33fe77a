"""``unillm serve MODEL --ray ADDRESS``: connect to a Ray cluster (or start one on this machine),
run the application on it, say where it listens, and take it down again on Ctrl-C or SIGTERM."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from typing import Any

from unillm._errors import ConfigError, UnillmError
from unillm.server._config import ServerConfig
from unillm.server.ray._build import RayAppArgs, application, direct

__all__ = ["DeployFailed", "serve_on_ray", "wait_running"]


class DeployFailed(UnillmError):
    """The application did not come up on the cluster (the message says what Serve reported)."""


def wait_running(name: str, timeout_s: float, *, progress: Any = None) -> None:
    """Wait until Serve reports application ``name`` running, at most ``timeout_s`` (``serve.run``
    itself waits forever when the cluster cannot place the replicas).

    :raises DeployFailed: when it failed, or is still not running at the deadline, with Serve's words.
    """
    from ray import serve

    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        app = serve.status().applications.get(name)
        status = str(app.status) if app is not None else "NOT_STARTED"
        if status.endswith("RUNNING"):
            return
        said = _said(app)
        if status.endswith("DEPLOY_FAILED") or status.endswith("UNHEALTHY"):
            raise DeployFailed(f"Ray Serve could not start {name!r}: {said or status}")
        if time.monotonic() > deadline:
            raise DeployFailed(
                f"{name!r} is not running after {timeout_s:g} s ({status}): {said or 'no word from Serve'}; "
                "check that the cluster has the CPUs, GPUs and memory each replica asks for (`ray status`), "
                "or ask for less (replica_cpus, replica_memory)"
            )
        if progress is not None and said and said != last:
            progress(said)
            last = said
        time.sleep(0.5)


def _said(app: Any) -> str:
    if app is None:
        return ""
    words = [app.message] if app.message else []
    for name, dep in app.deployments.items():
        if dep.message:
            words.append(f"{name}: {dep.message}")
    return "; ".join(words)


def serve_on_ray(
    cfg: ServerConfig,
    ray_args: RayAppArgs,
    *,
    address: str,
    name: str = "unillm",
    timeout_s: float = 600.0,
    stop: threading.Event | None = None,
) -> None:
    """Run ``cfg``'s models as a Serve application on the cluster at ``address`` ("auto": the one
    ``ray start`` made here; "local": a new one in this process) until ``stop`` is set, SIGINT or
    SIGTERM; then delete the application (the cluster stays up)."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise ConfigError("--ray needs Ray Serve: pip install 'unillm[ray]'") from exc
    if cfg.port == 0:
        raise ConfigError("--ray needs a fixed --port: Serve's proxy on every node listens on the same one")
    ray.init(address=None if address == "local" else address, logging_level=logging.WARNING)
    try:
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
        serve._run(application(ray_args, cfg), name=name, route_prefix="/", _blocking=False)
        wait_running(name, timeout_s, progress=lambda said: print(f"unillm serve: {said}", file=sys.stderr))
        from ray.serve.context import _get_global_client

        http = _get_global_client().http_config  # type: ignore[union-attr]  # Serve's own, if it ran before
        if (http.host, http.port) != (cfg.host, cfg.port):
            print(f"unillm serve: Ray Serve was already running on this cluster; its proxies listen on "
                  f"{http.host}:{http.port}, not on the address asked", file=sys.stderr)  # fmt: skip
        aliases, proxies = ", ".join(s.alias for s in cfg.models), len(serve.status().proxies)
        front = "HAProxy, straight to the replicas" if direct(ray_args) else f"{proxies} proxies"
        print(f"unillm serve: listening on http://{http.host}:{http.port}/v1 through Ray Serve "
              f"({front}; models: {aliases})", file=sys.stderr, flush=True)  # fmt: skip
        done = stop or threading.Event()
        previous = {s: signal.signal(s, lambda *_: done.set()) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            done.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        serve.delete(name)
    finally:
        ray.shutdown()
