"""The parts of unillm.server.ray that need no cluster: build_app's arguments, the replica's
resources, the prefix the ingress names, the router's choice, the in-process ASGI bridge and the
metrics relabelling. The cluster itself: tests/test_ray_serve.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from unillm import ConfigError

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'unillm[ray]'")

from unillm.server.ray import RayAppArgs, replica_resources, split_args
from unillm.server.ray._metrics import relabeled
from unillm.server.ray._replica import asgi_stream
from unillm.server.ray._router import BLOCK_CHARS, PrefixRouter, prefix_hashes, prefix_text

# ---- build_app's arguments ----


def test_arguments_split_into_ray_server_and_engine_settings_as_serve_run_passes_them() -> None:
    ray_args, cfg = split_args({"model": "m.gguf", "alias": "chat", "num_replicas": "2", "api_key": "k",
                                "context_length": "2048", "router": "default"})  # fmt: skip
    assert ray_args.num_replicas == 2 and ray_args.router == "default"
    assert cfg.api_key == "k" and cfg.models[0].alias == "chat"
    assert cfg.models[0].engine.context_length == 2048 and cfg.models[0].engine.model == "m.gguf"
    assert split_args({"model": "m.gguf", "num_replicas": "auto"})[0].num_replicas == "auto"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({}, "no models to serve"),
        ({"backend": "llama.cpp"}, "need `model`"),
        ({"model": "m.gguf", "port": 9000}, "Serve's proxy listens"),
        ({"model": "m.gguf", "num_replicas": 0}, "num_replicas"),
        ({"model": "m.gguf", "num_replicas": "many"}, "num_replicas"),
        ({"model": "m.gguf", "router": "random"}, "router"),
        ({"model": "m.gguf", "no_such_key": 1}, "no_such_key"),
    ],
)
def test_a_bad_argument_is_a_config_error_naming_it(args: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        split_args(args)


def test_replica_resources_are_the_engines_threads_and_the_plans_memory(tiny_gguf: Path) -> None:
    ray_args, cfg = split_args({"model": str(tiny_gguf), "options": {"n_threads": 3}})
    res = replica_resources(ray_args, cfg)
    assert res["num_cpus"] == 3 and "num_gpus" not in res  # no GPU here
    assert 1_000_000 < res["memory"] < 1 << 30  # the tiny model's plan: MBs, not GBs
    asked = replica_resources(RayAppArgs(replica_cpus=0.5, replica_memory=123, replica_gpus=1), cfg)
    assert asked == {"num_cpus": 0.5, "num_gpus": 1, "memory": 123}


# ---- the prefix the ingress names, and the router's choice ----


def test_the_prefix_is_the_prompts_leading_blocks_and_differs_by_model_and_route() -> None:
    system = "s" * (3 * BLOCK_CHARS)
    chat = {
        "model": "a",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "x"}],
    }
    other = {**chat, "messages": [chat["messages"][0], {"role": "user", "content": "y" * 999}]}
    a, b = (
        prefix_hashes(prefix_text("/v1/chat/completions", chat)),
        prefix_hashes(prefix_text("/v1/chat/completions", other)),
    )
    assert len(a) >= 3 and a[:3] == b[:3] and a[-1] != b[-1]  # the system prompt's blocks are shared
    assert prefix_hashes(prefix_text("/v1/chat/completions", {**chat, "model": "b"}))[0] != a[0]
    anthropic = {"model": "a", "system": system, "messages": [{"role": "user", "content": "x"}]}
    assert prefix_hashes(prefix_text("/v1/messages", anthropic))
    assert prefix_hashes(prefix_text("/v1/completions", {"model": "a", "prompt": system}))
    for path, body in [("/v1/embeddings", chat), ("/v1/chat/completions", ["not", "a", "dict"]),
                       ("/v1/chat/completions", {"model": "a", "messages": "short"})]:  # fmt: skip
        assert prefix_hashes(prefix_text(path, body)) == []
    # the direct router sees the body alone: its fields tell the route, to the same text
    completion = {"model": "a", "prompt": system}
    routes = [("/v1/chat/completions", chat), ("/v1/messages", anthropic), ("/v1/completions", completion)]
    for path, body in routes:
        assert prefix_text(None, body) == prefix_text(path, body), path
    assert prefix_text(None, {"model": "a", "input": system}) is None  # embeddings: no prompt to route by


def test_the_direct_shape_without_haproxy_is_a_config_error_saying_what_to_set() -> None:
    from unillm.server.ray._build import application

    ray_args, cfg = split_args({"model": "m.gguf", "backend": "llama.cpp", "ingress": "direct"})
    with pytest.raises(ConfigError, match="RAY_SERVE_ENABLE_HA_PROXY=1"):
        application(ray_args, cfg)
    with pytest.raises(ConfigError, match="ingress"):
        split_args({"model": "m.gguf", "ingress": "haproxy"})


@dataclass(frozen=True)
class _Id:
    unique_id: str


@dataclass
class _Replica:  # what the router reads of Serve's RunningReplica
    replica_id: _Id
    max_ongoing_requests: int = 100


@dataclass
class _Pending:
    kwargs: dict[str, Any]


class _Queues:
    def __init__(self) -> None:
        self.lengths: dict[_Id, int] = {}

    def get(self, replica_id: _Id) -> int | None:
        return self.lengths.get(replica_id)


def _router(
    imbalance: int = 8, cls: type[PrefixRouter] = PrefixRouter
) -> tuple[PrefixRouter, list[_Replica], _Queues]:
    router = cls.__new__(cls)  # Serve's constructor needs a running deployment
    router.initialize_state(imbalance=imbalance)
    replicas = [_Replica(_Id("a")), _Replica(_Id("b"))]
    router._replicas = {r.replica_id: r for r in replicas}  # type: ignore[misc]
    queues = _Queues()
    router._replica_queue_len_cache = queues  # type: ignore[assignment]
    return router, replicas, queues


def _route(router: PrefixRouter, replicas: list[_Replica], text: str) -> str:
    pending = _Pending({"prefix": prefix_hashes(text)})
    ranks = asyncio.run(router.choose_replicas(replicas, pending))  # type: ignore[arg-type]
    chosen = ranks[0][0]
    router.on_request_routed(pending, chosen.replica_id, None)  # type: ignore[arg-type]
    return chosen.replica_id.unique_id


def test_a_known_prefix_goes_back_to_its_replica_and_new_ones_spread() -> None:
    router, replicas, _ = _router()
    texts = [chr(ord("a") + k) * (2 * BLOCK_CHARS) for k in range(4)]
    first = [_route(router, replicas, t + "question 0") for t in texts]
    assert sorted(first) == ["a", "a", "b", "b"]  # four new prefixes: two on each
    for i in range(1, 5):
        assert [_route(router, replicas, t + f"question {i}") for t in texts] == first
    assert router.decisions == {"prefix": 16, "new": 4}


def test_a_prefixs_replica_too_far_behind_loses_the_request_to_the_least_loaded() -> None:
    router, replicas, queues = _router(imbalance=4)
    text = "z" * (2 * BLOCK_CHARS)
    home = _route(router, replicas, text)
    other = "b" if home == "a" else "a"
    queues.lengths = {_Id(home): 4, _Id(other): 0}
    assert _route(router, replicas, text) == other and router.decisions["overflow"] == 1
    queues.lengths = {_Id(home): 3, _Id(other): 0}  # within the imbalance: its replica's cache wins
    assert _route(router, replicas, text) == home  # the overflow did not move the prefix


def test_a_request_with_no_prefix_goes_to_the_least_loaded() -> None:
    router, replicas, queues = _router()
    queues.lengths = {_Id("a"): 5, _Id("b"): 1}
    assert _route(router, replicas, "short") == "b"
    assert router.decisions == {"load": 1}


def test_the_routers_decisions_are_counted_for_the_ingresss_metrics(
    cls: type[PrefixRouter] = PrefixRouter,
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from unillm.server.ray._metrics import decisions

    def counts() -> dict[str, float]:
        family, seen = text_string_to_metric_families(decisions())
        assert family.name == "unillm:ray_router_decisions" and family.type == "counter"
        assert seen.name == "unillm:ray_router_replicas" and seen.type == "gauge"
        return {s.labels["decision"]: s.value for s in family.samples if s.name.endswith("_total")}

    before = counts()
    router, replicas, _ = _router(cls=cls)
    text = "d" * (2 * BLOCK_CHARS)
    for i in range(3):
        _route(router, replicas, text + str(i))
    _route(router, replicas, "short")
    after = counts()
    assert {k: after[k] - before[k] for k in after} == {"prefix": 2, "overflow": 0, "new": 1, "load": 1}
    # the direct shape's replicas pass the routers' counts and the replicas they see (the fewest)
    (_, seen) = text_string_to_metric_families(decisions(after, 3))  # type: ignore[arg-type]
    assert seen.samples[0].value == 3


def test_a_replica_whose_kv_cache_is_full_loses_its_prefixs_request_by_the_ingresss_reports(
    cls: type[PrefixRouter] = PrefixRouter,
) -> None:
    from unillm.server.ray._metrics import REPORTS

    router, replicas, _ = _router(cls=cls)
    text = "k" * (2 * BLOCK_CHARS)
    home = _route(router, replicas, text)
    other = "b" if home == "a" else "a"
    REPORTS[home] = {"kv_usage": 0.97}  # as the ingress's pull leaves it
    try:
        assert _route(router, replicas, text) == other
        REPORTS[home] = {"kv_usage": 0.5}
        assert _route(router, replicas, text) == home
    finally:
        REPORTS.clear()
    assert router.decisions == {"new": 1, "overflow": 1, "prefix": 1}


_SHIPPED = """
import sys
from ray import cloudpickle
from unillm.server.ray._router import PrefixRouter
from tests import test_ray_parts as t

