"""unillm's server on Ray Serve (unillm.server.ray), on a real two-node Ray cluster on loopback:
replicas spread over the nodes, answers equal to the in-process engine's, prefix-aware routing, the
replicas' metrics at the ingress, autoscaling, a replica killed and a node leaving mid-load, and
``unillm serve --ray``.

One cluster for the module (up in ~6-10 s here) and two applications on it: "unillm", run by
``unillm serve --ray`` in a subprocess as a user would (two replicas of one CPU each, so one per
one-CPU node), and "auto" (autoscaled, replicas of no CPU). The tests that break things (a replica
killed, a node gone, the CLI stopped) run last, in file order.
"""

from __future__ import annotations

import collections
import functools
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests._server_util import free_port, parse_metrics, wait_until
from tests.conftest import HAS_LLAMA_CPP

ray = pytest.importorskip("ray", reason="Ray Serve is not installed: pip install 'unillm[ray]'")
serve = pytest.importorskip("ray.serve")
pytestmark = pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed")

# Ray's traps on a test machine (MACHINE-NOTES): both nodes on 127.0.0.1, no auth token written to
# the home directory, no 30 s drain when the head node in this process sees SIGTERM, no usage stats.
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    # load reported every half second (autoscaling_config's metrics_interval_s is deprecated for these)
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
}
ALIAS = "tiny"
ENGINE = {"model": None, "alias": ALIAS, "backend": "llama.cpp", "context_length": 1024,
          "options": {"parallel": 4, "n_threads": 1}}  # fmt: skip
SYSTEMS = [f"You are assistant number {k}. " + f"Rule {k}: answer briefly and kindly. " * 9 for k in range(4)]


@dataclass
class Cluster:
    cluster: Any
    worker: Any
    port: int
    cli: subprocess.Popen[str] | None = None
    said: list[str] | None = None

    def client(self, prefix: str = "", key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}{prefix}/v1", api_key=key, max_retries=0, timeout=60)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    from ray.cluster_utils import Cluster as RayCluster

    saved = {k: os.environ.get(k) for k in RAY_ENV}
    os.environ.update(RAY_ENV)
    Path("/tmp/ray").mkdir(exist_ok=True)  # the test-cluster helper writes there, whatever it is told
    c = RayCluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        worker = c.add_node(num_cpus=1)
        ray.init(address=c.address, logging_level="WARNING", log_to_driver=False)
        yield Cluster(c, worker, free_port())
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            c.shutdown()
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def app(cluster: Cluster, tiny_gguf: Path) -> Iterator[Cluster]:
    """``unillm serve --ray`` on the cluster, as a user runs it: two replicas of one CPU each on
    two one-CPU nodes, the prefix router, no API key. Stopped by the last test (or here)."""
    env = {**os.environ, **RAY_ENV, "PYTHONUNBUFFERED": "1"}
    env.pop("UNILLM_API_KEY", None)
    cmd = [sys.executable, "-m", "unillm", "serve", str(tiny_gguf), "--alias", ALIAS, "--backend",
           "llama.cpp", "--context", "1024", "--option", "parallel=4", "--option", "n_threads=1",
           "--ray", cluster.cluster.address, "--replicas", "2", "--port", str(cluster.port)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)  # fmt: skip
    said: list[str] = []
    threading.Thread(target=lambda: said.extend(proc.stderr or ()), daemon=True).start()
    cluster.cli, cluster.said = proc, said
    try:
        wait_until(lambda: any("listening on" in line for line in said) or proc.poll() is not None, 240,
                   "unillm serve --ray to listen")  # fmt: skip
        assert proc.poll() is None, "".join(said)
        yield cluster
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _deploy(name: str, args: dict[str, Any], timeout_s: float = 120.0) -> None:
    from unillm.server.ray import build_app
    from unillm.server.ray._run import wait_running

    serve._run(build_app(args), name=name, route_prefix=f"/{name}", _blocking=False)
    wait_running(name, timeout_s)


def _running(name: str) -> int:
    app = serve.status().applications.get(name)
    if app is None:
        return 0
    dep = app.deployments["UnillmModel"]
    return int(dep.replica_states.get("RUNNING", 0))


def _messages(i: int, system: str | None = None) -> list[dict[str, str]]:
    user = {"role": "user", "content": f"Question {i}: name a color and a number."}
    return [{"role": "system", "content": system}, user] if system else [user]


def _ask(
    oai: openai.OpenAI, messages: list[dict[str, str]], max_tokens: int = 8
) -> tuple[Any, dict[str, str]]:
    raw = oai.chat.completions.with_raw_response.create(
        model=ALIAS,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,  # type: ignore[arg-type]
    )
    return raw.parse(), dict(raw.headers)


