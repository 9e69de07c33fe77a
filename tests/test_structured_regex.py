"""Regex and choice formats: read once, enforced through llguidance on every engine (llama.cpp one
sequence at a time and batched, MLX; tests/test_vllm.py has vLLM's), never ignored. Random weights
at temperature 1 over many seeds make this a test of the constraint, not of the model."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from unillm import ConfigError, SamplingParams
from unillm._structured import StructuredOutputError, output_format
from unillm.testing import TinyModel

PATTERN = r"[0-9]{3}-[a-z]{2,4}( ok)?"
CHOICES = ["yes", "no", 'say "maybe"', "naïve\nline", "back\\slash"]


def test_regex_and_choice_shapes_read_to_one_format() -> None:
    fmt = output_format({"type": "regex", "pattern": PATTERN})
    assert fmt is not None and (fmt.kind, fmt.pattern, fmt.is_json) == ("regex", PATTERN, False)
    also = output_format({"type": "regex", "regex": PATTERN})  # vLLM's spelling
    assert also == fmt
    choice = output_format({"type": "choice", "choices": ["a", "b", "a"]})
    assert choice is not None and choice.choices == ("a", "b")  # repeats dropped, order kept
    with pytest.raises(ConfigError, match="not JSON"):
        _ = choice.json_schema  # a JSON-only backend refuses it loudly, never enforces {"type": "object"}


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ({"type": "regex"}, 'needs "pattern"'),
        ({"type": "regex", "pattern": ""}, 'needs "pattern"'),
        ({"type": "regex", "pattern": "a("}, "not a regular expression"),
        ({"type": "regex", "pattern": "(?=a)b"}, "lookaround"),
        ({"type": "regex", "pattern": "(?<!a)b"}, "lookaround"),
        ({"type": "regex", "pattern": r"(a)\1"}, "backreference"),
        ({"type": "regex", "pattern": "(?i)abc"}, "inline flag"),
        ({"type": "choice"}, "list of non-empty strings"),
        ({"type": "choice", "choices": []}, "list of non-empty strings"),
        ({"type": "choice", "choices": ["a", ""]}, "list of non-empty strings"),
        ({"type": "choice", "choices": ["a", 3]}, "list of non-empty strings"),
        ({"type": "choice", "choices": "ab"}, "list of non-empty strings"),
        ({"type": "choice", "choices": [str(i) for i in range(5000)]}, "at most"),
    ],
)
def test_a_bad_regex_or_choice_is_a_config_error(value: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        output_format(value)


def test_parse_checks_the_whole_text() -> None:
    fmt = output_format({"type": "regex", "pattern": PATTERN})
    assert fmt is not None and fmt.parse("123-ab ok") == "123-ab ok"
    with pytest.raises(StructuredOutputError) as caught:
        fmt.parse("123-ab ok!", "length")
    assert caught.value.raw == "123-ab ok!" and "max_tokens" in str(caught.value)
    choice = output_format({"type": "choice", "choices": CHOICES})
    assert choice is not None and choice.parse("naïve\nline") == "naïve\nline"
    with pytest.raises(StructuredOutputError):
        choice.parse("ye")


# ---- llama.cpp: llguidance enforces both, one sequence at a time and batched ----


@pytest.fixture(scope="module", params=[1, 4], ids=["llama.cpp", "llama.cpp-batched"])
def llama(request: pytest.FixtureRequest, tiny: TinyModel) -> Iterator[Any]:
    pytest.importorskip("llama_cpp")
    from unillm.engines.llamacpp import LlamaCppEngine

    opts = {"n_threads": 1, "parallel": request.param}
    with LlamaCppEngine(model=str(tiny.gguf_path), context_length=512, options=opts) as engine:
        yield engine


def test_llama_cpp_every_output_is_one_of_the_choices(llama: Any) -> None:
    seen = set()
    for seed in range(24):
        done = llama.generate(
            "Answer:", temperature=1.0, seed=seed, max_tokens=40,
            response_format={"type": "choice", "choices": CHOICES},
        )  # fmt: skip
        assert done.text in CHOICES and done.finish_reason == "stop", (seed, done)
        assert done.parsed() == done.text
        seen.add(done.text)
    assert len(seen) >= 2  # sampled, not a constant: the grammar allows each choice


def test_llama_cpp_every_output_matches_the_regex(llama: Any) -> None:
    seen = set()
    for seed in range(12):
        done = llama.generate(
            "Code:", temperature=1.0, seed=seed, max_tokens=40,
            response_format={"type": "regex", "pattern": PATTERN},
        )  # fmt: skip
        assert re.fullmatch(PATTERN, done.text) and done.finish_reason == "stop", (seed, done)
        seen.add(done.text)
    assert len(seen) >= 3


# ---- MLX: llguidance enforces both ----


@pytest.fixture(scope="module", params=[1, 4], ids=["mlx", "mlx-batched"])
def mlx(request: pytest.FixtureRequest, tiny: TinyModel) -> Iterator[Any]:
    pytest.importorskip("mlx_lm")
    pytest.importorskip("llguidance")
    from unillm.engines.mlx import MLXEngine

    with MLXEngine(model=str(tiny.hf_dir), context_length=512, options={"batch_size": request.param}) as e:
        yield e


def test_mlx_every_output_matches_the_regex(mlx: Any) -> None:
    seen = set()
    for seed in range(12):
        done = mlx.generate(
            "Code:",
            temperature=1.0,
            seed=seed,
            max_tokens=40,
            response_format={"type": "regex", "pattern": PATTERN},
        )
        assert re.fullmatch(PATTERN, done.text) and done.finish_reason == "stop", (seed, done)
        seen.add(done.text)
    assert len(seen) >= 3


def test_mlx_every_output_is_one_of_the_choices(mlx: Any) -> None:
    params = SamplingParams(
        temperature=1.0, max_tokens=40, response_format={"type": "choice", "choices": CHOICES}
    )
    for seed in range(10):
        done = mlx.generate("Answer:", params, seed=seed)
        assert done.text in CHOICES and done.finish_reason == "stop", (seed, done)
