"""``build_app``: unillm's server as a Ray Serve application (an ingress, and a model deployment
whose replicas each run one engine), from the arguments ``serve run`` or a Serve config file gives."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator

from unillm._errors import ConfigError, UnillmError
from unillm._params import Validated
from unillm.server._config import ServerConfig, default_alias, model_spec, read_server_config

__all__ = ["RayAppArgs", "application", "build_app", "replica_resources", "split_args"]

_SERVER_ONLY = ("models", "host", "port")  # the proxy listens, not the replicas


class RayAppArgs(Validated):
    """How the application spreads over the cluster (the rest of ``build_app``'s arguments are the
    server's settings and the model's engine config, as ``unillm serve`` takes them)."""

    num_replicas: int | Literal["auto"] = Field(
        default=1, description="Model replicas, each one engine; auto: scale between min and max."
    )
    min_replicas: int = Field(
        default=1, ge=0, description="With auto: the fewest replicas (0: none when idle)."
    )
    max_replicas: int = Field(default=4, ge=1, description="With auto: the most replicas.")
    target_ongoing_requests: float = Field(
        default=8.0, gt=0, description="With auto: requests per replica Serve scales to keep."
    )
    upscale_delay_s: float = Field(
        default=5.0, ge=0, description="With auto: load lasting this long adds a replica."
    )
    downscale_delay_s: float = Field(
        default=60.0, ge=0, description="With auto: idleness lasting this long removes a replica."
    )
    autoscaling: dict[str, Any] = Field(
        default_factory=dict, description="With auto: any other key of Serve's autoscaling_config, as given."
    )
    router: Literal["prefix", "default"] = Field(
        default="prefix",
        description="prefix: same prompt prefix, same replica; default: Serve's power of two.",
    )
    imbalance: int = Field(
        default=8,
        ge=1,
        description="Queue length over the shortest at which a prefix's replica is passed over.",
    )
    replica_cpus: float | None = Field(
        default=None,
        ge=0,
        description="CPUs each replica asks Ray for; default: the engine's threads, else 1.",
    )
    replica_gpus: float | None = Field(
        default=None, ge=0, description="GPUs each replica asks for; default: the plan's GPU count."
    )
    replica_memory: int | None = Field(
        default=None,
        ge=0,
        description="Bytes of memory each replica asks for; default: the plan's resident bytes.",
    )
    stream_interval_ms: float = Field(
        default=50.0,
        ge=0,
        description="A replica sends a stream's pieces at most this often, what came meanwhile as one "
        "(each piece costs two messages through Ray); 0: every piece as written.",
    )
    ingress: Literal["auto", "proxy", "direct"] = Field(
        default="auto",
        description="proxy: Serve's proxy, then unillm's ingress deployment, then a replica; direct: "
        "HAProxy straight to a replica (Serve's high-throughput mode, RAY_SERVE_ENABLE_HA_PROXY=1); "
        "auto: direct when that is set here.",
    )
    ingress_replicas: int = Field(
        default=1, ge=1, description="Replicas of the (light) ingress, or of the direct router."
    )
    retries: int = Field(
        default=2, ge=0, description="Other replicas a request is sent to when its replica dies."
    )
    stats_period_s: float = Field(
        default=2.0,
        gt=0,
        description="How often the ingress asks replicas for their KV use (the router reads it).",
    )
    health_check_period_s: float = Field(
        default=10.0, gt=0, description="How often Serve checks each replica."
    )

    @field_validator("num_replicas", mode="before")
    @classmethod
    def _count(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, int) and value < 1:
            raise ValueError(f"num_replicas must be 1 or more, or 'auto', not {value}")
        return value


def split_args(args: Mapping[str, Any]) -> tuple[RayAppArgs, ServerConfig]:
    """``build_app``'s arguments as the Ray settings and the server's config: ``config`` (a server
    TOML), ``model`` (and ``alias``) with any engine config key, and the server's own fields."""
    args = dict(args)
    ray_keys = {k: args.pop(k) for k in list(args) if k in RayAppArgs.model_fields}
    path = args.pop("config", None)
    server = {k: args.pop(k) for k in list(args) if k in ServerConfig.model_fields and k not in _SERVER_ONLY}
    refused = [k for k in _SERVER_ONLY if k in args]
    if refused:
        raise ConfigError(
            f"{', '.join(refused)} are not build_app arguments: Serve's proxy listens (serve start "
            "--http-host/--http-port, or http_options in the Serve config)"
        )
    specs = []
    if "model" in args:
        alias = args.pop("alias", None) or default_alias(str(args["model"]))
        specs.append(model_spec(str(alias), args))
    elif args:
        raise ConfigError(
            f"{', '.join(sorted(args))}: engine settings need `model` (or a `config` file's tables)"
        )
    cfg = read_server_config(path, models=specs, **server)  # none at all: its own ConfigError
    return RayAppArgs(**ray_keys), cfg


def replica_resources(ray_args: RayAppArgs, cfg: ServerConfig) -> dict[str, Any]:
    """The ``ray_actor_options`` of a model replica: CPUs, GPUs and memory, as asked or planned."""
    gpus, memory = _planned(cfg)
    cpus = ray_args.replica_cpus
    if cpus is None:
        threads = [s.engine.options.get("n_threads") for s in cfg.models]
        cpus = float(max((t for t in threads if isinstance(t, int)), default=1))
    out: dict[str, Any] = {"num_cpus": cpus}
    asked_gpus = ray_args.replica_gpus if ray_args.replica_gpus is not None else gpus
    if asked_gpus:
        out["num_gpus"] = asked_gpus
    memory = ray_args.replica_memory if ray_args.replica_memory is not None else memory
    if memory:
        out["memory"] = memory
    return out


