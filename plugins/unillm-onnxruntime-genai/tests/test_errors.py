"""What goes wrong is a typed unillm error, the same one the built-ins raise."""

from __future__ import annotations

from pathlib import Path

import pytest
from unillm_onnxruntime_genai.engine import OnnxGenAIEngine

import unillm
from unillm import SamplingParams
from unillm.testing import TinyModel


def test_a_missing_model_directory_is_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(unillm.ModelNotFound):
        OnnxGenAIEngine({"model": str(tmp_path / "nowhere")}).load()


def test_a_gguf_is_refused_and_told_where_to_go(tiny: TinyModel) -> None:
    with pytest.raises(unillm.ModelFormatError, match=r"is a GGUF file.*llama\.cpp"):
        OnnxGenAIEngine({"model": str(tiny.gguf_path)}).load()


def test_an_hf_directory_is_refused_with_the_converter_named(tiny: TinyModel) -> None:
    with pytest.raises(unillm.ModelFormatError, match=r"genai_config\.json.*models\.builder.*mlx, vllm"):
        OnnxGenAIEngine({"model": str(tiny.hf_dir)}).load()


def test_a_broken_genai_config_is_a_format_error(tmp_path: Path, onnx_dir: Path) -> None:
    (tmp_path / "genai_config.json").write_text("{not json")
    with pytest.raises(unillm.ModelFormatError, match="not valid JSON"):
        OnnxGenAIEngine({"model": str(tmp_path)}).load()
    (tmp_path / "genai_config.json").write_text('{"model": {"type": "llama"}}')
    with pytest.raises(unillm.ModelFormatError, match=r"no model\.decoder"):
        OnnxGenAIEngine({"model": str(tmp_path)}).load()
    # a config that reads but whose graph is missing: ORT GenAI's own error, typed
    (tmp_path / "genai_config.json").write_text((onnx_dir / "genai_config.json").read_text())
    with pytest.raises(unillm.ModelLoadError, match="could not load"):
        OnnxGenAIEngine({"model": str(tmp_path)}).load()


def test_a_prompt_over_the_context_is_context_length_exceeded(onnx_dir: Path) -> None:
    with OnnxGenAIEngine({"model": str(onnx_dir), "context_length": 32}) as e:
        assert e.context_length == 32 and e.kv_stats().capacity_tokens == 32
        long = "one two three four five six seven eight nine ten " * 4
        with pytest.raises(unillm.ContextLengthExceeded):
            e.stream(long)  # at the call, not at the first token
        with pytest.raises(unillm.ContextLengthExceeded):
            e.generate(list(range(40)))
        # a prompt that fits but leaves less room than max_tokens ends at the context: "length"
        out = e.generate(list(range(3, 28)), temperature=0.0, max_tokens=50)
        assert out.finish_reason == "length" and out.usage.completion_tokens == 32 - 25
        assert e.generate("hi", temperature=0.0, max_tokens=4).usage.completion_tokens == 4  # still fine


def test_a_context_longer_than_the_model_holds_is_refused(onnx_dir: Path) -> None:
    with pytest.raises(unillm.ConfigError, match="longer than the 4096 tokens"):
        OnnxGenAIEngine({"model": str(onnx_dir), "context_length": 8192}).load()


@pytest.mark.parametrize(
    "param", [{"min_p": 0.1}, {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}, {"min_tokens": 3}]
)
def test_a_sampling_parameter_it_cannot_honour_is_refused(
    engine: OnnxGenAIEngine, param: dict[str, float]
) -> None:
    with pytest.raises(unillm.UnsupportedParameter) as info:
        engine.generate("hi", {"temperature": 0.0, **param})
    assert info.value.params == list(param) and info.value.backend == "onnxruntime-genai"


def test_the_unsupported_params_policy_applies(onnx_dir: Path) -> None:
    with OnnxGenAIEngine({"model": str(onnx_dir), "unsupported_params": "drop"}) as e:
        dropped = e.generate("hi", temperature=0.0, max_tokens=4, min_p=0.2)
        assert dropped.token_ids == e.generate("hi", temperature=0.0, max_tokens=4).token_ids
    # a response format is never dropped, whatever the policy
    with (
        OnnxGenAIEngine({"model": str(onnx_dir), "unsupported_params": "drop"}) as e,
        pytest.raises(unillm.UnsupportedParameter, match="never ignored"),
    ):
        e.generate("hi", SamplingParams(response_format={"type": "json_object"}))


def test_unknown_options_and_provider_options_without_a_provider(onnx_dir: Path) -> None:
    with pytest.raises(
        unillm.ConfigError, match="valid onnxruntime-genai options: provider, provider_options"
    ):
        OnnxGenAIEngine({"model": str(onnx_dir), "options": {"n_ctx": 5}})
    with pytest.raises(unillm.ConfigError, match="need a provider"):
        OnnxGenAIEngine({"model": str(onnx_dir), "options": {"provider_options": {"device_id": "0"}}}).load()


def test_a_provider_this_build_lacks_is_a_load_error(onnx_dir: Path) -> None:
    build = OnnxGenAIEngine.probe_build(None, [])
    if build is not None and "cuda" in build.devices:
        pytest.skip("this onnxruntime-genai build has CUDA")
    with pytest.raises(unillm.ModelLoadError, match="could not load"):
        OnnxGenAIEngine({"model": str(onnx_dir), "options": {"provider": "cuda"}}).load()
    with OnnxGenAIEngine({"model": str(onnx_dir), "options": {"provider": "cpu"}}) as e:
        assert e.generate("hi", temperature=0.0, max_tokens=3).usage.completion_tokens == 3
