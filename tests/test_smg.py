"""SMG (the ``smg`` router, successor of sglang-router) in front of two ``unillm serve`` workers.

SMG routes to any OpenAI-compatible server; its ``cache_aware`` policy keeps a prefix tree of the
request texts it has sent to each worker: a request whose text mostly matches what one worker was
sent goes there, any other to the least loaded worker. The router lives in an environment of its
own (``scripts/smg.sh``, built once by ``.ci/run`` before the tests), as docs/scaling-out.md shows.

Which worker served a request is read from the workers themselves, never guessed: requests go one
at a time, and each worker's ``unillm:requests_total`` counter for the chat route says which of
them answered it. The router's own metrics are read only for what happens inside it: that it has
dispatched a request to a frozen worker, and that it tried a dead one. Answers are greedy and must
equal what the workers answer directly. Two fleets (two workers and a router each, about 2 s to
start): one the prefix test shares, one the kill test breaks. No sleeps: every wait polls with a
deadline, and every process is ended in a ``finally``, each in a process group of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ._server_util import (
    Server,
    free_port,
    metric,
    metrics,
    parse_metrics,
    start_server,
    stop_group,
    wait_until,
)
from .conftest import HAS_LLAMA_CPP

ROOT = Path(__file__).resolve().parent.parent
ALIAS = "tiny"
TOPICS = ("astronomy", "cooking", "sailing", "chess")
QUESTIONS = 6  # per system prompt
MAX_TOKENS = 8
CHAT = "/v1/chat/completions"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.llamacpp,
    pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed"),
]


def system_prompt(topic: str) -> str:
    """A long system prompt (about 600 tokens) of its own per topic: the router's prefix tree
    matches on text, and the question after it is a few per cent of the request."""
    return f"You are an expert in {topic}; answer every question about {topic} briefly. " * 12


def messages(topic: str, question: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": system_prompt(topic)},
        {"role": "user", "content": f"Question {question} about {topic}?"},
    ]


@pytest.fixture(scope="module")
def smg_exe() -> str:
    """The ``smg`` executable of the router's environment (built on first use, reused after)."""
    proc = subprocess.run(
        [str(ROOT / "scripts" / "smg.sh")], capture_output=True, text=True, timeout=1800, check=False
    )
    assert proc.returncode == 0, f"scripts/smg.sh failed:\n{proc.stderr[-4000:]}"
    return proc.stdout.strip().splitlines()[-1]


class Router:
    """One ``smg launch`` process in its own process group, its output in a log file."""

    def __init__(self, exe: str, workers: list[Server], log: Path) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.log_path = log
        argv = [
            exe, "launch", "--host", "127.0.0.1", "--port", str(self.port),
            "--worker-urls", *(w.url for w in workers),
            "--policy", "cache_aware",
            # the warm-up slice sends misses, and one hit in 8, to a worker whose cache is thin,
            # on purpose: off, so that a prefix stays with the worker that holds it
            "--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0",
            "--disable-tokenizer-autoload",  # pure load balancing: no tokenizer to fetch
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
            "--shutdown-grace-period-secs", "1",
        ]  # fmt: skip
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def metrics(self) -> dict[Any, float]:
        r = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10)
        r.raise_for_status()
        return parse_metrics(r.text)

    def wait_ready(self, workers: list[Server], timeout_s: float = 60.0) -> None:
        """Until the router listens and counts every worker healthy (its own gauge)."""

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"smg exited ({self.proc.returncode}):\n{self.log}")
            try:
                samples = self.metrics()
                httpx.get(self.url + "/health", timeout=5).raise_for_status()
            except httpx.HTTPError:
                return False
            return all(metric(samples, "smg_worker_health", worker=w.url) == 1 for w in workers)

        wait_until(ready, timeout_s, "smg to list both workers healthy")

    def stop(self) -> None:
        stop_group(self.proc)


@dataclass
class Fleet:
    workers: list[Server]
    router: Router
    clients: dict[str, openai.OpenAI] = field(default_factory=dict)

    def chat(self, base: str, topic: str, question: int) -> dict[str, Any]:
        """One greedy chat completion by the official client against ``base`` (a root URL)."""
        if base not in self.clients:
            self.clients[base] = openai.OpenAI(
                base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60
            )
        r = self.clients[base].chat.completions.create(
            model=ALIAS,
            messages=messages(topic, question),
            max_tokens=MAX_TOKENS,
            temperature=0,  # type: ignore[arg-type]
        )
        return r.model_dump()

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


def answered(worker: Server) -> float:
    """Chat completions the worker has answered with a 200, by its own counter."""
    return metric(metrics(worker.url), "unillm:requests_total", route=CHAT, status="200")


def served_by(fleet: Fleet, topic: str, question: int) -> tuple[int, dict[str, Any]]:
    """Ask the router; the index of the one worker whose counter moved, and the answer."""
    before = [answered(w) for w in fleet.workers]
    out = fleet.chat(fleet.router.url, topic, question)
    moved = [answered(w) - b for w, b in zip(fleet.workers, before, strict=True)]
    assert sorted(moved) == [0, 1], f"{topic} #{question}: the workers' counters moved by {moved}"
    return moved.index(1), out


