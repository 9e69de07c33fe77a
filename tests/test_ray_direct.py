"""unillm's server on Ray Serve in its high-throughput mode: HAProxy in front
(``RAY_SERVE_ENABLE_HA_PROXY=1``), which asks unillm's router for a replica with the request's body
and sends the request straight to it (unillm/server/ray/_direct.py). A one-node cluster on loopback
with the mode set before it starts, and ``unillm serve --ray`` in a subprocess, with an API key, as
a user runs it; the tests talk to it over HTTP with the official clients.

Serve reads the mode from its environment when ``ray.serve`` is imported: this module never imports
it in the test process (tests/test_ray_serve.py may have, without the mode); the CLI's process and
the cluster's have it from the start.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests._server_util import free_port, parse_metrics, wait_until
from tests.conftest import HAS_LLAMA_CPP
from tests.test_ray_serve import ALIAS, RAY_ENV, SYSTEMS, _ask, _messages, _under_load, clear_prompts

pytest.importorskip("ray", reason="Ray Serve is not installed: pip install 'unillm[ray]'")
pytestmark = pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed")

KEY = "direct-key"


@dataclass
class Direct:
    port: int
    said: list[str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        got = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert got.status_code == 200, got.text
        return parse_metrics(got.text)


def _haproxies() -> list[Any]:
    import psutil

    return [p for p in psutil.Process().children(recursive=True) if "haproxy" in p.name()]


@pytest.fixture(scope="module")
def direct(tiny_gguf: Path) -> Iterator[Direct]:
    from ray.cluster_utils import Cluster as RayCluster

    mode = {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",  # as docs/scaling-out.md has it
        # HAProxy wants ~2.5 open files per connection it may hold (4096 by default): within
        # a hard limit of 4096 (mlx-lm's import set that in-process before unillm guarded it)
        "RAY_SERVE_HAPROXY_MAXCONN": "1024",
        # HAProxy's own stats and metrics listen on fixed ports by default
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
    }
    env = {**RAY_ENV, **mode}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the cluster's processes start with it
    Path("/tmp/ray").mkdir(exist_ok=True)
    c = RayCluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    proc: subprocess.Popen[str] | None = None
    haproxies: list[Any] = []
    try:
        port = free_port()
        cmd = [sys.executable, "-m", "unillm", "serve", str(tiny_gguf), "--alias", ALIAS, "--backend",
               "llama.cpp", "--context", "1024", "--option", "parallel=4", "--option", "n_threads=1",
               "--ray", c.address, "--replicas", "2", "--port", str(port)]  # fmt: skip
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", "UNILLM_API_KEY": KEY}
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env=child_env,
                                start_new_session=True)  # fmt: skip
        said: list[str] = []
        threading.Thread(target=lambda: said.extend(proc.stderr or ()), daemon=True).start()
        wait_until(lambda: any("listening on" in line for line in said) or proc.poll() is not None, 240,
                   "unillm serve --ray to listen")  # fmt: skip
        assert proc.poll() is None, "".join(said)
        haproxies = _haproxies()
        served = Direct(port, said)
        # the router just started learns the replicas from Serve a moment after the application
        # runs: until it sees both, every new prefix would go to the one it knows
        wait_until(lambda: served.metrics().get(("unillm:ray_router_replicas", frozenset())) == 2, 60,
                   "the router to see both replicas")  # fmt: skip

        # and HAProxy learns of the router a moment after the replicas (Serve sends it the router's
        # address in a later update): until then it balances requests itself
        def routed() -> bool:
            _ask(served.client(), _messages(0), max_tokens=1)  # no prefix: routed by load
            return _decisions(served).get("load", 0.0) > 0

        wait_until(routed, 60, "HAProxy to ask the router", every_s=0.2)
        yield served
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        haproxies += _haproxies()
        try:
            c.shutdown()
        finally:
            for p in haproxies:  # HAProxy outlives a killed Ray
                with contextlib.suppress(Exception):
                    p.kill()
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _decisions(direct: Direct) -> dict[str, float]:
    return {dict(labels)["decision"]: v for (name, labels), v in direct.metrics().items()
            if name == "unillm:ray_router_decisions_total"}  # fmt: skip


def test_the_cli_says_it_listens_through_haproxy(direct: Direct) -> None:
    assert any("HAProxy" in line for line in direct.said if "listening on" in line), direct.said


def test_each_prefix_goes_straight_to_one_replica_and_answers_as_the_engine_does(
    direct: Direct, llama: Any
) -> None:
    oai = direct.client()
    before = _decisions(direct)
    work = [(k, i) for i in range(6) for k in range(4)]  # 4 system prompts x 6, interleaved
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda ki: _ask(oai, _messages(ki[1], SYSTEMS[ki[0]])), work))
    by_prefix: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for (k, i), (completion, headers) in zip(work, answers, strict=True):
        by_prefix[k][headers["x-unillm-replica"]] += 1
        want = llama.chat(_messages(i, SYSTEMS[k]), temperature=0, max_tokens=8).text
        assert completion.choices[0].message.content == want, (k, i)
    # HAProxy serves a request now and then on another replica than the router named (1 run in 5
    # here, one request of a prefix; the router's counts below say it chose by prefix; which of
    # HAProxy's paths does it is not found yet): each prefix's requests but one go to one replica
    homes = {k: c.most_common(1)[0] for k, c in by_prefix.items()}
    assert all(n >= 6 - 1 for _, n in homes.values()), by_prefix
    assert len({home for home, _ in homes.values()}) == 2, by_prefix  # the prefixes spread over both
    routed = {k: v - before.get(k, 0.0) for k, v in _decisions(direct).items()}
    assert routed["load"] == routed["overflow"] == 0 and routed["new"] <= 4, routed
    assert routed["prefix"] + routed["new"] >= len(work), routed


def test_the_key_guards_requests_and_metrics_which_name_each_replica(direct: Direct) -> None:
    with pytest.raises(openai.AuthenticationError):
        direct.client(key="wrong").chat.completions.create(model=ALIAS, messages=_messages(0), max_tokens=2)
    assert httpx.get(direct.url + "/metrics", timeout=10).status_code == 401
    answered = {h["x-unillm-replica"] for _, h in (_ask(direct.client(), _messages(i)) for i in range(4))}
    # the server's own route label (the application's route prefix taken off, as unillm serve's)
    served = {dict(labels)["replica"] for (name, labels), v in direct.metrics().items()
              if name == "unillm:requests_total" and dict(labels)["route"] == "/v1/chat/completions"
              and dict(labels)["status"] == "200" and v > 0}  # fmt: skip
    assert answered <= served and len(served) == 2, (answered, served)


def test_careless_bodies_get_the_servers_own_errors_through_the_router(direct: Direct) -> None:
    """What the router cannot read (not JSON, no prompt, larger than the server takes) is routed by
    load, and the replica's server answers as unillm serve does."""
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    url = direct.url + "/v1/chat/completions"
    broken = httpx.post(url, content=b"{not json", headers=headers, timeout=30)
    assert broken.status_code == 400 and "error" in broken.json()
    odd = httpx.post(url, json={"model": ALIAS, "messages": "not a list"}, headers=headers, timeout=30)
    assert odd.status_code in (400, 422) and "error" in odd.json()
    big = httpx.post(url, content=b"x" * (5 << 20), headers=headers, timeout=60)
    assert big.status_code == 413
    with pytest.raises(openai.NotFoundError):
        direct.client().chat.completions.create(model="nope", messages=_messages(0), max_tokens=2)