def test_two_replicas_one_per_node_answer_40_requests_as_the_engine_does(app: Cluster, llama: Any) -> None:
    oai = app.client()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: _ask(oai, _messages(i)), range(40)))
    for i, (completion, _) in enumerate(answers):
        want = llama.chat(_messages(i), temperature=0, max_tokens=8).text
        assert want and completion.choices[0].message.content == want, i
    replicas = collections.Counter(h["x-unillm-replica"] for _, h in answers)
    nodes = {h["x-unillm-node"] for _, h in answers}
    assert len(replicas) == 2 and len(nodes) == 2, (replicas, nodes)


def _decisions(app: Cluster) -> dict[str, float]:
    samples = parse_metrics(httpx.get(app.url + "/metrics", timeout=10).text)
    return {dict(labels)["decision"]: v for (name, labels), v in samples.items()
            if name == "unillm:ray_router_decisions_total"}  # fmt: skip


def test_a_prefix_is_served_by_one_replica_and_hits_its_cache(app: Cluster) -> None:
    oai = app.client()
    before = _decisions(app)
    work = [(k, i) for i in range(10) for k in range(4)]  # 4 system prompts x 10, interleaved
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda ki: _ask(oai, _messages(ki[1], SYSTEMS[ki[0]])), work))
    by_prefix: dict[int, set[str]] = collections.defaultdict(set)
    cached: dict[int, list[int]] = collections.defaultdict(list)
    for (k, _), (completion, headers) in zip(work, answers, strict=True):
        by_prefix[k].add(headers["x-unillm-replica"])
        details = completion.usage.prompt_tokens_details
        cached[k].append(details.cached_tokens if details else 0)
    assert all(len(r) == 1 for r in by_prefix.values()), by_prefix
    assert len(set().union(*by_prefix.values())) == 2, by_prefix  # the prefixes spread over both
    system_tokens = len(SYSTEMS[0]) // 8  # far fewer tokens than characters: a floor, not a count
    # each prefix's first two requests may run side by side before either is cached; every later
    # one finds its system prompt in its replica's cache
    for k, hits in cached.items():
        assert all(n >= system_tokens for n in hits[2:]), (k, hits)
    # the router says so too: each request went by its prefix, four prefixes at most new to it
    seen = parse_metrics(httpx.get(app.url + "/metrics", timeout=10).text)
    assert seen[("unillm:ray_router_replicas", frozenset())] == 2  # the router sees both replicas
    routed = {k: v - before[k] for k, v in _decisions(app).items()}
    assert routed["load"] == routed["overflow"] == 0 and routed["new"] <= 4, routed
    assert routed["prefix"] + routed["new"] >= 40, routed

    # the engines' own prefix-cache counters, as the replicas report them through the ingress
    def hits_by_replica() -> dict[str, float]:
        samples = parse_metrics(httpx.get(app.url + "/metrics", timeout=10).text)
        found = {dict(labels).get("replica", ""): v for (name, labels), v in samples.items()
                 if name == "unillm:prefix_cache_hits_total"}  # fmt: skip
        return found if len(found) == 2 and all(found.values()) else {}

    assert len(wait_until(hits_by_replica, 30, "both replicas' prefix-cache hits at /metrics")) == 2


