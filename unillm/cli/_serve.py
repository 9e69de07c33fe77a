"""``unillm serve``: the HTTP server (``unillm.server``) from the command line."""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from unillm.cli._common import BackendOpt, OptionOpt, RunContextOpt, _bad, _console, _esc, _reported

__all__ = ["serve"]

_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def serve(
    model: Annotated[
        str | None,
        typer.Argument(
            help="A .gguf file or model directory to serve; or give --config.", show_default=False
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", help="A server TOML: settings and \\[models.<alias>] tables (docs/server.md)."
        ),
    ] = None,
    alias: Annotated[
        str | None, typer.Option(help="The name clients pass as `model`; default: MODEL's name.")
    ] = None,
    backend: BackendOpt = None,
    option: OptionOpt = None,
    context: RunContextOpt = None,
    concurrency: Annotated[
        int | None, typer.Option(help="Requests you expect at once: the workload the backend is chosen for.")
    ] = None,
    task: Annotated[
        Literal["generate", "embed", "rerank"] | None,
        typer.Option(help="What to load MODEL for; default: what it is (docs/embeddings.md)."),
    ] = None,
    pooling: Annotated[
        Literal["mean", "last", "cls"] | None,
        typer.Option(help="How an embedding model pools; default: the model's."),
    ] = None,
    host: Annotated[
        str | None, typer.Option(help="Address to bind (default 127.0.0.1: this machine only).")
    ] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8000); 0 picks a free one.")] = None,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="UNILLM_API_KEY", show_envvar=True, help="Require this Bearer key."),
    ] = None,
    max_queue: Annotated[int | None, typer.Option(help="Requests waiting per model; beyond: 429.")] = None,
    max_running: Annotated[int | None, typer.Option(help="Requests a batching engine runs at once.")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="Most new tokens one request may ask for.")] = None,
    max_body_bytes: Annotated[int | None, typer.Option(help="Largest request body; beyond: 413.")] = None,
    lazy: Annotated[bool | None, typer.Option("--lazy", help="Load each model on its first request.")] = None,
    ttl: Annotated[float | None, typer.Option(help="Unload a model idle this many seconds.")] = None,
    max_loaded: Annotated[int | None, typer.Option(help="Models loaded at once (LRU goes first).")] = None,
    grace: Annotated[float | None, typer.Option(help="Seconds in-flight requests get on shutdown.")] = None,
    write_timeout: Annotated[
        float | None, typer.Option(help="Cut off a client that reads none of its stream this many seconds.")
    ] = None,
    header_timeout: Annotated[
        float | None, typer.Option(help="Close a connection whose request headers take longer.")
    ] = None,
    body_timeout: Annotated[
        float | None, typer.Option(help="Longest wait for the next part of a request body (408).")
    ] = None,
    idle_timeout: Annotated[
        float | None, typer.Option(help="Close a kept-alive connection idle this long.")
    ] = None,
    max_connections: Annotated[
        int | None, typer.Option(help="Open connections at once; beyond: 503.")
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
    headless: Annotated[
        bool,
        typer.Option(
            "--headless",
            help="vLLM multi-node: run this node's workers (--option nnodes=N --option node_rank=R "
            "--option master_addr=ADDR) with no HTTP server, until Ctrl-C or SIGTERM.",
        ),
    ] = False,
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray",
            metavar="ADDRESS",
            help="Serve on a Ray cluster through Ray Serve (pip install 'unillm[ray]'): its address, "
            "'auto' (the one `ray start` made here) or 'local' (a new one in this process).",
        ),
    ] = None,
    replicas: Annotated[
        str | None,
        typer.Option(help="With --ray: model replicas, each one engine; 'auto' scales them (default 1)."),
    ] = None,
) -> None:
    """Serve models over the OpenAI (and Anthropic Messages) HTTP API: chat, completions,
    embeddings and rerank."""
    from unillm.cli._run import _loading, _parse_options
    from unillm.server import Pool, default_alias, model_spec, read_server_config, served_config

    if model is None and config is None:
        raise _bad("give MODEL, or --config with [models.<alias>] tables")
    if headless and model is None:
        raise _bad("--headless goes with MODEL, --backend vllm and the node options, not --config")
    opts = _parse_options(option)
    with _reported():
        specs = []
        if model is not None:
            from unillm import read_config

            engine = read_config(None, model=model, backend=backend, context_length=context,
                                 options=opts or None, concurrency=concurrency, task=task,
                                 pooling=pooling)  # fmt: skip
            if headless:
                from unillm.engines.vllm._headless import run_headless

                return run_headless(engine)
            name = default_alias(engine.model) if alias is None else alias  # --alias "" is refused
            specs.append(model_spec(name, engine.model_dump(exclude_unset=True)))
        elif alias is not None or backend or opts or context or concurrency or task or pooling:
            raise _bad("--alias, --backend, --option, --context, --concurrency, --task and --pooling go "
                       "with MODEL; with --config, set them in the [models.<alias>] tables")  # fmt: skip
        if replicas is not None and ray is None:
            raise _bad("--replicas goes with --ray ADDRESS (several replicas need Ray Serve)")
        cfg = read_server_config(
            config, models=specs, host=host, port=port, api_key=api_key, max_queue=max_queue,
            max_running=max_running, max_tokens=max_tokens, max_body_bytes=max_body_bytes, lazy=lazy,
            ttl_s=ttl, max_loaded=max_loaded, grace_s=grace, write_timeout_s=write_timeout,
            header_timeout_s=header_timeout, body_timeout_s=body_timeout, idle_timeout_s=idle_timeout,
            max_connections=max_connections,
        )  # fmt: skip
    _logging(log_level)
    err = _console(stderr=True)
    if cfg.host not in _LOOPBACK and not cfg.resolved_api_key():
        err.print(f"[yellow]warning:[/] listening on {_esc(cfg.host)} without an API key: anyone who "
                  "can reach it can use it (set --api-key or UNILLM_API_KEY)", highlight=False)  # fmt: skip
    if ray is not None:
        from unillm.server.ray import RayAppArgs
        from unillm.server.ray._run import serve_on_ray

        with _reported():
            return serve_on_ray(cfg, RayAppArgs(num_replicas=replicas or 1), address=ray)  # type: ignore[arg-type]  # "2" too: validated
    # the port first: a busy one fails now, not after minutes of loading (bound, not yet
    # listening: a client that comes during the load is refused at once, not left waiting)
    sock, family = _bind(cfg)
    pool = Pool(cfg)
    try:
        if not cfg.lazy:
            with _reported():
                for spec in cfg.models:
                    with _loading(spec.engine, label=spec.alias):
                        pool.adopt(spec.alias, _load(served_config(spec, cfg)))
    except BaseException:
        sock.close()
        pool_close(pool)
        raise
    _run(cfg, pool, sock, family)