def _planned(cfg: ServerConfig) -> tuple[int, int]:
    """GPUs and resident bytes the memory plan gives all of ``cfg``'s models on this machine (the
    cluster's nodes are taken to be like it); (0, 0) for a model the planner cannot size."""
    from unillm._choose._auto import workload_for
    from unillm._choose._registry import default_registry
    from unillm._hardware import detect_hardware
    from unillm._plan._estimate import plan

    gpus = memory = 0
    hardware = detect_hardware()
    for spec in cfg.models:
        try:
            info = default_registry().inspect_model(spec.engine.model)
            p = plan(info, hardware, workload_for(spec.engine, info))
        except (UnillmError, OSError):
            continue
        gpus = max(gpus, sum(1 for pl in p.placements if pl.device.startswith("gpu")))
        memory += p.resident_bytes or p.total_bytes
    return gpus, memory


def build_app(args: Mapping[str, Any]) -> Any:
    """unillm's server as a Ray Serve application: ``serve run unillm.server.ray:build_app
    model=m.gguf num_replicas=2``, a Serve config's ``import_path``, or ``serve.run(build_app({...}))``.

    :param args: ``model`` (and ``alias``) with engine config keys (``backend``, ``context_length``,
        ``options``, ...) or ``config`` (a server TOML); the server's settings (``api_key``,
        ``max_running``, ...); and :class:`RayAppArgs`' fields.
    :returns: the application (``serve.run`` it).
    :raises ConfigError: for an argument that is not one of these, or a bad value, saying which.
    """
    return application(*split_args(args))


def application(ray_args: RayAppArgs, cfg: ServerConfig) -> Any:
    """The application ``build_app`` builds, from its arguments already split."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from unillm.server.ray._ingress import Ingress
    from unillm.server.ray._replica import Replica
    from unillm.server.ray._router import PrefixRouter

    options: dict[str, Any] = {
        "ray_actor_options": replica_resources(ray_args, cfg),
        # unillm's own admission answers 429 past the queue: Serve passes everything up to it
        "max_ongoing_requests": max(s.max_running or cfg.max_running for s in cfg.models)
        + max(s.max_queue if s.max_queue is not None else cfg.max_queue for s in cfg.models),
        "health_check_period_s": ray_args.health_check_period_s,
        "graceful_shutdown_timeout_s": cfg.grace_s,
    }
    if ray_args.num_replicas == "auto":
        options["autoscaling_config"] = {
            "min_replicas": ray_args.min_replicas,
            "initial_replicas": max(ray_args.min_replicas, 1),
            "max_replicas": ray_args.max_replicas,
            "target_ongoing_requests": ray_args.target_ongoing_requests,
            "upscale_delay_s": ray_args.upscale_delay_s,
            "downscale_delay_s": ray_args.downscale_delay_s,
            **ray_args.autoscaling,
        }
    else:
        options["num_replicas"] = ray_args.num_replicas
    if ray_args.router == "prefix":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixRouter,  # type: ignore[arg-type]  # a class, as Serve documents
            request_router_kwargs={"imbalance": ray_args.imbalance},
        )
    if direct(ray_args):
        return _direct_application(ray_args, cfg, options)
    model = serve.deployment(Replica, name="UnillmModel").options(**options)  # type: ignore[attr-defined]
    ingress = serve.deployment(Ingress, name="UnillmIngress").options(  # type: ignore[attr-defined]
        num_replicas=ray_args.ingress_replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000,
    )
    model_app = model.bind(cfg, ray_args.stream_interval_ms)
    return ingress.bind(model_app, cfg, ray_args.retries, ray_args.stats_period_s)


def direct(ray_args: RayAppArgs) -> bool:
    """Whether the application takes the direct shape (unillm/server/ray/_direct.py)."""
    from unillm.server.ray._direct import haproxy_enabled

    return ray_args.ingress == "direct" or (ray_args.ingress == "auto" and haproxy_enabled())


def _direct_application(ray_args: RayAppArgs, cfg: ServerConfig, options: dict[str, Any]) -> Any:
    """HAProxy asks the router for a replica, then sends the request straight to it."""
    from ray import serve

    from unillm.server.ray._direct import DirectReplica, DirectRouter, haproxy_enabled

    if not haproxy_enabled():
        raise ConfigError(
            "ingress=direct needs Ray Serve's HAProxy: set RAY_SERVE_ENABLE_HA_PROXY=1 and "
            "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1 where Ray and this app start "
            "(docs/scaling-out.md), or leave ingress=auto"
        )
    # no stream interval: a replica writes to HAProxy's connection itself, as unillm serve does
    model = serve.deployment(serve.ingress()(DirectReplica), name="UnillmModel").options(**options)  # type: ignore[attr-defined]
    model_app = model.bind(cfg, 0.0)
    router = serve.deployment(serve.ingress()(DirectRouter), name="UnillmRouter").options(  # type: ignore[attr-defined]
        num_replicas=ray_args.ingress_replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000,
    )
    # Serve's (private) hook for an ingress request router, as Ray Serve LLM's direct streaming uses
    return model_app._with_ingress_request_router(router.bind(model_app, cfg, ray_args.stats_period_s))