def test_the_ingress_metrics_name_each_replica(app: Cluster) -> None:
    answered = {h["x-unillm-replica"] for _, h in (_ask(app.client(), _messages(i)) for i in range(4))}

    def series() -> set[str]:
        samples = parse_metrics(httpx.get(app.url + "/metrics", timeout=10).text)
        return {dict(labels)["replica"] for (name, labels), v in samples.items()
                if name == "unillm:requests_total" and v > 0}  # fmt: skip

    assert wait_until(lambda: answered <= series() and series(), 30, "the replicas' series") >= answered

    # and through Ray's metrics export (each node's agent, what the cluster's Prometheus scrapes)
    ports = [app.cluster.head_node.metrics_export_port, app.worker.metrics_export_port]

    def exported() -> set[str]:
        found = set()
        for port in ports:
            samples = parse_metrics(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
            found |= {dict(labels).get("replica", "") for (name, labels), v in samples.items()
                      if name == "ray_unillm_generation_tokens_total" and v > 0}  # fmt: skip
        return found if answered <= found else set()

    wait_until(exported, 60, "the replicas' generation_tokens through Ray's metrics export", every_s=0.5)


def _aborted(url: str) -> float:
    samples = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
    counted = "unillm:request_success_total"
    return sum(v for (name, labels), v in samples.items()
               if name == counted and dict(labels).get("finished_reason") == "abort")  # fmt: skip


def test_a_client_that_stops_reading_a_stream_ends_its_generation_on_the_replica(app: Cluster) -> None:
    """Proxy, ingress, replica: the client gone reaches the engine, which ends the request as
    aborted long before its 900 tokens."""
    before = _aborted(app.url)
    body = {"model": ALIAS, "messages": _messages(7), "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", app.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one token in: hang up
    wait_until(lambda: _aborted(app.url) > before, 30, "the replica to end the abandoned stream as aborted")


def test_bad_requests_get_the_servers_own_errors(app: Cluster) -> None:
    oai = app.client()
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=_messages(0), max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="context"):
        oai.chat.completions.create(model=ALIAS, messages=_messages(0, "x " * 3000), max_tokens=4)
    r = httpx.post(app.url + "/v1/chat/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and "error" in r.json()
    big = httpx.post(app.url + "/v1/chat/completions", content=b"x" * (5 << 20), timeout=30)
    assert big.status_code == 413


def test_the_anthropic_route_streams_through_the_ingress(app: Cluster, llama: Any) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=app.url, api_key="unused", max_retries=0)
    # this client version takes no temperature argument: it goes in the body
    events = client.messages.create(model=ALIAS, max_tokens=8, messages=_messages(3), stream=True,  # type: ignore[arg-type]
                                    extra_body={"temperature": 0.0})  # fmt: skip
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")  # type: ignore[union-attr]
    assert text == llama.chat(_messages(3), temperature=0, max_tokens=8).text


@functools.cache  # per engine: the session's reference engine, asked once
def clear_prompts(llama: Any, n: int = 24, margin: float = 0.05) -> tuple[int, ...]:
    """The first ``n`` indices ``i`` whose ``_messages(i)`` has a greedy 24-token answer with no
    near-tie on the way (the top two tokens at least ``margin`` nats apart at every step), by the
    reference engine's logprobs. Under load a replica decodes several sequences at once, and the
    batch's other rows change the sums' order: a near-tie (CI saw 0.003 nats, on a prompt the
    load reached only once it ran long enough) can then flip, as it can on plain ``unillm serve``."""
    found: list[int] = []
    i = 0
    while len(found) < n:
        i += 1
        c = llama.chat(_messages(i), temperature=0, max_tokens=24, logprobs=2)
        steps = c.top_logprobs or []
        if steps and all(len(s) < 2 or s[0][1] - s[1][1] >= margin for s in steps):
            found.append(i)
    return tuple(found)


def _load(
    oai: openai.OpenAI, stop: threading.Event, results: list[Any], stream: bool, prompts: tuple[int, ...]
) -> None:
    k = 0
    while not stop.is_set():
        i = prompts[k % len(prompts)]
        k += 1
        try:
            if stream:
                chunks = oai.chat.completions.create(
                    model=ALIAS, messages=_messages(i), max_tokens=24, temperature=0, stream=True
                )  # type: ignore[call-overload]
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                results.append(("ok", i, text))
            else:
                completion, headers = _ask(oai, _messages(i), max_tokens=24)
                results.append(("ok", i, completion.choices[0].message.content, headers["x-unillm-replica"]))
        except Exception as exc:  # every failure is recorded, and judged by the test
            results.append(("error", i, exc))


def _under_load(
    oai: openai.OpenAI, action: Callable[[], None], until: Callable[[], bool], prompts: tuple[int, ...]
) -> tuple[list[Any], list[Any]]:
    """Three threads asking for whole answers and three streaming, over ``prompts`` (indices of
    ``_messages``), while ``action`` runs and until ``until`` holds, then six answers more."""
    stop = threading.Event()
    whole: list[Any] = []
    streamed: list[Any] = []
    threads = [threading.Thread(target=_load, args=(oai, stop, whole, False, prompts)) for _ in range(3)]
    threads += [threading.Thread(target=_load, args=(oai, stop, streamed, True, prompts)) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(whole) >= 6 and len(streamed) >= 6, 60, "the load to start")
        action()
        wait_until(until, 120, "the cluster to settle")
        n = len(whole)
        wait_until(lambda: len(whole) >= n + 6, 60, "answers after it settled")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    return whole, streamed


def test_with_an_api_key_autoscales_from_one_replica_to_two_under_load_and_back(
    cluster: Cluster, tiny_gguf: Path
) -> None:
    key = "ray-test-key"  # as a Serve config's args give it (the docs' example sets it by env)
    _deploy("auto", {**ENGINE, "model": str(tiny_gguf), "num_replicas": "auto", "min_replicas": 1,
                     "max_replicas": 2, "target_ongoing_requests": 1, "replica_cpus": 0,
                     "upscale_delay_s": 0, "downscale_delay_s": 1, "api_key": key,
                     "autoscaling": {"look_back_period_s": 1}})  # fmt: skip
    try:
        assert _running("auto") == 1
        # the key is unillm serve's: refused without it (the metrics too), at the ingress or a replica
        body = {"model": ALIAS, "messages": _messages(0), "max_tokens": 4}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = httpx.post(
                f"{cluster.url}/auto/v1/chat/completions", json=body, headers=headers, timeout=60
            )
            assert refused.status_code == 401, refused.text
            assert refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{cluster.url}/auto/metrics", timeout=60).status_code == 401
        assert (
            httpx.get(f"{cluster.url}/auto/metrics", headers={"x-api-key": key}, timeout=60).status_code
            == 200
        )
        with pytest.raises(openai.AuthenticationError):
            cluster.client("/auto").chat.completions.create(model=ALIAS, messages=_messages(0), max_tokens=4)  # type: ignore[arg-type]
        oai = cluster.client("/auto", key=key)
        whole, _ = _under_load(oai, lambda: None, lambda: _running("auto") == 2, tuple(range(1, 25)))
        assert all(r[0] == "ok" for r in whole), [r for r in whole if r[0] != "ok"][:3]
        wait_until(lambda: _running("auto") == 1, 120, "the idle deployment to scale back to one replica")
    finally:
        serve.delete("auto")


def _replica_actors() -> set[str]:
    """The names of application "unillm"'s model replicas alive now."""
    named = ray.util.list_named_actors(all_namespaces=True)
    return {a["name"] for a in named if a["name"].startswith("SERVE_REPLICA::unillm#UnillmModel#")}


def _judge(whole: list[Any], streamed: list[Any], llama: Any, proxy_gone: bool = False) -> None:
    for r in whole:  # a whole answer is retried on another replica: every one comes back right
        assert r[0] == "ok", r
        assert r[2] == llama.chat(_messages(r[1]), temperature=0, max_tokens=24).text
    for r in streamed:  # a stream cut after its first bytes ends in the protocol's error
        if r[0] == "ok":
            assert r[2] == llama.chat(_messages(r[1]), temperature=0, max_tokens=24).text
        elif proxy_gone and isinstance(r[2], openai.APIConnectionError):
            pass  # the stream went through the gone node's proxy: its connection is cut
        else:
            assert isinstance(r[2], openai.APIError) and "replica" in str(r[2]), r
    assert sum(r[0] != "ok" for r in streamed) <= 3, streamed  # at most those in flight on it


def test_a_replica_killed_mid_load_loses_no_whole_answer_and_is_replaced(app: Cluster, llama: Any) -> None:
    before = _replica_actors()
    assert len(before) == 2
    victim = sorted(before)[0]

    def kill() -> None:
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)

    def replaced() -> bool:
        now = _replica_actors()
        return _running("unillm") == 2 and victim not in now and len(now) == 2

    whole, streamed = _under_load(app.client(), kill, replaced, clear_prompts(llama))
    _judge(whole, streamed, llama)