def test_the_anthropic_route_streams_straight_from_the_replica(direct: Direct, llama: Any) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=direct.url, api_key=KEY, max_retries=0)
    events = client.messages.create(model=ALIAS, max_tokens=8, messages=_messages(3), stream=True,  # type: ignore[arg-type]
                                    extra_body={"temperature": 0.0})  # fmt: skip
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")  # type: ignore[union-attr]
    assert text == llama.chat(_messages(3), temperature=0, max_tokens=8).text


def test_a_client_that_hangs_up_ends_its_generation_on_the_replica(direct: Direct) -> None:
    """HAProxy passes the client gone to the replica's server, which ends the request as aborted."""

    def aborted() -> float:
        return sum(v for (name, labels), v in direct.metrics().items()
                   if name == "unillm:request_success_total"
                   and dict(labels).get("finished_reason") == "abort")  # fmt: skip

    before = aborted()
    body = {"model": ALIAS, "messages": _messages(7), "max_tokens": 900, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    url = direct.url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    wait_until(lambda: aborted() > before, 30, "the replica to end the abandoned stream as aborted")


def _model_replicas() -> dict[int, str]:
    """pid -> process title of application "unillm"'s model replicas alive now (Ray titles them)."""
    import psutil

    found = {}
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            title = " ".join(p.cmdline())
            if title.startswith("ray::ServeReplica:unillm:UnillmModel"):
                found[p.pid] = title
    return found


def test_a_replica_killed_mid_load_loses_no_whole_answer_and_is_replaced(direct: Direct, llama: Any) -> None:
    """Last (it breaks a replica). HAProxy answers a request whose replica died before answering
    with 502, which the official client sends again (its default); a stream cut on the way is a
    broken connection; Serve starts a replacement."""
    before = _model_replicas()
    assert len(before) == 2, before
    victim = min(before)

    def replaced() -> bool:
        now = _model_replicas()
        return len(now) == 2 and victim not in now

    whole, streamed = _under_load(direct.client().with_options(max_retries=3),
                                  lambda: os.kill(victim, signal.SIGKILL), replaced,
                                  clear_prompts(llama))  # fmt: skip
    for r in whole:
        assert r[0] == "ok", r
        assert r[2] == llama.chat(_messages(r[1]), temperature=0, max_tokens=24).text
    for r in streamed:
        if r[0] == "ok":
            assert r[2] == llama.chat(_messages(r[1]), temperature=0, max_tokens=24).text
        else:  # cut mid-stream: the connection broke (httpx's error, or the client's wrapping it)
            assert isinstance(r[2], (httpx.HTTPError, openai.APIConnectionError, openai.APIStatusError)), r
    assert sum(r[0] != "ok" for r in streamed) <= 3, streamed  # at most those in flight on it
    # the replacement answers, straight from HAProxy
    assert _ask(direct.client(), _messages(99))[0].choices[0].message.content
