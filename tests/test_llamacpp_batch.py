"""Continuous batching on llama.cpp (``options={"parallel": N}``), on real llama-cpp-python.

Each batched engine is opened once per module and size: the tests share it, and check between
them that it holds nothing (every sequence finished or cancelled frees its cells or keeps them as a
prefix, never runs on)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import closing
from typing import Any

import pytest

from unillm import SamplingParams
from unillm.testing import TinyModel, tiny_model

pytest.importorskip("llama_cpp")

from unillm.engines.llamacpp import LlamaCppEngine

PARALLEL = 8
N = 24
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
PROMPTS = [f"Once upon a time, story {i} began with" + " and then" * (i % 5) for i in range(20)]


def open_engine(model: TinyModel, **options: Any) -> LlamaCppEngine:
    opts = {"n_threads": 2, "parallel": PARALLEL, **options}
    return LlamaCppEngine(model=str(model.gguf_path), context_length=512, options=opts).load()


@pytest.fixture(scope="module", params=["small", "bench"])
def sized(
    request: pytest.FixtureRequest, tiny: TinyModel
) -> Iterator[tuple[TinyModel, LlamaCppEngine, LlamaCppEngine]]:
    """A tiny model of each size, its batched engine, and a one-sequence engine beside it."""
    model = tiny if request.param == "small" else tiny_model("bench")
    with open_engine(model) as batched, open_engine(model, parallel=1) as alone:
        assert batched.capabilities.batching and not alone.capabilities.batching
        yield model, batched, alone


def run_together(
    engine: LlamaCppEngine, prompts: list[str], params: SamplingParams
) -> tuple[list[list[int]], list[str]]:
    """Each prompt on a thread of its own, all started together; the tokens each got, and the
    order in which the streams' first and last tokens arrived."""
    out: list[list[int]] = [[] for _ in prompts]
    order: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        start.wait()
        for c in engine.stream(prompts[i], params):
            with lock:
                if c.token_ids and not out[i]:
                    order.append(f"first {i}")
                out[i].extend(c.token_ids)
        with lock:
            order.append(f"last {i}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, order


def margin(engine: LlamaCppEngine, prompt: str, got: list[int], want: list[int]) -> str:
    """Where two greedy outputs part, and how close the top two logits were there (alone)."""
    at = next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
    lps = engine.generate(prompt, GREEDY, max_tokens=at + 1, logprobs=2).top_logprobs[at]
    (_, first), (_, second) = lps[:2]
    return f"token {at}: {want[at]} alone, {got[at]} batched, top-2 logprob margin {first - second:.2e}"


def test_eight_streams_at_once_give_the_tokens_each_gets_alone(sized: tuple[TinyModel, Any, Any]) -> None:
    _, batched, alone = sized
    want = [alone.generate(p, GREEDY).token_ids for p in PROMPTS]
    got: list[list[int]] = []
    for wave in range(0, len(PROMPTS), PARALLEL):
        tokens, order = run_together(batched, PROMPTS[wave : wave + PARALLEL], GREEDY)
        got += tokens
        n = len(tokens)
        # every stream's first token came before any stream's last: they ran at once
        assert all(o.startswith("first") for o in order[:n]), order
    same = [g == list(w) for g, w in zip(got, want, strict=True)]
    diffs = [
        margin(alone, p, g, list(w)) for p, g, w, s in zip(PROMPTS, got, want, same, strict=True) if not s
    ]
    print("\n".join(diffs))
    assert sum(same) >= 0.95 * len(PROMPTS), diffs
    assert batched.kv_stats().running_sequences == 0


WHOLE_STEP = """
import json, sys, threading
from unillm import SamplingParams
from unillm.engines.llamacpp import LlamaCppEngine
path, n_batch = sys.argv[1], int(sys.argv[2])
greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
prompts = [f"Request {i} asks: " + " ".join(f"item{j}" for j in range(25)) for i in range(8)]
opts = {"n_threads": 2, "n_batch": n_batch}
with LlamaCppEngine(model=path, context_length=512, options={**opts, "parallel": 1}) as alone:
    want = [list(alone.generate(p, greedy).token_ids) for p in prompts]
    step_tokens = sum(len(alone.tokenize(p)) for p in prompts)
got = [None] * 8
with LlamaCppEngine(model=path, context_length=512, options={**opts, "parallel": 8}) as batched:
    def run(i):
        got[i] = list(batched.generate(prompts[i], greedy).token_ids)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
print(json.dumps({"same": sum(g == w for g, w in zip(got, want)), "step_tokens": step_tokens}))
"""


def test_prompts_filling_a_whole_step_together(tiny: TinyModel) -> None:
    """Eight prompts of ~100 tokens arriving together fill one step (n_batch 512) past the small
    context the engine's tokenizer runs on: the step holds what the batching context takes, and
    every stream gets its own tokens. In a subprocess: a step larger than the context's n_batch
    is an abort in llama.cpp (GGML_ASSERT), which would end this interpreter."""
    out = subprocess.run(
        [sys.executable, "-c", WHOLE_STEP, str(tiny.gguf_path), "512"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["step_tokens"] > 256 and result["same"] >= 0.95 * 8, result


def test_seeded_sampling_does_not_depend_on_the_batch(sized: tuple[TinyModel, Any, Any]) -> None:
    _, batched, _ = sized
    seeded = SamplingParams(max_tokens=N, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    alone = batched.generate(PROMPTS[3], seeded).token_ids
    others = SamplingParams(max_tokens=N, temperature=1.2, seed=99, ignore_eos=True)
    prompts = [PROMPTS[3], *PROMPTS[10:17]]
    params = [seeded, *[others] * 7]
    out: list[tuple[int, ...]] = [()] * len(prompts)

    def run(i: int) -> None:
        out[i] = batched.generate(prompts[i], params[i]).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out[0] == alone


def test_a_cancelled_stream_frees_its_cells_and_leaves_the_others_alone(
    sized: tuple[TinyModel, Any, Any],
) -> None:
    _, batched, alone = sized
    prompts = PROMPTS[:4]
    want = [alone.generate(p, GREEDY).token_ids for p in prompts]
    got: list[list[int]] = [[] for _ in prompts]
    cut = threading.Event()
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        start.wait()
        with closing(batched.stream(prompts[i], GREEDY)) as chunks:  # type: ignore[type-var]
            for c in chunks:
                got[i].extend(c.token_ids)
                if i == 0 and len(got[i]) == 3:
                    cut.set()
                    return  # the caller stops reading: the sequence is cancelled

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cut.is_set() and got[0] == list(want[0][:3])
    assert got[1:] == [list(w) for w in want[1:]]
    stats = batched.kv_stats()
    assert stats.running_sequences == 0  # the cancelled one runs on no longer
    batched.reset()
    assert batched.kv_stats().used_tokens == 0  # and holds no cells once the kept prefixes go


def test_async_streams_join_the_batch_on_the_callers_loop_and_a_cancelled_one_leaves(
    sized: tuple[TinyModel, Any, Any],
) -> None:
    """``astream`` on a batching engine reads the worker's events on the caller's loop: no thread
    per request; cancelling a task mid-stream frees its sequence, the others' tokens unchanged."""
    _, batched, alone = sized
    prompts = PROMPTS[:PARALLEL]
    want = [list(alone.generate(p, GREEDY).token_ids) for p in prompts]
    threads: set[str] = set()

    async def one(i: int, got: list[int], cut: asyncio.Event | None) -> None:
        async for c in batched.astream(prompts[i], GREEDY):
            got.extend(c.token_ids)
            threads.update(t.name for t in threading.enumerate())
            if cut is not None and len(got) == 3:
                cut.set()
                await asyncio.Event().wait()  # stalls here until cancelled

    async def main() -> list[list[int]]:
        got: list[list[int]] = [[] for _ in prompts]
        cut = asyncio.Event()
        tasks = [asyncio.create_task(one(i, got[i], cut if i == 0 else None)) for i in range(len(prompts))]
        await cut.wait()
        tasks[0].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return got

    got = asyncio.run(main())
    assert got[0] == want[0][:3] and got[1:] == want[1:]
    assert not any(name.startswith("unillm-astream") for name in threads), threads
    assert batched.kv_stats().running_sequences == 0


def test_a_long_prompt_is_prefilled_in_chunks_between_the_running_streams_steps(
    sized: tuple[TinyModel, Any, Any],
) -> None:
    model, _, _ = sized
    with open_engine(model, n_batch=32) as engine:  # small chunks, so the prefill takes many steps
        words = [f"word{i}" for i in range(400)]
        while len(engine.tokenize(" ".join(words))) > 400:  # most of the context, and room to answer
            words.pop()
        long_prompt = " ".join(words)
        n_long = len(engine.tokenize(long_prompt))
        steps = -(-n_long // 32)  # the prefill's chunks, at most 32 tokens per step
        running = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
        got: dict[str, list[int]] = {}
        arrivals: list[str] = []
        lock = threading.Lock()
        started = threading.Event()

        def stream(name: str, prompt: str, params: SamplingParams) -> None:
            for c in engine.stream(prompt, params):
                if c.token_ids:
                    with lock:
                        got.setdefault(name, []).extend(c.token_ids)
                        arrivals.append(name)
                        if len(got) == 4 and all(len(v) >= 2 for v in got.values()):
                            started.set()

        threads = [threading.Thread(target=stream, args=(f"s{i}", PROMPTS[i], running)) for i in range(4)]
        for t in threads:
            t.start()
        assert started.wait(120)  # the four stream (a guard against a hang, not a speed limit)
        long = threading.Thread(
            target=stream, args=("long", long_prompt, SamplingParams(max_tokens=2, temperature=0.0))
        )
        long.start()
        for t in [*threads, long]:
            t.join()
        first_long = arrivals.index("long")
        before = [a for a in arrivals[:first_long] if a == "s0"]
        # while the long prompt was prefilled chunk by chunk, s0 got a token at every step
        assert len(got["s0"]) == 120 and len(before) >= steps - 1


def test_prefix_reuse_shows_in_usage_and_kv_stats(sized: tuple[TinyModel, Any, Any]) -> None:
    _, batched, _ = sized
    batched.reset()
    before = batched.kv_stats()
    shared = "A long shared system prompt that many requests begin with, " * 3
    first = batched.generate(shared + "question one", GREEDY)
    second = batched.generate(shared + "question two", GREEDY)
    assert first.usage.cached_prompt_tokens == 0
    prefix = len(batched.tokenize(shared))
    assert second.usage.cached_prompt_tokens is not None and second.usage.cached_prompt_tokens >= prefix - 2
    after = batched.kv_stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits == second.usage.cached_prompt_tokens
    assert after.prefix_cache_queries - before.prefix_cache_queries == (
        first.usage.prompt_tokens + second.usage.prompt_tokens
    )


@pytest.mark.parametrize("budget", [0, 60])
def test_kept_prefixes_stay_within_their_token_budget(tiny: TinyModel, budget: int) -> None:
    """Finished sequences' cells are kept for reuse up to ``prefix_cache_tokens``, oldest out first
    (every step attends over them, so they are bounded); 0 keeps none."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with open_engine(tiny, parallel=4, prefix_cache_tokens=budget) as engine:
        run_together(engine, PROMPTS[:4], params)  # four finish together: four candidates to keep
        sizes = [len(engine.tokenize(p)) + 8 for p in PROMPTS[:4]]
        stats = engine.kv_stats()
        assert stats.running_sequences == 0
        assert sum(sizes) > budget and max(sizes) <= 60
        assert stats.used_tokens <= budget  # not sum(sizes)
        assert (stats.used_tokens > 0) == (budget > 0)  # what fits is kept


def test_a_draft_model_turns_batching_off_with_a_warning(tiny: TinyModel) -> None:
    with pytest.warns(UserWarning, match="draft_model runs one request at a time"):
        engine = open_engine(tiny, draft_model="prompt-lookup")
    with engine:
        assert not engine.capabilities.batching