cls = cloudpickle.loads(bytes.fromhex(sys.stdin.read()))
assert cls is not PrefixRouter  # a copy, with copies of its module's globals
t.test_the_routers_decisions_are_counted_for_the_ingresss_metrics(cls)
t.test_a_replica_whose_kv_cache_is_full_loses_its_prefixs_request_by_the_ingresss_reports(cls)
print("shared")
"""


def test_the_router_as_serve_ships_it_shares_reports_and_decisions_with_the_ingress() -> None:
    # Serve pickles a deployment's router class by value and loads it in the replica's process:
    # there its module's globals are copies, so what it shares with the ingress (the replicas'
    # reports, the decision counts) must still be the ingress's
    import subprocess
    import sys

    from ray.serve.config import RequestRouterConfig

    shipped = RequestRouterConfig(request_router_class=PrefixRouter).get_serialized_request_router_cls()  # type: ignore[arg-type]
    assert shipped
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", _SHIPPED], input=shipped.hex(), capture_output=True,
                          text=True, cwd=root, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "shared", done.stderr[-3000:]


def test_a_replica_gone_takes_its_prefixes_with_it() -> None:
    router, replicas, _ = _router()
    text = "q" * (2 * BLOCK_CHARS)
    home = _route(router, replicas, text)
    survivor = next(r for r in replicas if r.replica_id.unique_id != home)
    router._replicas = {survivor.replica_id: survivor}  # type: ignore[misc]
    for h in [h for h, r in router._owner.items() if r not in router._replicas]:  # as update_replicas
        del router._owner[h]
    assert _route(router, [survivor], text) == survivor.replica_id.unique_id


# ---- the replica's ASGI bridge ----


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    body = (await receive())["body"]
    await send(
        {"type": "http.response.start", "status": 201, "headers": [(b"x-echo", scope["path"].encode())]}
    )
    for piece in (body[:2], body[2:]):
        await send({"type": "http.response.body", "body": piece, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def test_the_bridge_gives_the_status_and_headers_then_the_body() -> None:
    async def run() -> list[Any]:
        return [x async for x in asgi_stream(_app, "POST", "/v1/x", b"", [], b"hello")]

    # the two pieces were both queued by the time the first went: they go as one
    assert asyncio.run(run()) == [(201, [(b"x-echo", b"/v1/x")]), b"hello"]


def _handshaking(took: asyncio.Event, wait_after: int) -> Any:
    """An app that writes a, b, c, d, waiting after each of the first ``wait_after`` pieces until
    the bridge's reader took it (``took``)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i, piece in enumerate((b"a", b"b", b"c", b"d")):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            if i < wait_after:
                await took.wait()
                took.clear()
            else:
                await asyncio.sleep(0)  # the reader runs between pieces
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def _read(app: Any, took: asyncio.Event, interval_s: float) -> list[Any]:
    async def run() -> list[Any]:
        out = []
        async for item in asgi_stream(app, "GET", "/", b"", [], b"", interval_s=interval_s):
            out.append(item)
            if isinstance(item, bytes):
                took.set()
        return out

    return asyncio.run(run())


