"""Structured output: reading ``response_format`` in every shape, parsing and validating what
came back, the one compiler's keyword table, and llama.cpp and MLX enforcing formats through
llguidance on the tiny model (the same refusal, word for word, on each; tests/test_vllm.py: vLLM).

The tiny model's weights are random, so at temperature 1 what it writes is noise: any output that
validates does so because the constraint made it, which is what these tests are about.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import hypothesis.strategies as st
import jsonschema
import pytest
from hypothesis import given, settings
from pydantic import BaseModel, Field

from unillm import ConfigError, EngineConfig, SamplingParams, UnsupportedParameter
from unillm._structured import StructuredOutputError, output_format, unenforced
from unillm.testing import TinyModel

ORDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["pickup", "delivery"]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{1,3}$"},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                    "qty": {"type": "integer"},
                    "price": {"type": "number"},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "gift": {"type": "boolean"},
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "pattern": "^[a-z ]{0,12}$"}]},
    },
    "required": ["kind", "code", "items", "gift", "note"],
    "additionalProperties": False,
}


JSON_OBJECT = {"type": "json_object"}

BOUNDED = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 3, "maximum": 9},
        "x": {"type": "integer", "minimum": -5, "maximum": 0},
    },
    "required": ["n", "x"],
    "additionalProperties": False,
}
#: a keyword no engine's constraint enforces: refused by every one in the same words
UNENFORCEABLE = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
REFUSAL = (
    'response_format cannot be enforced: Unimplemented keys: ["uniqueItems"]. unillm enforces the same '
    "JSON Schema keywords on every engine (docs/structured.md lists them): drop this one and check it "
    "after parsing"
)


class Item(BaseModel):
    sku: str = Field(pattern="^[a-z]{1,6}$")
    qty: int


class Order(BaseModel):
    kind: Literal["pickup", "delivery"]
    items: list[Item] = Field(min_length=1, max_length=2)
    gift: bool


# ---- reading response_format ----


def test_every_shape_reads_to_one_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    wrapped = output_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    bare = output_format(schema)
    assert wrapped is not None and bare is not None
    assert wrapped.json_schema == bare.json_schema == schema
    obj = output_format({"type": "json_object"})
    assert obj is not None and obj.kind == "json_object" and obj.schema is None
    model = output_format(Order)
    assert model is not None and model.model is Order
    assert model.json_schema == Order.model_json_schema()
    assert output_format({"type": "text"}) is None and output_format(None) is None
    assert SamplingParams(response_format={"type": "text"}).response_format is None


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ({"type": "json_schema"}, "needs"),
        ({"type": "json_schema", "json_schema": {"schema": "{}"}}, "needs"),
        ({"type": "jsonschema", "schema": {}}, "not one of"),
        ({"name": "x"}, "not a JSON schema"),
        ({"type": "object", "properties": {"a": {"type": "nope"}}}, "not valid JSON Schema"),
        ({"type": "object", "minProperties": -1}, "not valid JSON Schema"),
        ({"type": "object", "default": {1, 2}}, "not JSON"),
        ("{}", "a pydantic model class or a dict"),
        (int, "a pydantic model class or a dict"),
    ],
)
def test_a_format_that_cannot_be_read_is_a_config_error(value: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        SamplingParams(response_format=value)


def test_a_schema_too_deep_to_read_is_a_config_error_not_a_crash() -> None:
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ConfigError):
        SamplingParams(response_format=deep)


def test_ignore_eos_with_a_format_is_refused() -> None:
    with pytest.raises(ConfigError, match="ignore_eos cannot be combined"):
        SamplingParams(response_format={"type": "json_object"}, ignore_eos=True)


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
        max_leaves=12,
    )
)
def test_any_json_value_reads_or_is_a_config_error(value: Any) -> None:
    try:
        fmt = output_format(value)
    except ConfigError:
        return
    assert fmt is None or fmt.kind in ("json_schema", "json_object")


# ---- parsing and validating ----


def test_parse_returns_the_instance_or_the_value() -> None:
    order = output_format(Order)
    assert order is not None
    got = order.parse('{"kind": "pickup", "items": [{"sku": "ab", "qty": 2}], "gift": false}')
    assert isinstance(got, Order) and got.items[0].qty == 2
    fmt = output_format(ORDER_SCHEMA)
    assert fmt is not None
    text = '{"kind": "pickup", "code": "AB1", "items": [{"sku": "x", "qty": 1}], "gift": true, "note": null}'
    assert fmt.parse(text) == json.loads(text)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"kind": "pickup", "code": "AB1"', "not JSON"),
        ('{"kind": "boat", "code": "AB1", "items": [], "gift": true, "note": null}', "kind"),
        (
            '{"kind": "pickup", "code": "A1", "items": [{"sku": "x", "qty": 1}], "gift": 1, "note": null}',
            "gift",
        ),
        ("[1, 2]", "validate"),
    ],
)
def test_an_output_that_fails_raises_with_the_raw_text(text: str, says: str) -> None:
    fmt = output_format(ORDER_SCHEMA)
    assert fmt is not None
    with pytest.raises(StructuredOutputError, match=says) as err:
        fmt.parse(text, "length")
    assert err.value.raw == text and err.value.finish_reason == "length"
    assert "raise max_tokens" in str(err.value)


def test_json_object_mode_wants_an_object() -> None:
    fmt = output_format({"type": "json_object"})
    assert fmt is not None
    assert fmt.parse('{"a": [1]}') == {"a": [1]}
    with pytest.raises(StructuredOutputError, match="not an object"):
        fmt.parse("[1]")


def test_unenforced_names_each_keyword_and_where_it_is() -> None:
    found = unenforced(Order.model_json_schema() | {"minProperties": 1}, frozenset({"type", "properties"}))
    assert "/: minProperties" in found and "/: required" in found
    assert "/$defs/Item/properties/sku: pattern" in found
    assert unenforced(
        {"type": "string", "format": "email"}, frozenset({"type", "format"}), frozenset({"date"})
    ) == ["/: format 'email'"]


#: JSON Schema 2020-12's validation and applicator keywords, and format: each has its row in the docs
KEYWORDS_2020_12 = frozenset(
    {"type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum"}
    | {"maxLength", "minLength", "pattern", "maxItems", "minItems", "uniqueItems", "maxContains"}
    | {"minContains", "maxProperties", "minProperties", "required", "dependentRequired", "prefixItems"}
    | {"items", "contains", "additionalProperties", "properties", "patternProperties", "dependentSchemas"}
    | {"propertyNames", "if", "then", "else", "allOf", "anyOf", "oneOf", "not", "unevaluatedItems"}
    | {"unevaluatedProperties", "format", "$ref", "$defs"}
)


def test_the_keyword_table_in_the_docs_is_what_the_one_compiler_does() -> None:
    from unillm.backend.llguidance import check

    text = (Path(__file__).resolve().parent.parent / "docs" / "structured.md").read_text()
    rows = re.findall(r"^\| `(.+?)` \| `(\{.*\})` \| (enforced|refused) \|$", text, re.MULTILINE)
    named = {k for keyword, _, _ in rows for k in keyword.split("` / `")}
    assert named == KEYWORDS_2020_12, named ^ KEYWORDS_2020_12
    for keyword, example, verdict in rows:
        fmt = output_format(json.loads(example))
        assert fmt is not None
        if verdict == "enforced":
            check(fmt)
        else:
            with pytest.raises(ConfigError, match="cannot be enforced: Unimplemented keys") as err:
                check(fmt)
            assert f'"{keyword.split("` / `")[0]}"' in str(err.value), (keyword, err.value)


def test_unillm_closes_object_schemas_that_do_not_say_otherwise() -> None:
    from unillm.backend.llguidance import closed

    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {}}}, "c": {"type": "object"}},
        "$defs": {
            "d": {"patternProperties": {"^x": {}}},
            "e": {"properties": {}, "additionalProperties": True},
        },
        "anyOf": [{"properties": {"f": {}}}],
    }
    got = closed(schema)
    assert got["additionalProperties"] is False
    assert got["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in got["properties"]["c"]  # no properties listed: any object
    assert got["$defs"]["d"]["additionalProperties"] is False
    assert got["$defs"]["e"]["additionalProperties"] is True  # what the schema says is kept
    assert got["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is not touched


# ---- llama.cpp: llguidance's mask at the head of the sampler chain ----


@pytest.fixture(scope="module")
def llama(tiny: TinyModel) -> Iterator[Any]:
    pytest.importorskip("llama_cpp")
    from unillm.engines.llamacpp import LlamaCppEngine

    with LlamaCppEngine(model=str(tiny.gguf_path), context_length=1024, options={"n_threads": 1}) as engine:
        yield engine


def test_every_finished_output_validates_over_many_seeds(llama: Any) -> None:
    validator = jsonschema.Draft202012Validator(ORDER_SCHEMA)
    finished = 0
    for seed in range(40):
        done = llama.generate(
            "Order:", temperature=1.0, seed=seed, max_tokens=400, response_format=ORDER_SCHEMA
        )
        if done.finish_reason == "length":
            with pytest.raises(StructuredOutputError) as err:
                done.parsed()
            assert err.value.raw == done.text
            continue
        finished += 1
        value = done.parsed()
        assert not list(validator.iter_errors(value)), done.text
        assert set(value) == {"kind", "code", "items", "gift", "note"}
    assert finished >= 36, f"only {finished} of 40 outputs finished within 400 tokens"


def test_a_model_class_gives_its_instance(llama: Any) -> None:
    for seed in range(12):
        done = llama.chat(
            [{"role": "user", "content": "An order, please."}],
            temperature=1.0,
            seed=seed,
            max_tokens=300,
            response_format=Order,
        )
        if done.finish_reason == "stop":
            order = done.parsed()
            assert isinstance(order, Order) and 1 <= len(order.items) <= 2


def test_json_object_mode_gives_objects(llama: Any) -> None:
    objects = 0
    for seed in range(12):
        done = llama.generate(
            "{", temperature=1.0, seed=seed, max_tokens=200, response_format={"type": "json_object"}
        )
        if done.finish_reason == "stop":
            assert isinstance(done.parsed(), dict)
            objects += 1
    assert objects >= 1  # unbounded strings may run to max_tokens; the ones that end are objects


def test_strings_never_hold_control_characters(llama: Any) -> None:
    # JSON forbids them (json.loads refuses them); llama-cpp-python's grammar converter let them through
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 24}}, "required": ["s"]}
    for seed in range(20):
        done = llama.generate("x", temperature=1.0, seed=seed, max_tokens=120, response_format=schema)
        assert done.finish_reason == "stop", done.text
        json.loads(done.text)  # strict: a raw control character in a string fails (escaped is fine)
        if "\ufffd" not in done.text:  # invalid UTF-8 bytes count differently (see docs)
            assert len(done.parsed()["s"]) <= 24


def test_a_stream_yields_the_same_constrained_text(llama: Any) -> None:
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=300, response_format=ORDER_SCHEMA)
    streamed = "".join(c.text for c in llama.stream("Order:", params))
    assert streamed == llama.generate("Order:", params).text
    assert output_format(ORDER_SCHEMA) is not None


def test_numeric_bounds_hold_at_temperature_1(llama: Any) -> None:
    # llama.cpp's own grammar converter refused minimum/maximum; through llguidance they hold
    for seed in range(8):
        done = llama.generate("n:", response_format=BOUNDED, temperature=1.0, seed=seed, max_tokens=60)
        value = done.parsed()
        assert 3 <= value["n"] <= 9 and -5 <= value["x"] <= 0, done.text


def test_a_format_that_cannot_be_enforced_is_refused_at_the_call(llama: Any) -> None:
    with pytest.raises(ConfigError) as err:
        llama.generate("x", response_format=UNENFORCEABLE)  # generate, not the first token of a stream
    assert str(err.value) == REFUSAL
    with pytest.raises(ConfigError, match="Unknown format"):
        llama.stream("x", response_format={"type": "string", "format": "colour"})


def test_a_backend_without_it_refuses_whatever_the_policy(tiny: TinyModel) -> None:
    from unillm.testing import MockEngine

    class NoFormats(MockEngine):
        capabilities = dataclasses.replace(MockEngine.capabilities, sampling=frozenset({"max_tokens"}))

    with NoFormats("ok", EngineConfig(model=str(tiny.hf_dir), unsupported_params="drop")) as engine:
        assert engine.generate("x", max_tokens=3, top_p=0.5).text  # dropped, as the policy says
        with pytest.raises(UnsupportedParameter, match="never ignored"):
            engine.generate("x", response_format={"type": "json_object"})


# ---- MLX: llguidance's matcher limits the sampler ----


@pytest.fixture(scope="module", params=[1, 4], ids=["mlx", "mlx-batched"])
def mlx(request: pytest.FixtureRequest, tiny: TinyModel) -> Iterator[Any]:
    pytest.importorskip("mlx_lm")
    pytest.importorskip("llguidance")
    from unillm.engines.mlx import MLXEngine

    opts = {"batch_size": request.param}
    with MLXEngine(model=str(tiny.hf_dir), context_length=1024, options=opts) as engine:
        yield engine


def test_mlx_every_finished_output_validates(mlx: Any) -> None:
    validator = jsonschema.Draft202012Validator(ORDER_SCHEMA)
    finished = 0
    for seed in range(10):
        done = mlx.generate(
            "Order:", response_format=ORDER_SCHEMA, temperature=1.0, seed=seed, max_tokens=300
        )
        if done.finish_reason == "stop":
            finished += 1
            assert not list(validator.iter_errors(done.parsed())), done.text
    assert finished >= 8, finished
    for seed in range(6):  # numeric bounds, which llama.cpp's grammar refuses
        value = mlx.generate(
            "n:", response_format=BOUNDED, temperature=1.0, seed=seed, max_tokens=60
        ).parsed()
        assert 3 <= value["n"] <= 9 and value["x"] <= 0


def test_mlx_concurrent_requests_each_keep_their_own_format(mlx: Any) -> None:
    formats: list[Any] = [ORDER_SCHEMA, BOUNDED, Order, JSON_OBJECT]

    async def run() -> list[Any]:
        return await asyncio.gather(
            *(
                mlx.agenerate("x", response_format=f, temperature=1.0, seed=i, max_tokens=300)
                for i, f in enumerate(formats)
            )
        )

    done = asyncio.run(run())
    for fmt, d in zip(formats, done, strict=True):
        if d.finish_reason == "stop":
            value = d.parsed()
            if isinstance(fmt, dict) and fmt is not JSON_OBJECT:
                assert not list(jsonschema.Draft202012Validator(fmt).iter_errors(value)), d.text
    assert sum(d.finish_reason == "stop" for d in done) >= 2, [d.text for d in done]


def test_mlx_refuses_what_llama_cpp_refuses_in_the_same_words(mlx: Any) -> None:
    with pytest.raises(ConfigError) as err:
        mlx.stream("x", response_format=UNENFORCEABLE)
    assert str(err.value) == REFUSAL
    with pytest.raises(ConfigError, match="cannot be enforced"):
        mlx.stream("x", response_format={"type": "object", "properties": {"a": {"$ref": "#/nope"}}})
