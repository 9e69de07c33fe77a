"""ExLlamaV2's structured output: a response format as an exllamav2 sampling filter over llguidance,
on the fake exllamav2 (tests/fake_exllamav2), whose generator runs filters as exllamav2's does.

The tiny model's weights are random, so at temperature 1 what it writes is noise: an output that
validates does so because the filter made it.
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.test_structured import REFUSAL, UNENFORCEABLE
from unillm import BackendUnavailable, ConfigError, SamplingParams, UnsupportedParameter
from unillm._structured import output_format
from unillm.engines.exllamav2 import ASSUME_GPU_ENV, ExLlamaV2Engine
from unillm.testing import TinyModel

pytest.importorskip("llguidance")

FAKE = Path(__file__).resolve().parent / "fake_exllamav2"
SEEDS = range(24)

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["pickup", "delivery"]},
        "n": {"type": "integer", "minimum": 3, "maximum": 9},
        "ratio": {"type": "number", "minimum": -1, "maximum": 1},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "where": {
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{1,3}$"}},
            "required": ["code"],
            "additionalProperties": False,
        },
        "gift": {"type": "boolean"},
    },
    "required": ["kind", "n", "items", "where", "gift"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,4}(\.[0-9]{2})?"
CHOICES = ["yes", "no", "maybe so", "ask again"]


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, so outputs end
    sku: str = Field(pattern="^[a-z]{1,6}$")
    qty: int = Field(ge=1, le=9)


class Order(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["pickup", "delivery"]
    items: list[Item] = Field(min_length=1, max_length=2)
    gift: bool


@pytest.fixture(scope="module", autouse=True)
def exl() -> Iterator[ModuleType]:
    """The fake exllamav2, importable for this module's tests only, and a GPU assumed."""
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(FAKE))
    mp.setenv(ASSUME_GPU_ENV, "1")
    import exllamav2

    assert Path(exllamav2.__file__).is_relative_to(FAKE)
    yield exllamav2
    mp.undo()
    for name in [m for m in sys.modules if m == "exllamav2" or m.startswith("exllamav2.")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def engine(tiny: TinyModel) -> Iterator[ExLlamaV2Engine]:
    with ExLlamaV2Engine(model=str(tiny.hf_dir), context_length=1024, options={"max_batch_size": 4}) as e:
        assert e.capabilities.batching and "response_format" in e.capabilities.sampling
        yield e


def hot(**kw: Any) -> SamplingParams:
    return SamplingParams(temperature=1.0, **{"max_tokens": 200, **kw})


# ---- the fake's generator runs filters as exllamav2's does ----


def test_the_fake_generator_masks_feeds_and_ends_on_a_filters_end_token(tiny: TinyModel) -> None:
    """exllamav2/generator/dynamic.py and sampler.py: sample only from ``pass_tokens``, ``feed``
    each sampled token, end the job ("end_filter", the end token emitted) when one of
    ``end_tokens`` is sampled; a single passing token is taken without sampling."""
    from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler
    from exllamav2.generator.filters import ExLlamaV2Filter

    allowed, end = {5, 6, 7, 8, 9}, 9

    class Few(ExLlamaV2Filter):  # type: ignore[misc]
        def begin(self, prefix_str: str) -> None:
            self.fed: list[int] = []
            self.began = True

        def feed(self, token: Any) -> None:
            self.fed.append(int(token))

        def next(self) -> tuple[set[int], set[int]]:
            return ({5} if len(self.fed) < 2 else allowed), {end}

        def use_background_worker(self) -> bool:
            return True

    from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
    from exllamav2.generator import ExLlamaV2DynamicGenerator

    config = ExLlamaV2Config(str(tiny.hf_dir))
    config.max_seq_len = 512
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, max_seq_len=512, lazy=True)
    model.load_autosplit(cache)
    tok = ExLlamaV2Tokenizer(config)
    gen = ExLlamaV2DynamicGenerator(model=model, cache=cache, tokenizer=tok)
    for seed in range(8):
        f = Few(model, tok)
        job = ExLlamaV2DynamicJob(
            input_ids=tok.encode("x"),
            max_new_tokens=400,
            gen_settings=ExLlamaV2Sampler.Settings(temperature=1.0, top_k=0, top_p=0.0),
            seed=seed,
            filters=[f],
        )
        gen.enqueue(job)
        while gen.num_remaining_jobs():
            gen.iterate()
        last = [r for r in gen.fake_finished if r["job"] is job][-1]
        out = job.sequences[0].sequence_ids[len(job.sequences[0].input_ids) :]
        assert f.began and f.fed == out
        assert out[:2] == [5, 5] and set(out) <= allowed
        assert last["eos_reason"] == "end_filter" and out[-1] == end and out.count(end) == 1
    model.unload()


