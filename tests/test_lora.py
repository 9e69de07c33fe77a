"""LoRA adapters on the real engines: ``tiny_lora``'s adapter (the same numbers as PEFT, GGUF and
mlx-lm files) changes greedy output, gives the same tokens on llama.cpp, MLX and vLLM, and vLLM
serves several per request in one batch. Wrong paths, formats and names are refused up front."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from unillm import ConfigError, SamplingParams, UnsupportedParameter, load_engine
from unillm.testing import TinyLora, TinyModel, check_parity, tiny_lora

HAS = {m: importlib.util.find_spec(m) is not None for m in ("llama_cpp", "mlx_lm", "vllm")}
needs = {m: pytest.mark.skipif(not ok, reason=f"{m} is not installed") for m, ok in HAS.items()}

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
PROMPTS = ["Once upon a time", "The quick brown fox", "What is the capital of France?"]
VLLM_OPTIONS: dict[str, Any] = {
    "enforce_eager": True,
    "kv_cache_memory_bytes": 64 << 20,
    "max_num_seqs": 8,
    "seed": 0,
    "dtype": "float32",  # auto runs f32 weights in bf16 on this CPU: no parity with the others
}


@pytest.fixture(scope="module")
def lora(tiny: TinyModel) -> TinyLora:
    return tiny_lora(tiny)


@pytest.fixture(scope="module")
def lora2(tiny: TinyModel) -> TinyLora:
    return tiny_lora(tiny, seed=2, targets=("q_proj", "v_proj", "down_proj"))


def open_engine(tiny: TinyModel, backend: str, lora: Any = None, **options: Any) -> Any:
    model = tiny.gguf_path if backend == "llama.cpp" else tiny.hf_dir
    config: dict[str, Any] = {
        "model": str(model),
        "backend": backend,
        "context_length": 512,
        "options": options,
    }
    if lora is not None:
        config["lora"] = {k: str(v) for k, v in lora.items()} if isinstance(lora, dict) else str(lora)
    return load_engine(config)


def greedy(engine: Any, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(engine.generate(p, params).token_ids) for p in PROMPTS]


# ---- the builder ----


def test_every_format_holds_the_same_numbers(tiny: TinyModel, lora: TinyLora) -> None:
    import gguf
    from safetensors.numpy import load_file

    from unillm.testing._tiny import _permute_rope

    peft = load_file(str(lora.peft_dir / "adapter_model.safetensors"))
    mlx = load_file(str(lora.mlx_dir / "adapters.safetensors"))
    reader = gguf.GGUFReader(str(lora.gguf_path))
    g = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert str(bytes(reader.fields["general.type"].parts[-1]), "utf-8") == "adapter"
    assert float(reader.fields["adapter.lora.alpha"].parts[-1][0]) == lora.alpha
    config = json.loads((lora.peft_dir / "adapter_config.json").read_text())
    mlx_config = json.loads((lora.mlx_dir / "adapter_config.json").read_text())
    assert config["lora_alpha"] / config["r"] == mlx_config["lora_parameters"]["scale"] == lora.scale
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    for layer in range(tiny.spec.num_layers):
        for module, gname in names.items():
            a = peft[f"base_model.model.model.layers.{layer}.self_attn.{module}.lora_A.weight"]
            b = peft[f"base_model.model.model.layers.{layer}.self_attn.{module}.lora_B.weight"]
            assert a.shape[0] == b.shape[1] == lora.rank
            assert np.array_equal(mlx[f"model.layers.{layer}.self_attn.{module}.lora_a"], a.T)
            assert np.array_equal(mlx[f"model.layers.{layer}.self_attn.{module}.lora_b"], b.T)
            heads = {"q_proj": tiny.spec.num_heads, "k_proj": tiny.spec.num_kv_heads}.get(module)
            assert np.array_equal(g[f"blk.{layer}.{gname}.weight.lora_a"], a)
            want_b = _permute_rope(b, heads) if heads else b
            assert np.array_equal(g[f"blk.{layer}.{gname}.weight.lora_b"], want_b)
            # large enough to matter: the delta is of the base weight's size
            assert float(np.abs(lora.scale * b @ a).mean()) > 0.01


def test_the_adapter_is_cached_and_keyed_by_its_arguments(tiny: TinyModel, lora: TinyLora) -> None:
    again = tiny_lora(tiny)
    assert again == lora
    assert tiny_lora(tiny, seed=5).root != lora.root
    with pytest.raises(ValueError, match="targets"):
        tiny_lora(tiny, targets=("nope",))


# ---- one adapter on every request: llama.cpp and MLX ----


@pytest.fixture(scope="module")
def base_tokens(tiny: TinyModel) -> list[list[int]]:
    if not HAS["llama_cpp"]:
        pytest.skip("llama_cpp is not installed")
    with open_engine(tiny, "llama.cpp") as engine:
        return greedy(engine)


@needs["llama_cpp"]
@needs["mlx_lm"]
def test_the_adapter_changes_output_and_llamacpp_and_mlx_agree(
    tiny: TinyModel, lora: TinyLora, base_tokens: list[list[int]]
) -> None:
    with (
        open_engine(tiny, "llama.cpp", lora.gguf_path) as llama,
        open_engine(tiny, "mlx", lora.mlx_dir, batch_size=1) as mlx_one,
    ):
        tuned = greedy(llama)
        assert all(len(t) == 40 for t in tuned)
        changed = [t != b for t, b in zip(tuned, base_tokens, strict=True)]
        assert all(changed), f"the adapter left prompts unchanged: {changed}"
        report = check_parity({"llama.cpp": llama, "mlx": mlx_one}, PROMPTS, max_tokens=40, params=GREEDY)
        assert report.equal_share == 1.0, report.summary()


@needs["mlx_lm"]
def test_mlx_batched_mode_and_a_peft_directory_give_the_same_tokens(
    tiny: TinyModel, lora: TinyLora, base_tokens: list[list[int]]
) -> None:
    with open_engine(tiny, "mlx", lora.mlx_dir) as batched:  # batch_size 8: BatchGenerator
        want = greedy(batched)
    with open_engine(tiny, "mlx", lora.peft_dir, batch_size=1) as peft:  # converted at load
        assert greedy(peft) == want
    assert all(w != b for w, b in zip(want, base_tokens, strict=True))


# ---- errors ----


def test_a_missing_adapter_path_names_the_field(tiny: TinyModel, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lora") as info:
        open_engine(tiny, "mlx", tmp_path / "nope")
    assert "does not exist" in str(info.value)
    with pytest.raises(ConfigError, match="adapter 'a'"):
        open_engine(tiny, "vllm", {"a": tmp_path / "nope"})


@pytest.mark.parametrize(
    ("backend", "fmt", "wants"),
    [
        pytest.param("llama.cpp", "peft_dir", "one GGUF file", marks=needs["llama_cpp"]),
        pytest.param("mlx", "gguf_path", "adapters.safetensors", marks=needs["mlx_lm"]),
        pytest.param("vllm", "gguf_path", "PEFT directory", marks=needs["vllm"]),
    ],
)
def test_a_wrong_format_says_which_file_the_backend_wants(
    tiny: TinyModel, lora: TinyLora, backend: str, fmt: str, wants: str
) -> None:
    with pytest.raises(ConfigError, match=wants):
        open_engine(tiny, backend, getattr(lora, fmt))


@needs["llama_cpp"]
def test_a_model_gguf_is_not_an_adapter(tiny: TinyModel) -> None:
    with pytest.raises(ConfigError, match="is a GGUF of type None, not an adapter"):
        open_engine(tiny, "llama.cpp", tiny.gguf_path)


@needs["llama_cpp"]
def test_one_adapter_backends_refuse_several_and_per_request_names(
    tiny: TinyModel, lora: TinyLora, lora2: TinyLora
) -> None:
    with pytest.raises(ConfigError, match="one LoRA adapter"):
        open_engine(tiny, "llama.cpp", {"a": lora.gguf_path, "b": lora2.gguf_path})
    with open_engine(tiny, "llama.cpp", lora.gguf_path) as engine:
        assert engine.capabilities.lora and "lora" not in engine.capabilities.sampling
        with pytest.raises(UnsupportedParameter, match="lora"):
            engine.generate("Hello", SamplingParams(lora="default"))


@needs["vllm"]
def test_vllm_applies_a_lone_adapter_to_every_request(lora: TinyLora) -> None:
    from unillm import EngineConfig
    from unillm.engines.vllm._lora import LoraRequests

    one = LoraRequests(EngineConfig(model="m", lora=str(lora.peft_dir)))
    assert one.for_request(SamplingParams()).lora_path == str(lora.peft_dir)
    named = LoraRequests(EngineConfig(model="m", lora={"a": str(lora.peft_dir)}))
    assert named.for_request(SamplingParams()) is None  # a mapping: only requests that name one
    assert named.for_request(SamplingParams(lora="a")).lora_int_id == 1


# ---- vLLM: several adapters, per request ----


@pytest.fixture(scope="module")
def vllm(tiny: TinyModel, lora: TinyLora, lora2: TinyLora) -> Iterator[Any]:
    if not HAS["vllm"]:
        pytest.skip("vllm is not installed")
    engine = open_engine(tiny, "vllm", {"a": lora.peft_dir, "b": lora2.peft_dir}, **VLLM_OPTIONS)
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def vllm_single(vllm: Any) -> dict[str | None, list[list[int]]]:
    """Each adapter's (and the base model's) greedy tokens, one request at a time."""
    return {name: greedy(vllm, GREEDY.model_copy(update={"lora": name})) for name in (None, "a", "b")}


def test_vllm_adapters_change_output_and_match_llamacpp(
    tiny: TinyModel, lora: TinyLora, base_tokens: list[list[int]], vllm_single: dict[str | None, Any]
) -> None:
    assert vllm_single[None] == base_tokens  # f32 on both: the base model agrees
    assert vllm_single["a"] != vllm_single[None] and vllm_single["b"] != vllm_single[None]
    assert vllm_single["a"] != vllm_single["b"]
    with open_engine(tiny, "llama.cpp", lora.gguf_path) as llama:
        tuned = greedy(llama)
    agree = [t == v for t, v in zip(tuned, vllm_single["a"], strict=True)]
    assert all(agree), f"vLLM and llama.cpp with the same adapter: prompts equal {agree}"


def test_vllm_serves_two_adapters_and_none_in_one_batch(
    vllm: Any, vllm_single: dict[str | None, list[list[int]]]
) -> None:
    names = [None, "a", "b"]

    async def batch() -> list[Any]:
        jobs = [vllm.agenerate(p, GREEDY.model_copy(update={"lora": n})) for p in PROMPTS for n in names]
        return await asyncio.gather(*jobs)

    done = asyncio.run(batch())
    got = {
        n: [list(done[i * len(names) + j].token_ids) for i in range(len(PROMPTS))]
        for j, n in enumerate(names)
    }
    for name in names:
        assert got[name] == vllm_single[name], f"adapter {name!r} in a batch differs from alone"
    # with both adapters in their slots, a request without one is still the base model
    assert greedy(vllm) == vllm_single[None]


def test_vllm_keeps_a_spare_empty_slot_on_the_cpu_build(vllm: Any) -> None:
    # vLLM's CPU LoRA kernels read the last slot for "no adapter" (index -1): unillm keeps it empty
    assert vllm.engine_args["enable_lora"] is True
    assert vllm.engine_args["max_loras"] == 3
    assert vllm.engine_args["max_lora_rank"] == 16  # the option's default, above the adapters' rank 4


def test_vllm_lora_args_round_the_rank_up_and_keep_larger_options(lora: TinyLora, lora2: TinyLora) -> None:
    from unillm import EngineConfig
    from unillm.engines.vllm import VLLMOptions
    from unillm.engines.vllm._lora import lora_engine_args

    config = EngineConfig(model="m", lora={"a": str(lora.peft_dir), "b": str(lora2.peft_dir)})
    args = lora_engine_args(config, VLLMOptions(max_lora_rank=5), cpu=False)
    assert args == {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    assert lora_engine_args(config, VLLMOptions(max_loras=6), cpu=True)["max_loras"] == 6
    assert lora_engine_args(EngineConfig(model="m"), VLLMOptions(), cpu=True) == {}


def test_vllm_refuses_an_unknown_adapter_name(vllm: Any) -> None:
    with pytest.raises(ConfigError, match=r"no LoRA adapter named 'c'.*'a', 'b'"):
        vllm.generate("Hello", SamplingParams(lora="c"))


# ---- ExLlamaV2 (CUDA only: against the fake of exllamav2 0.3.x in tests/fake_exllamav2) ----

FAKE_EXLLAMAV2 = Path(__file__).resolve().parent / "fake_exllamav2"


@pytest.fixture(scope="module")
def exl() -> Iterator[Any]:
    from unillm.engines.exllamav2 import ASSUME_GPU_ENV

    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(FAKE_EXLLAMAV2))
    mp.setenv(ASSUME_GPU_ENV, "1")
    import exllamav2

    assert Path(exllamav2.__file__).is_relative_to(FAKE_EXLLAMAV2)
    yield exllamav2
    mp.undo()
    for name in [m for m in sys.modules if m == "exllamav2" or m.startswith("exllamav2.")]:
        del sys.modules[name]


def test_exllamav2_applies_the_adapter_to_every_job(
    exl: Any, tiny: TinyModel, lora: TinyLora, lora2: TinyLora
) -> None:
    runs: dict[str, list[list[int]]] = {}
    for name, adapter in (("base", None), ("a", lora.peft_dir), ("b", lora2.peft_dir)):
        with open_engine(tiny, "exllamav2", adapter) as engine:
            assert engine.capabilities.lora and "lora" not in engine.capabilities.sampling
            runs[name] = greedy(engine)
            if adapter is not None:
                assert engine._generator.current_loras == [engine._lora]
                assert engine._lora.lora_scaling == lora.scale  # alpha / r, as exllamav2 scales
    assert all(len(t) == 40 for t in runs["a"])
    assert runs["a"] != runs["base"] and runs["b"] != runs["base"] and runs["a"] != runs["b"]
    with open_engine(tiny, "exllamav2", lora.peft_dir) as again:
        assert greedy(again) == runs["a"]


def test_exllamav2_refuses_what_exllamav2_cannot_read(
    exl: Any, tiny: TinyModel, lora: TinyLora, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="PEFT directory"):
        open_engine(tiny, "exllamav2", lora.gguf_path)
    bad = tmp_path / "fan"
    shutil.copytree(lora.peft_dir, bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "fan_in_fan_out": True}))
    with pytest.raises(ConfigError, match="fan_in_fan_out"):
        open_engine(tiny, "exllamav2", bad)