@contextlib.contextmanager
def fleet_of_two(smg: str, model: Path, log: Path) -> Iterator[Fleet]:
    """Two llama.cpp workers and smg in front; every process is ended on the way out."""
    workers: list[Server] = []
    router: Router | None = None
    try:
        for _ in range(2):
            workers.append(start_server([str(model), "--backend", "llama.cpp", "--alias", ALIAS]))
        router = Router(smg, workers, log)
        router.wait_ready(workers)
        fleet = Fleet(workers, router)
        try:
            yield fleet
        finally:
            fleet.close()
    finally:
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, signal.SIGCONT)  # a test that froze one must not leave it so
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()


@pytest.fixture(scope="module")
def fleet(smg_exe: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fleet_of_two(smg_exe, tiny_gguf, tmp_path_factory.mktemp("smg") / "smg.log") as f:
        yield f


def test_each_prefix_stays_on_one_worker_and_both_are_used(fleet: Fleet) -> None:
    """4 system prompts x 6 questions through the router: every answer is the workers' own, every
    prompt's requests land on one worker, and the two workers share the prompts."""
    owner: dict[str, int] = {}
    answers: dict[tuple[str, int], dict[str, Any]] = {}
    first, *others = TOPICS
    # the first prompt's first request goes to either worker; that worker then holds it
    owner[first], answers[first, 0] = served_by(fleet, first, 0)
    held = fleet.workers[owner[first]]
    other = 1 - owner[first]
    # A prompt the router has not seen goes to the least loaded worker. Keep the first worker busy
    # with one more request of its own prompt (frozen with SIGSTOP, so that request is in flight
    # for as long as this takes), and the other prompts' first requests must go to the other one.
    os.killpg(held.proc.pid, signal.SIGSTOP)
    blocked: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: blocked.update(fleet.chat(fleet.router.url, first, 1)), name="held", daemon=True
    )
    try:
        thread.start()
        wait_until(
            lambda: metric(fleet.router.metrics(), "smg_worker_requests_active", worker=held.url) == 1,
            60, f"smg to dispatch {first} #1 to {held.url}",
        )  # fmt: skip
        for topic in others:
            before = answered(fleet.workers[other])
            answers[topic, 0] = fleet.chat(fleet.router.url, topic, 0)
            assert answered(fleet.workers[other]) == before + 1, f"{topic} #0 did not go to the idle worker"
            owner[topic] = other
    finally:
        os.killpg(held.proc.pid, signal.SIGCONT)
    thread.join(60)
    assert not thread.is_alive() and blocked, f"{first} #1 never came back from {held.url}"
    answers[first, 1] = blocked
    # the rest, one prompt after another: each request to its prompt's worker
    for topic in TOPICS:
        for q in range(2 if topic == first else 1, QUESTIONS):
            where, answers[topic, q] = served_by(fleet, topic, q)
            assert where == owner[topic], (
                f"{topic} #{q} went to worker {where}, its prompt is on {owner[topic]}"
            )
            if q >= 3:  # the worker kept the prompt: the prefix cache says so in the usage
                usage = answers[topic, q]["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                assert cached >= usage["prompt_tokens"] // 2, f"{topic} #{q}: {usage}"
    assert set(owner.values()) == {0, 1}
    assert answered(fleet.workers[0]) + answered(fleet.workers[1]) == len(TOPICS) * QUESTIONS
    # and every answer is what each worker answers directly, greedy
    for (topic, q), routed in answers.items():
        for w in fleet.workers:
            direct = fleet.chat(w.url, topic, q)
            assert routed["choices"][0]["message"] == direct["choices"][0]["message"], (topic, q, w.url)
            assert routed["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"] == MAX_TOKENS


def test_a_killed_worker_leaves_the_router_answering_from_the_other(
    smg_exe: str, tiny_gguf: Path, tmp_path: Path
) -> None:
    """A fleet of its own (this test breaks it): the worker that served the last request is killed
    between requests; every prompt is then answered, correctly, by the survivor."""
    with fleet_of_two(smg_exe, tiny_gguf, tmp_path / "smg.log") as fleet:
        last = 0
        for topic in TOPICS:
            last, _ = served_by(fleet, topic, 0)
        victim, survivor = fleet.workers[last], fleet.workers[1 - last]
        os.killpg(victim.proc.pid, signal.SIGKILL)  # no goodbye: no drain, no closed sockets
        victim.proc.wait(15)
        for topic in TOPICS:
            expected = fleet.chat(survivor.url, topic, 1)["choices"][0]["message"]
            before = answered(survivor)

            def answer_from_router(topic: str = topic) -> dict[str, Any] | None:
                try:
                    return fleet.chat(fleet.router.url, topic, 1)
                except openai.APIError:  # refused or cut while the router finds out: ask again
                    return None

            got = wait_until(answer_from_router, 60, f"the router to answer {topic} #1 after the kill")
            assert got["choices"][0]["message"] == expected, (topic, got, expected)
            assert answered(survivor) >= before + 1
        # the router did try the dead worker (the last prompt was its) and went on to the survivor
        failures = metric(
            fleet.router.metrics(), "smg_worker_cb_outcomes_total", worker=victim.url, outcome="failure"
        )
        assert failures >= 1, fleet.router.log