# ---- every format kind, enforced ----


def test_every_finished_output_validates_under_the_schema(engine: ExLlamaV2Engine) -> None:
    validator = jsonschema.Draft202012Validator(SCHEMA)
    finished = 0
    for seed in SEEDS:
        done = engine.generate("Order:", hot(response_format=SCHEMA, seed=seed, max_tokens=400))
        if done.finish_reason == "stop":
            finished += 1
            value = done.parsed()
            assert not list(validator.iter_errors(value)), done.text
            assert 3 <= value["n"] <= 9
    assert finished >= len(SEEDS) - 2, finished


def test_a_model_class_gives_its_instance(engine: ExLlamaV2Engine) -> None:
    got = [engine.generate("x", hot(response_format=Order, seed=s, max_tokens=300)) for s in range(8)]
    done = [d for d in got if d.finish_reason == "stop"]
    assert len(done) >= 6
    for d in done:
        order = d.parsed()
        assert isinstance(order, Order) and 1 <= len(order.items) <= 2


def test_regex_outputs_match_whole(engine: ExLlamaV2Engine) -> None:
    fmt = {"type": "regex", "pattern": REGEX}
    for seed in SEEDS:
        done = engine.generate("x", hot(response_format=fmt, seed=seed))
        assert done.finish_reason == "stop" and re.fullmatch(REGEX, done.text), done.text
        assert done.parsed() == done.text


def test_a_choice_is_one_of_the_choices(engine: ExLlamaV2Engine) -> None:
    fmt = {"type": "choice", "choices": CHOICES}
    seen = set()
    for seed in SEEDS:
        done = engine.generate("x", hot(response_format=fmt, seed=seed))
        assert done.finish_reason == "stop" and done.text in CHOICES, done.text
        seen.add(done.text)
    assert len(seen) > 1  # the model chose, the filter did not pick for it


def test_json_object_mode_gives_objects(engine: ExLlamaV2Engine) -> None:
    for seed in range(8):
        done = engine.generate("x", hot(response_format={"type": "json_object"}, seed=seed, max_tokens=300))
        if done.finish_reason == "stop":
            assert isinstance(done.parsed(), dict)


def test_a_stream_yields_the_same_constrained_text(engine: ExLlamaV2Engine) -> None:
    params = hot(response_format=SCHEMA, seed=3, max_tokens=400)
    assert "".join(c.text for c in engine.stream("x", params)) == engine.generate("x", params).text


def test_concurrent_jobs_each_keep_their_own_format(engine: ExLlamaV2Engine, exl: ModuleType) -> None:
    from exllamav2 import _fake

    formats: list[Any] = [
        SCHEMA,
        {"type": "regex", "pattern": REGEX},
        Order,
        {"type": "choice", "choices": CHOICES},
        None,
        {"type": "json_object"},
    ]
    gen = engine._generator
    start = len(gen.fake_batch_sizes)
    step, _fake.STEP_SECONDS = _fake.STEP_SECONDS, 0.002  # so that the callers meet in a batch
    try:

        async def run() -> list[Any]:
            return await asyncio.gather(
                *(
                    engine.agenerate("x", hot(response_format=f, seed=i, max_tokens=400))
                    for i, f in enumerate(formats)
                )
            )

        done = asyncio.run(run())
    finally:
        _fake.STEP_SECONDS = step
    assert max(gen.fake_batch_sizes[start:]) > 1  # the generator batched jobs under different formats
    for fmt, d in zip(formats, done, strict=True):
        if fmt is None or d.finish_reason != "stop":
            continue
        value = d.parsed()
        if fmt is SCHEMA:
            assert not list(jsonschema.Draft202012Validator(SCHEMA).iter_errors(value)), d.text
        elif fmt is Order:
            assert isinstance(value, Order)
        elif fmt.get("type") == "regex":
            assert re.fullmatch(REGEX, d.text)
        elif fmt.get("type") == "choice":
            assert d.text in CHOICES
        else:
            assert isinstance(value, dict)
    assert sum(d.finish_reason == "stop" for d in done[:4]) >= 3, [d.text for d in done]