def _load(config: Any) -> Any:
    from unillm import load_engine

    return load_engine(config)


def _bind(cfg: Any) -> tuple[socket.socket, int]:
    """The server's socket, bound to ``cfg``'s address (a busy port is a usage error, exit 2)."""
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.host, cfg.port))
    except OSError as exc:
        sock.close()
        raise _bad(
            f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}; pick another --port"
        ) from exc
    return sock, family


def _run(cfg: Any, pool: Any, sock: socket.socket, family: int) -> None:
    import uvicorn

    from unillm.server import create_app

    sock.listen(2048)  # connections queue from now on, before uvicorn starts serving them
    bound = sock.getsockname()[1]
    shown = f"[{cfg.host}]" if family == socket.AF_INET6 else cfg.host
    aliases = ", ".join(s.alias for s in cfg.models)
    print(
        f"unillm serve: listening on http://{shown}:{bound}/v1 (models: {aliases})",
        file=sys.stderr,
        flush=True,
    )
    from unillm.server._protocol import uvicorn_options

    app = create_app(cfg, pool=pool)
    state = app.state.unillm
    options = uvicorn_options(state)
    if "http" not in options:
        logging.getLogger("unillm.server").warning(
            "httptools is not installed: header_timeout_s, max_connections and the header limits are "
            "not enforced (pip install 'unillm[server]')"
        )

    class Server(uvicorn.Server):  # type: ignore[misc]
        def handle_exit(self, sig: int, frame: Any) -> None:
            # at the first signal: new and queued requests get a 503, running ones grace_s
            if not self.should_exit and self.started:
                asyncio_loop = getattr(self, "_unillm_loop", None)
                if asyncio_loop is not None:
                    asyncio_loop.call_soon_threadsafe(state.begin_shutdown)
            super().handle_exit(sig, frame)

        async def startup(self, sockets: Any = None) -> None:
            import asyncio

            self._unillm_loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

    server = Server(
        uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            # a backstop only: past grace_s the requests still running end in the protocol's
            # error (begin_shutdown), which leaves uvicorn nothing to cancel
            timeout_graceful_shutdown=int(cfg.grace_s) + 10,
            lifespan="on",
            **options,
        )
    )
    server.run(sockets=[sock])


def pool_close(pool: Any) -> None:
    import asyncio

    asyncio.run(pool.close())


def _logging(level: str) -> None:
    value = logging.getLevelName(level.upper())
    if not isinstance(value, int):
        raise _bad(f"--log-level {level!r} is not one of debug, info, warning, error")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("unillm.server", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(value)
        logger.propagate = False
