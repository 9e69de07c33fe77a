"""``unillm serve`` over ExLlamaV2, against the fake of its API (tests/fake_exllamav2): a batching
engine gets concurrent requests concurrently, and greedy text equals the in-process engine's.
The GPU check script runs the real exllamav2 on a GPU."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from unillm.engines.exllamav2 import ASSUME_GPU_ENV
from unillm.testing import TinyModel

from ._server_util import stop_group

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

ROOT = Path(__file__).resolve().parent.parent
FAKE = Path(__file__).resolve().parent / "fake_exllamav2"
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server(tiny: TinyModel) -> Iterator[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(FAKE), str(ROOT)]),
        ASSUME_GPU_ENV: "1",
        "FAKE_EXLLAMAV2_STEP_SECONDS": "0.01",  # slow enough that concurrent requests overlap
    }
    argv = [sys.executable, "-m", "unillm", "serve", str(tiny.hf_dir), "--backend", "exllamav2",
            "--alias", "exl", "--port", "0", "--context", "512", "--option", "max_batch_size=4"]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stderr is not None
    try:
        url = None
        for line in proc.stderr:
            found = re.search(r"listening on (http://\S+)/v1", line)
            if found:
                url = found.group(1)
                break
        assert url is not None, f"the server exited with {proc.wait()} before listening"
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # never let the pipe fill
        yield url
    finally:
        stop_group(proc, 30)


def _in_process_greedy(tiny: TinyModel, n: int) -> str:
    """The same chat on the same fake engine, loaded in this process."""
    code = (
        "import sys; from unillm.engines.exllamav2 import ExLlamaV2Engine\n"
        f"with ExLlamaV2Engine(model={str(tiny.hf_dir)!r}, context_length=512, "
        "options={'max_batch_size': 4}) as e:\n"
        f"    sys.stdout.write(e.chat({MESSAGES!r}, temperature=0, max_tokens={n}).text)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE), str(ROOT)]), ASSUME_GPU_ENV: "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout


def test_greedy_chat_equals_the_in_process_engine(server: str, tiny: TinyModel) -> None:
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    reply = client.chat.completions.create(model="exl", messages=MESSAGES, temperature=0, max_tokens=12)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    assert reply.choices[0].message.content == _in_process_greedy(tiny, 12)


def test_exllamav2_refuses_what_it_cannot_honour(server: str) -> None:
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="exl", messages=MESSAGES, max_tokens=4, logprobs=True)  # type: ignore[arg-type]
    assert caught.value.body["param"] == "logprobs"  # type: ignore[index]


def test_concurrent_requests_run_at_once(server: str) -> None:
    async def one(client: Any) -> tuple[float, float, int]:
        first = end = 0.0
        n = 0
        stream = await client.completions.create(
            model="exl", prompt="Count:", max_tokens=40, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for event in stream:
            if event.choices and not first:
                first = time.monotonic()
            if event.usage:
                n = event.usage.completion_tokens
        end = time.monotonic()
        return first, end, n

    async def main() -> list[tuple[float, float, int]]:
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused") as client:
            return await asyncio.gather(*(one(client) for _ in range(4)))

    results = asyncio.run(main())
    assert [n for *_, n in results] == [40] * 4
    # one at a time, each would start after the previous ended (40 steps of 10 ms each)
    assert max(first for first, _, _ in results) < min(end for _, end, _ in results), results
