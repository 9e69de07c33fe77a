"""vLLM loaded for an application's event loop (``host_loop_for``, as ``unillm serve`` loads it):
the engine runs on that loop, streams there need no hop, and everything else still works: other
loops, sync callers on other threads, cancelling, closing, and the host's own tasks untouched."""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from unillm import ConfigError, EngineClosed, SamplingParams, load_engine
from unillm._contract._loops import host_loop_for
from unillm.testing import TinyModel

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

OPTIONS: dict[str, Any] = {"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20, "seed": 0}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Once upon a time", "0 1 2 3 4 5 6 7 8 9", "Why is the sky blue?"]


class Host:
    """An event loop on a thread of its own, as a server runs one."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-host", daemon=True)
        self._thread.start()
        self.loop_threads_started: set[threading.Thread] = set()  # by loading the engine below

    def run(self, coro: Any, timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def host() -> Iterator[Host]:
    h = Host()
    yield h
    h.close()


def open_hosted(tiny: TinyModel, host: Host) -> Any:
    """A vLLM engine loaded on this thread for the host's loop."""
    config = {
        "model": str(tiny.hf_dir),
        "backend": "vllm",
        "context_length": 512,
        "backend_options": {"vllm": OPTIONS},
    }
    with host_loop_for(host.loop):
        return load_engine(config)


@pytest.fixture(scope="module")
def engine(tiny: TinyModel, host: Host) -> Iterator[Any]:
    loops_before = _loop_threads()
    eng = open_hosted(tiny, host)
    host.loop_threads_started = _loop_threads() - loops_before  # read by the first test
    try:
        yield eng
    finally:
        eng.close()


def _loop_threads() -> set[threading.Thread]:
    """The unillm vLLM loop threads alive now (another engine of the session may own one)."""
    return {t for t in threading.enumerate() if t.name == "unillm-vllm-loop"}


async def tokens(engine: Any, prompt: str, params: SamplingParams = GREEDY) -> list[int]:
    return [t async for c in engine.astream(prompt, params) for t in c.token_ids]


def test_the_engine_runs_on_the_hosts_loop_with_no_loop_thread_of_its_own(engine: Any, host: Host) -> None:
    assert engine._loop.hosted and engine._loop.loop is host.loop
    assert host.loop_threads_started == set()  # loading the engine started no loop thread


def test_streams_on_the_host_other_loops_and_threads_give_the_same_greedy_tokens(
    engine: Any, host: Host
) -> None:
    async def on_host() -> list[list[int]]:  # four at once, on the engine's own loop
        return list(await asyncio.gather(*(tokens(engine, p) for p in PROMPTS)))

    hosted = host.run(on_host())
    elsewhere = [asyncio.run(tokens(engine, p)) for p in PROMPTS]  # another loop: the hop
    threads: list[list[int]] = [[] for _ in PROMPTS]

    def sync(i: int) -> None:
        threads[i] = list(engine.generate(PROMPTS[i], GREEDY).token_ids)

    workers = [threading.Thread(target=sync, args=(i,)) for i in range(len(PROMPTS))]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert all(len(t) == 24 for t in hosted)
    assert hosted == elsewhere == threads
    assert len({tuple(t) for t in hosted}) > 1  # the prompts' replies differ: not one answer


def test_a_blocking_call_on_the_hosts_loop_is_refused_not_hung(engine: Any, host: Host) -> None:
    async def blocking() -> Any:
        return engine.generate("Hello", GREEDY)

    with pytest.raises(ConfigError, match="astream"):
        host.run(blocking(), timeout=30)
    assert host.run(tokens(engine, "Hello")) == asyncio.run(tokens(engine, "Hello"))  # still serves


def test_a_stream_closed_early_on_the_host_aborts_its_request(engine: Any, host: Host) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def two_then_stop() -> int:
        got = 0
        stream = engine.astream("Once upon a time", long)
        async for c in stream:
            got += len(c.token_ids)
            if got >= 2:
                break
        await stream.aclose()
        for _ in range(200):  # vLLM's own count of unfinished requests drops to 0
            if engine._running().get_num_unfinished_requests() == 0:
                return got
            await asyncio.sleep(0.02)
        return -1

    assert host.run(two_then_stop()) == 2
    assert host.run(tokens(engine, "The quick brown fox")) == asyncio.run(
        tokens(engine, "The quick brown fox")
    )


def test_closing_ends_running_streams_and_leaves_the_hosts_tasks(tiny: TinyModel, host: Host) -> None:
    # an engine of its own, since it closes it: the module's engine stays open for the other tests
    # in any order (--random-order found them failing after this one when it closed the shared one)
    eng = open_hosted(tiny, host)
    try:
        _close_while_streaming(eng, host)
    finally:
        eng.close()


def _close_while_streaming(eng: Any, host: Host) -> None:
    bystander = asyncio.run_coroutine_threadsafe(asyncio.sleep(3600), host.loop)
    first = threading.Event()

    async def endless() -> BaseException | None:
        try:
            async for _ in eng.astream("Once upon a time", max_tokens=480, ignore_eos=True, temperature=0):
                first.set()
        except BaseException as exc:
            return exc
        return None

    running = asyncio.run_coroutine_threadsafe(endless(), host.loop)
    assert first.wait(120)
    eng.close()  # from this thread, as the server closes engines
    assert isinstance(running.result(30), EngineClosed)
    assert not bystander.done() and host.loop.is_running()
    bystander.cancel()
    with pytest.raises(EngineClosed):
        host.run(tokens(eng, "Hello"))
