"""``unillm serve`` under abuse, over loopback: a client that stops reading its stream, headers sent
slowly or never, a body that stalls, too many headers, too many connections, a burst past the
queue, a 3 MB prompt, and a shutdown with requests streaming and queued. Each case asserts the
protocol's answer and that the other clients were served.

One server (llama.cpp batching, the tiny model) with short limits serves every case but the
shutdown, which stops a server of its own. Waits are bounded by deadlines; how fast a limit acts is
a timing claim, measured in benchmarks/, not asserted here.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import needs_llama_cpp

from ._soak_util import Served, metric, serve

httpx = pytest.importorskip("httpx")
pytest.importorskip("httptools")

pytestmark = needs_llama_cpp

LIMITS = [
    "--write-timeout", "2", "--header-timeout", "2", "--body-timeout", "2", "--idle-timeout", "2",
    "--max-connections", "24", "--max-running", "4", "--max-queue", "4", "--context", "4096",
]  # fmt: skip


@pytest.fixture(scope="module")
def served(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serve(tiny_gguf, *LIMITS, log=tmp_path_factory.mktemp("abuse") / "server.log") as s:
        yield s


def _raw(served: Served, rcvbuf: int | None = None) -> socket.socket:
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    sock.settimeout(60)  # a bound on every read below: a server that never answers fails the test
    return sock


def _post(path: str, body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data


def _read_all(sock: socket.socket) -> bytes:
    """What the server sent until it closed the connection (a reset counts as closing)."""
    parts = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(1 << 16):
            parts.append(chunk)
    return b"".join(parts)


def _status_and_body(raw: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _until(what: str, check: object, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)  # polling, bounded by the deadline


def _completion(served: Served, prompt: str, **extra: object) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, **extra}
    return httpx.post(served.v1 + "/completions", json=body, timeout=120)


PROMPTS = ["Hello there", "Once upon a time", "0 1 2 3", "The quick brown fox"]


def test_a_stalled_reader_is_cut_off_and_the_others_are_served_as_if_it_were_not_there(
    served: Served,
) -> None:
    alone = [_completion(served, p).json()["choices"][0]["text"] for p in PROMPTS]
    before = metric(served.metrics(), "unillm:stalled_clients_total")
    # a stream of about 10 MB (20 alternatives per token) to a client whose receive buffer is tiny
    # and which reads nothing: the loopback's buffers fill, and the server's writes stop
    stalled = _raw(served, rcvbuf=4096)
    stalled.sendall(_post("/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 4000,
        "ignore_eos": True, "temperature": 0, "stream": True, "logprobs": True, "top_logprobs": 20,
    }))  # fmt: skip
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            others = list(pool.map(lambda p: _completion(served, p), PROMPTS))
        assert [r.status_code for r in others] == [200] * 4, [r.text[:300] for r in others]
        assert [r.json()["choices"][0]["text"] for r in others] == alone
        _until("the stalled client is counted", lambda: metric(
            served.metrics(), "unillm:stalled_clients_total") > before)  # fmt: skip
        # its connection was aborted: what it reads now is what the buffers held, then the end,
        # and no [DONE]: the stream did not complete
        got = _read_all(stalled)
        assert got.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in got
    finally:
        stalled.close()
    # its sequence was freed: nothing runs, nothing waits, and the server answers
    samples = served.metrics()
    assert metric(samples, "unillm:num_requests_running") == 0
    assert metric(samples, "unillm:num_requests_waiting") == 0
    assert "the client took none of its answer" in served.log_tail()
    assert _completion(served, PROMPTS[0]).json()["choices"][0]["text"] == alone[0]


@pytest.mark.parametrize(
    "sent",
    [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"],
    ids=["silent-connection", "headers-never-finished"],
)
def test_a_connection_without_a_whole_request_head_is_answered_408_and_closed(
    served: Served, sent: bytes
) -> None:
    before = metric(served.metrics(), "unillm:closed_connections_total", why="header_timeout")
    with _raw(served) as sock:
        sock.sendall(sent)
        status, body = _status_and_body(_read_all(sock))
    assert status == 408 and body["error"]["code"] == "header_timeout", body  # type: ignore[index]
    after = metric(served.metrics(), "unillm:closed_connections_total", why="header_timeout")
    assert after == before + 1


def test_headers_sent_a_byte_at_a_time_are_cut_off_at_the_header_timeout(served: Served) -> None:
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 400
    with _raw(served) as sock:
        sent = 0
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for byte in head:  # one byte every 20 ms: the head takes longer than the 2 s allowed
                sock.send(bytes([byte]))
                sent += 1
                time.sleep(0.02)  # the slow client itself: the pace is what is tested
        got = _read_all(sock)
    assert sent < len(head) or got, "the server waited for the whole slow head"
    status, body = _status_and_body(got)
    assert status == 408 and body["error"]["code"] == "header_timeout", body  # type: ignore[index]


def test_a_kept_alive_connection_left_idle_is_closed(served: Served) -> None:
    with _raw(served) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        got = _read_all(sock)  # the answer, then the close once the idle timeout has passed
    assert got.startswith(b"HTTP/1.1 200")


def test_a_body_that_stops_arriving_is_answered_408(served: Served) -> None:
    with _raw(served) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": \"tiny\",")  # fmt: skip
        status, body = _status_and_body(_read_all(sock))
    assert status == 408 and body["error"]["code"] == "request_timeout", body  # type: ignore[index]


@pytest.mark.parametrize(
    "headers",
    [b"".join(b"X-H%d: v\r\n" % i for i in range(150)), b"X-Big: " + b"a" * (70 << 10) + b"\r\n"],
    ids=["150-headers", "70-KiB-header"],
)
def test_too_many_or_too_large_headers_are_answered_431(served: Served, headers: bytes) -> None:
    with _raw(served) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
        status, body = _status_and_body(_read_all(sock))
    assert status == 431 and body["error"]["code"] == "headers_too_large", body  # type: ignore[index]
    assert httpx.get(served.v1 + "/models", timeout=30).status_code == 200


def test_a_connection_past_max_connections_gets_503_and_the_others_are_served(served: Served) -> None:
    held = [_raw(served) for _ in range(24)]  # max_connections, each idle
    try:
        with _raw(served) as extra:
            status, body = _status_and_body(_read_all(extra))
        assert status == 503 and body["error"]["code"] == "too_many_connections", body  # type: ignore[index]
        held[0].sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")  # one of those held asks
        assert held[0].recv(1 << 16).startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()
    _until("the held connections are gone", lambda: httpx.get(served.v1 + "/models").status_code == 200)


def test_a_burst_past_the_queue_gets_429_with_retry_after_and_the_rest_complete(served: Served) -> None:
    def one(i: int) -> httpx.Response:
        return _completion(served, f"Story number {i}:", max_tokens=200, ignore_eos=True)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(one, range(12)))  # 4 run, 4 wait, the rest have no place
    codes = sorted(r.status_code for r in answers)
    assert set(codes) <= {200, 429} and codes.count(200) >= 8, codes
    for r in answers:
        if r.status_code == 429:
            assert r.headers["retry-after"].isdigit(), r.headers
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
        else:
            assert r.json()["usage"]["completion_tokens"] == 200


def test_a_3_mb_prompt_is_refused_before_it_queues(served: Served) -> None:
    prompt = "word " * (600 << 10)  # 3 MB
    r = httpx.post(served.v1 + "/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4},
                   timeout=120)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]


def test_shutdown_answers_streams_and_queued_requests_in_the_protocol(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """4 streams running, 8 requests queued, then SIGTERM with a 2 s grace: the queued ones get a
    503 JSON error at once, the streams run on for the grace, then end with an error event and
    [DONE]; the server exits 0 and logs no traceback."""
    log = tmp_path / "server.log"
    with serve(tiny_gguf, "--max-running", "4", "--max-queue", "8", "--grace", "2", "--context", "4096",
               log=log) as s:  # fmt: skip
        long = {"model": "tiny", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}

        def streamed(i: int) -> list[str]:
            """A stream's lines: the first through Anthropic's Messages, the others OpenAI's."""
            if i == 0:
                path = "/v1/messages"
                # greedy, the tiny model runs to max_tokens on this prompt (Messages has no ignore_eos)
                body = {"model": "tiny", "max_tokens": 4000, "temperature": 0, "stream": True,
                        "messages": [{"role": "user", "content": "Once upon a time"}]}  # fmt: skip
            else:
                path, body = "/completions", {**long, "prompt": f"Stream {i}", "stream": True}
            with httpx.stream("POST", s.v1 + path.removeprefix("/v1"), json=body, timeout=120) as r:
                assert r.status_code == 200, r.read()[:300]
                return [line for line in r.iter_lines() if line]

        def queued(i: int) -> httpx.Response:
            return httpx.post(s.v1 + "/completions", json={**long, "prompt": f"Queued {i}"}, timeout=120)

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            streams = [pool.submit(streamed, i) for i in range(4)]
            _until("4 running", lambda: metric(s.metrics(), "unillm:num_requests_running") >= 4)
            waits = [pool.submit(queued, i) for i in range(8)]
            _until("8 waiting", lambda: metric(s.metrics(), "unillm:num_requests_waiting") >= 8)
            os.kill(s.proc.pid, signal.SIGTERM)
            answers = [w.result() for w in waits]
            events = [f.result() for f in streams]
        # uvicorn raises the signal it caught again once it has shut down
        assert s.proc.wait(timeout=60) in (0, -signal.SIGTERM)
        text = s.log_tail(200_000)
    for r in answers:
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down", r.text[:300]
    anthropic, *openai = events
    assert anthropic[-2] == "event: error", anthropic[-3:]
    assert json.loads(anthropic[-1].removeprefix("data: "))["error"]["type"] == "overloaded_error"
    for lines in openai:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2].removeprefix("data: "))
        assert error["error"]["code"] == "server_shutting_down", lines[-3:]
    assert "Traceback" not in text and "Internal Server Error" not in text, text[-3000:]