def test_with_no_interval_each_piece_goes_as_written() -> None:
    took = asyncio.Event()
    assert _read(_handshaking(took, 4), took, 0.0) == [(200, []), b"a", b"b", b"c", b"d"]


def test_pieces_written_within_the_interval_go_as_one_and_the_apps_end_cuts_the_wait_short() -> None:
    # the first piece goes at once; the rest come long before an hour has passed since, and wait
    # for it no longer than the app's end
    took = asyncio.Event()
    assert _read(_handshaking(took, 1), took, 3600.0) == [(200, []), b"a", b"bcd"]


def test_closing_the_bridge_early_is_a_client_gone() -> None:
    seen: list[str] = []

    async def streaming(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        seen.append((await receive())["type"])  # what a server's stream listens for

    async def run() -> None:
        stream = asgi_stream(streaming, "GET", "/", b"", [], b"")
        assert await anext(stream) == (200, [])
        assert await anext(stream) == b"first"
        await stream.aclose()

    asyncio.run(run())
    assert seen == ["http.disconnect"]


def test_an_app_that_fails_before_answering_raises_from_the_bridge() -> None:
    async def broken(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise RuntimeError("boom")

    async def run() -> list[Any]:
        return [x async for x in asgi_stream(broken, "GET", "/", b"", [], b"")]

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(run())


# ---- metrics ----


def test_each_replicas_series_gets_its_replica_label_under_one_family() -> None:
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    texts = {}
    for name, n in (("r1", 3), ("r2", 5)):  # what each replica's server exposes
        registry = CollectorRegistry()
        Counter("unillm:requests", "HTTP requests.", ["route"], registry=registry).labels("chat").inc(n)
        texts[name] = generate_latest(registry).decode()
    out = relabeled(texts)
    assert out.count("# TYPE unillm:requests_total counter") == 1
    assert 'unillm:requests_total{replica="r1",route="chat"} 3.0' in out
    assert 'unillm:requests_total{replica="r2",route="chat"} 5.0' in out