def test_no_format_adds_no_filter(engine: ExLlamaV2Engine) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    before = len(engine._generator.fake_finished)
    engine.generate("x", greedy)
    assert all(not r["job"].filters for r in engine._generator.fake_finished[before:])


# ---- refused at the call ----


def test_a_schema_llguidance_cannot_compile_is_refused_at_the_call(engine: ExLlamaV2Engine) -> None:
    before = engine._generator.job_serial
    with pytest.raises(ConfigError, match="cannot be enforced"):
        engine.stream("x", response_format={"type": "object", "properties": {"a": {"$ref": "#/nope"}}})
    with pytest.raises(ConfigError) as err:  # in the words of every other engine
        engine.stream("x", response_format=UNENFORCEABLE)
    assert str(err.value) == REFUSAL
    assert engine._generator.job_serial == before  # no job was made


def test_logprobs_stay_refused_under_a_format(engine: ExLlamaV2Engine) -> None:
    """exllamav2's token probabilities are the filtered distribution's (1 for a forced token), not
    the model's; the backend reports none, so a format changes no logprob."""
    assert "logprobs" not in engine.capabilities.sampling
    with pytest.raises(UnsupportedParameter):
        engine.generate("x", response_format={"type": "json_object"}, logprobs=2)


def test_without_llguidance_a_format_is_unavailable_with_the_install_hint(
    tiny: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    with ExLlamaV2Engine(model=str(tiny.hf_dir), context_length=256) as e:
        monkeypatch.setitem(sys.modules, "llguidance", None)
        with pytest.raises(BackendUnavailable, match="llguidance") as info:
            e.generate("x", response_format={"type": "json_object"}, max_tokens=16)
        assert "pip install" in (info.value.install_hint or "")
        assert e.generate("x", max_tokens=4).text is not None  # plain requests still run


def test_the_filter_hands_sorted_lists_or_sets_to_exllamav2_before_0_2_1(engine: ExLlamaV2Engine) -> None:
    """exllamav2 >= 0.2.1 (``allow_return_type_list``) takes a sorted list as it is; before, sets."""
    (f,) = engine._formats.filters(output_format({"type": "choice", "choices": CHOICES}))
    f.begin("")
    pass_list, end_list = f.next()
    assert isinstance(pass_list, list) and pass_list == sorted(pass_list) and end_list == []
    f.allow_return_type_list = False
    pass_set, end_set = f.next()
    assert pass_set == set(pass_list) and end_set == set()
    for piece in ("maybe", " so"):
        for t in engine.tokenize(piece):
            f.feed(t)
    pass_tokens, end = f.next()
    assert set(pass_tokens) == set(end) == set(engine.eos_token_ids)  # complete: only the end


def test_formats_hold_with_a_draft_model(tiny: TinyModel) -> None:
    """Speculative decoding: the filter is asked at each drafted position and fed only the tokens
    kept, so a rejected draft never reaches it."""
    opts = {"draft_model": str(tiny.hf_dir)}
    with ExLlamaV2Engine(model=str(tiny.hf_dir), context_length=1024, options=opts) as e:
        validator = jsonschema.Draft202012Validator(SCHEMA)
        finished = 0
        for seed in range(8):
            done = e.generate("Order:", hot(response_format=SCHEMA, seed=seed, max_tokens=400))
            if done.finish_reason == "stop":
                finished += 1
                assert not list(validator.iter_errors(done.parsed())), done.text
        assert finished >= 6
        fmt = {"type": "regex", "pattern": REGEX}
        assert all(
            re.fullmatch(REGEX, e.generate("x", hot(response_format=fmt, seed=s)).text) for s in range(8)
        )


def test_a_required_tool_call_is_one_valid_call(tiny: TinyModel) -> None:
    """tool_choice "required" decodes under a response format: on ExLlamaV2, through the filter."""
    from tests.test_tools import HERMES, forced_calls

    with ExLlamaV2Engine(model=str(tiny.hf_dir), context_length=2048, chat_template=HERMES) as e:
        valid, finished = forced_calls(e, "required", range(8))
        assert valid == finished >= 6
        valid, finished = forced_calls(e, {"type": "function", "function": {"name": "add"}}, range(4))
        assert valid == finished >= 3