def test_a_node_leaving_mid_load_loses_no_whole_answer(app: Cluster, llama: Any) -> None:
    def leave() -> None:
        app.cluster.remove_node(app.worker, allow_graceful=False)

    # Both nodes' Serve proxies listen on 127.0.0.1 here, so a connection the gone node's proxy held
    # breaks: the official client retries it (its default), as it would after a load balancer's
    # failover on a real cluster. The replica on the node that left cannot be placed again (no CPU
    # left for it): one runs on.
    oai = app.client().with_options(max_retries=5)
    whole, streamed = _under_load(oai, leave, lambda: _running("unillm") == 1, clear_prompts(llama))
    _judge(whole, streamed, llama, proxy_gone=True)


def test_unillm_serve_ray_says_where_it_listens_and_stops_on_sigint(app: Cluster) -> None:
    """Last (it takes the application down): the CLI printed the proxy's address, and on SIGINT
    it deletes the application and exits 0, leaving the cluster up."""
    assert app.cli is not None and app.said is not None
    assert f"listening on http://127.0.0.1:{app.port}/v1 through Ray Serve" in "".join(app.said)
    app.cli.send_signal(signal.SIGINT)
    assert app.cli.wait(120) == 0, "".join(app.said)
    assert "unillm" not in serve.status().applications
    assert ray.cluster_resources().get("CPU")  # the cluster is still there
