"""Tool calling: reading tools and tool_choice, parsing the formats real templates make models write,
and a forced call on real engines (llama.cpp, MLX, vLLM) on the tiny model, through the chat template
and through ``unillm serve`` with the official openai client.

The tiny model's weights are random: at temperature 1 it writes noise, so a forced call that
validates does so because the constraint made it. Its ChatML template does not render tools, so
these tests give the engines a variant with a Hermes-style tools block (``HERMES``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import jsonschema
import pytest
from hypothesis import given, settings

from unillm import ConfigError, InvalidTools, ToolCall, ToolCallParseError, UnsupportedParameter
from unillm._chat import _tools
from unillm._chat._tools import parse_tool_calls, read_tools
from unillm._types import Capabilities, ChatMessage, SamplingParams
from unillm.testing import MockEngine, TinyModel

from ._server_util import Server, start_server
from .conftest import HAS_LLAMA_CPP

# ChatML with Qwen 2.5's tools block, tool calls and tool responses (trimmed).
HERMES = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and tools %}"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- elif message.tool_calls is defined %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for call in message.tool_calls %}<tool_call>\n"
    '{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}\n'
    "</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city over the next days.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
                "days": {"type": "integer"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "days", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "terms": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
                "note": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/Note"}]},
            },
            "required": ["terms", "note"],
            "additionalProperties": False,
            "$defs": {
                "Note": {
                    "type": "object",
                    "properties": {"text": {"type": "string", "pattern": "^[a-z ]{0,8}$"}},
                    "required": ["text"],
                    "additionalProperties": False,
                }
            },
        },
    },
}
TOOLS = [WEATHER, ADD]
NAMES = ("get_weather", "add")
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def schema_of(name: str) -> dict[str, Any]:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)  # type: ignore[index,return-value]


def assert_valid(call: ToolCall) -> None:
    assert call.name in NAMES and call.id.startswith("call_") and len(call.id) == 29
    jsonschema.Draft202012Validator(schema_of(call.name)).validate(call.arguments)


# ---- the parser, one table per format ----


PARSED: list[tuple[str, str, str, list[tuple[str, dict[str, Any]]]]] = [
    # (format, what the model wrote, the content left, the calls)
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', "", [("add", {"a": 1})]),
    (
        "hermes",
        'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": {}}</tool_call>',
        "Let me check.",
        [("get_weather", {"city": "Paris"}), ("add", {})],
    ),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1}}', "", [("add", {"a": 1})]),  # no close
    (
        "hermes",
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}</tool_call>',
        "",
        [("add", {"a": 2})],
    ),
    ("llama3.1", '<|python_tag|>{"name": "add", "parameters": {"a": 1}}', "", [("add", {"a": 1})]),
    ("llama3.1", '{"name": "add", "parameters": {"a": 1}}', "", [("add", {"a": 1})]),
    (
        "llama3.1",
        '{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}',
        "",
        [("add", {"a": 1}), ("get_weather", {"city": "Oslo"})],
    ),
    ("llama3.2", '[{"name": "add", "parameters": {"a": 1}}]', "", [("add", {"a": 1})]),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]', "", [("add", {"a": 1})]),
    (
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"a": 2}}]',
        "Sure.",
        [("add", {"a": 1}), ("add", {"a": 2})],
    ),
    ("mistral-v11", '[TOOL_CALLS]add[ARGS]{"a": 1}', "", [("add", {"a": 1})]),
    ("constrained", '{"arguments" :{"a" :97},"name" : "add"}', "", [("add", {"a": 97})]),
]

NOT_CALLS = [
    "The weather is fine.",
    '{"name": "rm_rf", "arguments": {}}',  # not a tool that was offered
    '{"name": "add", "arguments": [1, 2]}',  # arguments not an object
    '{"name": "add"} and then some words',
    "<tool_call>not json</tool_call>",
    "[TOOL_CALLS]",
    "<|python_tag|>print('hi')",
    "[" * 100_000,  # deeper than json reads
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), PARSED, ids=[p[0] for p in PARSED])
def test_each_format_parses(
    fmt: str, text: str, content: str, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    got_content, got = parse_tool_calls(text, NAMES)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("text", NOT_CALLS, ids=range(len(NOT_CALLS)))
def test_what_is_not_a_call_stays_text(text: str) -> None:
    assert parse_tool_calls(text, NAMES) == (text, ())
    with pytest.raises(ToolCallParseError) as err:
        parse_tool_calls(text, NAMES, forced=True, finish_reason="length")
    assert err.value.raw == text and "max_tokens" in str(err.value)


_MARKERS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", '{"name": "add"']
_PIECES = st.sampled_from(
    [
        *_MARKERS,
        '"arguments"',
        '"parameters"',
        ": {",
        "}",
        "[",
        "]",
        ";",
        ",",
        '"',
        "\\",
        "add",
        "\n",
        "1e999",
    ]
)


@dataclass
class Scans:
    """The scans the parser makes over its text, counted rather than timed: each JSON decode
    (``_DECODER.raw_decode``) and each pass of the Hermes pattern, the characters each could look
    at (a decode, what it read, or all the rest of its text when it fails; a pass, its whole text),
    and the characters the pattern's matches span."""

    passes: int = 0
    chars: int = 0
    matched: int = 0


#: how many times over the parser's scans may cover its text: the Hermes pass, the tags' bodies and
#: the ``sub``, the text after ``[TOOL_CALLS]``, the whole text as JSON, and the arguments given as
#: strings in each of the three readings, cover it once each (seven in all; a scan per tag or per
#: nesting level would cover it as many times as there are tags, quadratic)
_SCANS_PER_CHAR = 8


@contextlib.contextmanager
def counting_scans() -> Iterator[Scans]:
    """The ``Scans`` of the parser inside the block (the real decoder and pattern, wrapped)."""
    scans = Scans()
    decoder, hermes = _tools._DECODER, _tools._HERMES

    class Decoder:
        def raw_decode(self, text: str, at: int = 0) -> tuple[Any, int]:
            scans.passes += 1
            try:
                value, end = decoder.raw_decode(text, at)
            except BaseException:  # ValueError, or RecursionError on deep nesting
                scans.chars += len(text) - at
                raise
            scans.chars += end - at
            return value, end

    class Hermes:
        def finditer(self, text: str) -> Iterator[re.Match[str]]:
            scans.passes, scans.chars = scans.passes + 1, scans.chars + len(text)
            for match in hermes.finditer(text):
                scans.matched += match.end() - match.start()
                yield match

        def sub(self, repl: str, text: str) -> str:
            scans.passes, scans.chars = scans.passes + 1, scans.chars + len(text)
            return hermes.sub(repl, text)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_tools, "_DECODER", Decoder())
        mp.setattr(_tools, "_HERMES", Hermes())
        yield scans


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(_PIECES, st.text(max_size=8)), max_size=40), st.booleans())
def test_the_parser_never_raises_but_its_own_error(pieces: list[str], forced: bool) -> None:
    text = "".join(pieces)
    with counting_scans() as scans:
        try:
            content, calls = parse_tool_calls(text, NAMES, forced=forced)
        except ToolCallParseError as exc:
            assert forced and exc.raw == text
        else:
            assert isinstance(content, str) and all(c.name in NAMES for c in calls)
    assert scans.chars <= _SCANS_PER_CHAR * len(text), scans


def test_the_parser_is_linear_on_hostile_text() -> None:
    """Each character scanned a bounded number of times, however many tags open: four times the
    text, four times the scanning, in as many passes (none per tag or per nesting level)."""
    for piece, end in (("<tool_call>", ""), ("[TOOL_CALLS]", "[ARGS]"), ('{"a":', "")):
        counted = []
        for n in (50_000, 200_000):
            text = piece * n + end
            with counting_scans() as scans:
                parse_tool_calls(text, NAMES)
            assert scans.chars <= _SCANS_PER_CHAR * len(text), (piece, n, scans)
            if piece == "<tool_call>":
                # the first tag, left open, matches to the end (the pattern's \Z): the pattern is
                # not tried again at each later tag, each time to the end
                assert scans.matched == len(text), scans
            counted.append(scans)
        small, large = counted
        assert large.passes == small.passes and large.chars <= 4 * small.chars + 64, (piece, counted)


# ---- reading tools and tool_choice ----


@pytest.mark.parametrize(
    ("tools", "choice", "field"),
    [
        ("get_weather", None, "tools"),
        ([{"type": "retrieval"}], None, "tools[0]"),
        ([{"type": "function"}], None, "tools[0].function"),
        ([{"type": "function", "function": {"name": 'say "hi"'}}], None, "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "x" * 65}}], None, "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None,
         "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}],
         None, "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "f", "description": 3}}], None,
         "tools[0].function.description"),
        ([{"type": "function", "function": {"name": "f", "strange": 1}}], None, "tools[0].function"),
        ([WEATHER, WEATHER], None, "tools"),
        ([WEATHER] * 129, None, "tools"),
        (TOOLS, "sometimes", "tool_choice"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (TOOLS, {"type": "function"}, "tool_choice"),
        (None, "required", "tool_choice"),
    ],
)  # fmt: skip
def test_bad_tools_are_typed_errors_naming_the_field(tools: Any, choice: Any, field: str) -> None:
    with pytest.raises(InvalidTools) as err:
        read_tools(tools, choice)
    assert (
        isinstance(err.value, ConfigError) and err.value.field == field and str(err.value).startswith(field)
    )


def test_tool_choice_reads() -> None:
    assert read_tools(None) is None and read_tools([], "auto") is None
    assert read_tools(TOOLS, "none") is None  # plain chat
    auto = read_tools(TOOLS)
    assert auto is not None and auto.choice == "auto" and not auto.forced and auto.names == NAMES
    named = read_tools(TOOLS, {"type": "function", "function": {"name": "add"}})
    assert named is not None and named.forced and named.choice == "add"
    schema = named.call_schema()
    assert schema["properties"]["name"] == {"const": "add"} and "t1.Note" in schema["$defs"]


def test_the_call_schema_accepts_exactly_the_calls_of_the_tools() -> None:
    spec = read_tools(TOOLS, "required")
    assert spec is not None
    validator = jsonschema.Draft202012Validator(spec.call_schema())
    good = [
        {"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "unit": "celsius"}},
        {"name": "add", "arguments": {"terms": [1], "note": {"text": "hi"}}},
        {"name": "add", "arguments": {"terms": [1, 2], "note": None}},
    ]
    bad = [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "add", "arguments": {"terms": [1], "note": {"text": 1}}},
        {"name": "rm", "arguments": {}},
        {"name": "add", "arguments": {"terms": [1], "note": None}, "extra": 1},
    ]
    assert all(validator.is_valid(v) for v in good)
    assert not any(validator.is_valid(v) for v in bad)


def test_messages_carry_tool_calls_and_tool_results() -> None:
    call = ToolCall("add", {"a": 1}, "call_1")
    m = ChatMessage.coerce(
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 1}'}}]}
    )  # fmt: skip
    assert m == ChatMessage("assistant", "", (call,))
    assert ChatMessage.coerce({"role": "assistant", "tool_calls": [call]}).tool_calls == (call,)
    assert (
        ChatMessage.coerce({"role": "tool", "content": "2", "tool_call_id": "call_1"}).tool_call_id
        == "call_1"
    )
    for bad in (
        {"role": "user", "content": "x", "tool_calls": [call]},
        {"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "{not json"}}]},
        {"role": "assistant", "tool_calls": "add"},
        {"role": "tool", "content": "2", "tool_call_id": 7},
    ):
        with pytest.raises(ConfigError):
            ChatMessage.coerce(bad)


# ---- through an engine: the template, the parse, the refusals (the mock engine) ----


def mock(reply: str, **kwargs: Any) -> MockEngine:
    return MockEngine(reply, chat_template=HERMES, **kwargs).load()


def test_a_reply_with_calls_finishes_with_them_streamed_or_not() -> None:
    reply = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    engine = mock(reply)
    done = engine.chat(ASK, tools=TOOLS)
    assert done.finish_reason == "tool_calls" and done.text == reply
    assert [(c.name, c.arguments) for c in done.tool_calls] == [("get_weather", {"city": "Oslo"})]
    chunks = list(engine.stream_chat(ASK, tools=TOOLS))
    assert all(not c.tool_calls for c in chunks[:-1]) and chunks[-1].finish_reason == "tool_calls"
    assert "".join(c.text for c in chunks) == reply
    adone = asyncio.run(engine.achat(ASK, tools=TOOLS))
    assert adone.finish_reason == "tool_calls" and adone.tool_calls[0].arguments == {"city": "Oslo"}
    plain = engine.chat(ASK)  # no tools: nothing parsed
    assert plain.finish_reason == "stop" and plain.tool_calls == ()


def test_tools_are_rendered_and_none_is_plain_chat() -> None:
    engine = mock("hi")
    prompt = engine.render_chat(ASK, tools=TOOLS)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    engine.chat(ASK, tools=TOOLS, tool_choice="none")
    engine.chat(ASK)
    assert engine.requests[-1] == engine.requests[-2] and "<tools>" not in engine.requests[-1]


def test_a_backend_that_renders_its_own_way_renders_the_tools_too() -> None:
    class Own(MockEngine):  # vLLM renders through its tokenizer's apply_chat_template
        def render_chat(self, messages: Any, *, add_generation_prompt: bool = True, tools: Any = None) -> str:
            return f"own rendering of {len(tools or ())} tools"

    engine = Own("hi", chat_template=HERMES).load()
    engine.chat(ASK, tools=TOOLS)
    engine.chat(ASK, tools=TOOLS, tool_choice="none")
    assert engine.requests[-2:] == ["own rendering of 2 tools", "own rendering of 0 tools"]


def test_a_template_without_tools_is_a_clear_error(tiny: TinyModel) -> None:
    engine = MockEngine("hi").load()  # its template reads no tools variable
    with pytest.raises(InvalidTools, match="does not render tools") as err:
        engine.chat(ASK, tools=TOOLS)
    assert err.value.field == "tools"
    assert engine.chat(ASK, tools=TOOLS, tool_choice="none").text == "hi"


def test_a_forced_call_needs_constrained_decoding() -> None:
    engine = mock("hi", capabilities=Capabilities())  # no response_format
    with pytest.raises(UnsupportedParameter, match="tool_choice") as err:
        engine.chat(ASK, tools=TOOLS, tool_choice="required")
    assert err.value.params == ["tool_choice"]
    assert engine.chat(ASK, tools=TOOLS).finish_reason == "stop"  # auto still works
    full = mock("{}")
    with pytest.raises(InvalidTools, match="response_format"):
        full.chat(ASK, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})


def test_a_forced_call_is_asked_of_the_engine_as_its_schema() -> None:
    seen: list[SamplingParams] = []

    def respond(prompt: str, params: SamplingParams) -> str:
        seen.append(params)
        return '{"name": "add", "arguments": {"terms": [1], "note": null}}'

    engine = MockEngine(respond, chat_template=HERMES).load()
    done = engine.chat(ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    fmt = seen[-1].output_format
    assert fmt is not None and fmt.json_schema["properties"]["name"] == {"const": "add"}
    assert done.finish_reason == "tool_calls" and done.tool_calls[0].arguments == {"terms": [1], "note": None}
    cut = MockEngine('{"name": "add", "argu', chat_template=HERMES).load()
    with pytest.raises(ToolCallParseError) as err:
        cut.chat(ASK, tools=TOOLS, tool_choice="required")
    assert err.value.raw == '{"name": "add", "argu'


def test_a_follow_up_renders_the_call_and_its_result_through_the_template() -> None:
    engine = mock("It is sunny.")
    call = ToolCall("get_weather", {"city": "Oslo", "days": 1, "unit": "celsius"})
    follow = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'},
    ]
    prompt = engine.render_chat(follow, tools=TOOLS)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1, "unit": "celsius"}}'
        in prompt
    )
    assert '<tool_response>\n{"sky": "clear"}\n</tool_response>' in prompt
    assert engine.chat(follow, tools=TOOLS).text == "It is sunny."


# ---- real engines: llguidance on llama.cpp, MLX and vLLM ----


@pytest.fixture(scope="module")
def llama(tiny: TinyModel) -> Iterator[Any]:
    pytest.importorskip("llama_cpp")
    from unillm.engines.llamacpp import LlamaCppEngine

    opts = {"n_threads": 1}
    with LlamaCppEngine(
        model=str(tiny.gguf_path), context_length=4096, chat_template=HERMES, options=opts
    ) as e:
        yield e


def forced_calls(engine: Any, choice: Any, seeds: range, tools: list[Any] = TOOLS) -> tuple[int, int]:
    """(valid calls, finished outputs) over ``seeds`` at temperature 1."""
    valid = finished = 0
    for seed in seeds:
        try:
            done = engine.chat(
                ASK, tools=tools, tool_choice=choice, temperature=1.0, seed=seed, max_tokens=300
            )
        except ToolCallParseError as exc:
            assert exc.finish_reason == "length"
            continue
        finished += 1
        assert done.finish_reason == "tool_calls" and len(done.tool_calls) == 1
        call = done.tool_calls[0]
        if isinstance(choice, dict):
            assert call.name == choice["function"]["name"]
        if call.name in NAMES:
            assert_valid(call)
        valid += 1
    return valid, finished


def test_llamacpp_every_forced_call_is_valid(llama: Any) -> None:
    valid, finished = forced_calls(llama, "required", range(16))
    assert valid == finished >= 14
    valid, finished = forced_calls(llama, {"type": "function", "function": {"name": "get_weather"}}, range(8))
    assert valid == finished >= 7


def test_llamacpp_none_is_plain_chat_and_auto_parses(llama: Any) -> None:
    greedy = {"temperature": 0.0, "max_tokens": 12}
    assert llama.chat(ASK, tools=TOOLS, tool_choice="none", **greedy).text == llama.chat(ASK, **greedy).text
    done = llama.chat(ASK, tools=TOOLS, **greedy)  # noise from random weights: no call in it
    assert done.tool_calls == () and done.finish_reason in ("stop", "length")


def test_llamacpp_streams_and_follows_up(llama: Any) -> None:
    chunks = list(llama.stream_chat(ASK, tools=TOOLS, tool_choice="required", seed=3, max_tokens=300))
    last = chunks[-1]
    assert last.finish_reason == "tool_calls" and len(last.tool_calls) == 1
    assert_valid(last.tool_calls[0])
    follow = [*ASK, {"role": "assistant", "tool_calls": list(last.tool_calls)},
              {"role": "tool", "tool_call_id": last.tool_calls[0].id, "content": "sunny"}]  # fmt: skip
    assert llama.chat(follow, tools=TOOLS, max_tokens=4).usage.completion_tokens >= 1
    done = asyncio.run(llama.achat(ASK, tools=TOOLS, tool_choice="required", seed=3, max_tokens=300))
    assert done.tool_calls[0].name == last.tool_calls[0].name  # the same seed, the same call


NAMES_ONLY = (  # tools as a list of names: 100 tools' schemas would not fit the tiny context
    "{% for t in tools %}{{ t.function.name }} {% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)


def test_llamacpp_hostile_tools(llama: Any, tiny: TinyModel) -> None:
    from unillm.engines.llamacpp import LlamaCppEngine

    many = [
        {"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object",
         "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}}}
        for i in range(100)
    ]  # fmt: skip
    opts = {"n_threads": 1}
    with LlamaCppEngine(model=str(tiny.gguf_path), chat_template=NAMES_ONLY, options=opts) as short:
        for seed in range(3):
            done = short.chat(ASK, tools=many, tool_choice="required", seed=seed, max_tokens=100)
            (call,) = done.tool_calls
            assert call.name in {f"tool_{i}" for i in range(100)} and set(call.arguments) == {"x"}
    unique = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
              "properties": {"n": {"type": "array", "uniqueItems": True}}}}}  # fmt: skip
    with pytest.raises(ConfigError, match="uniqueItems"):  # no engine enforces it: refused
        llama.chat(ASK, tools=[unique], tool_choice="required")
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
              "properties": {"n": {"$ref": "#/$defs/Missing"}}}}}  # fmt: skip
    with pytest.raises(ConfigError):
        llama.chat(ASK, tools=[broken], tool_choice="required")
    with pytest.raises(InvalidTools, match=r"function\.name"):
        llama.chat(
            ASK, tools=[{"type": "function", "function": {"name": '"}; drop'}}], tool_choice="required"
        )


@pytest.fixture(scope="module")
def mlx(tiny: TinyModel) -> Iterator[Any]:
    pytest.importorskip("mlx_lm")
    pytest.importorskip("llguidance")
    from unillm.engines.mlx import MLXEngine

    with MLXEngine(model=str(tiny.hf_dir), context_length=2048, chat_template=HERMES) as engine:
        yield engine


def test_mlx_every_forced_call_is_valid(mlx: Any) -> None:
    valid, finished = forced_calls(mlx, "required", range(6))
    assert valid == finished >= 5
    valid, finished = forced_calls(mlx, {"type": "function", "function": {"name": "add"}}, range(4))
    assert valid == finished >= 3


@pytest.fixture
def vllm(vllm_engine: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The session's shared vLLM engine (tests/conftest.py), with the Hermes template for this
    test only: the engine reads ``config.chat_template`` at each call."""
    hermes = vllm_engine.config.model_copy(update={"chat_template": HERMES})
    monkeypatch.setattr(vllm_engine, "config", hermes)
    return vllm_engine


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_every_forced_call_is_valid(vllm: Any) -> None:
    # vLLM's default grammar admits JSON's free whitespace, which random weights write until
    # max_tokens (with it, 6 of these 8 calls and 3 of the 4 named ones finished); unillm asks vLLM
    # for compact JSON, as MLX's and ExLlamaV2's llguidance write
    valid, finished = forced_calls(vllm, "required", range(8))
    assert valid == finished >= 7
    valid, finished = forced_calls(vllm, {"type": "function", "function": {"name": "add"}}, range(4))
    assert valid == finished >= 3


# ---- unillm serve, with the official openai client ----


def start_tool_server(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    """``unillm serve`` on llama.cpp: the tiny GGUF as ``tiny``, under the Hermes template
    (which renders tools)."""
    if not HAS_LLAMA_CPP:
        pytest.skip("llama-cpp-python is not installed")
    config = tmp_path_factory.mktemp("serve") / "server.toml"
    config.write_text(
        f'[models.tiny]\nmodel = "{tiny_gguf}"\nbackend = "llama.cpp"\ncontext_length = 4096\n'
        f"chat_template = '''{HERMES}'''\n",
        encoding="utf-8",
    )
    return start_server(["--config", str(config)])


@pytest.fixture(scope="module")
def served(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    import openai

    server = start_tool_server(tiny_gguf, tmp_path_factory)
    yield openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)
    server.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_served_tool_calls_in_openais_shape(served: Any, stream: bool) -> None:
    kwargs = {"model": "tiny", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "seed": 2,
              "max_tokens": 300}  # fmt: skip
    if not stream:
        done = served.chat.completions.create(**kwargs)
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls
    else:
        events = list(served.chat.completions.create(**kwargs, stream=True))
        finishes = [e.choices[0].finish_reason for e in events if e.choices]
        assert finishes[-1] == "tool_calls"
        calls = [d for e in events if e.choices for d in (e.choices[0].delta.tool_calls or ())]
    assert len(calls) == 1 and calls[0].id.startswith("call_") and calls[0].type in ("function", None)
    call = ToolCall(calls[0].function.name, json.loads(calls[0].function.arguments))
    assert_valid(call)
    follow = [*ASK, {"role": "assistant", "tool_calls": [{"id": calls[0].id, "type": "function",
              "function": {"name": call.name, "arguments": calls[0].function.arguments}}]},
              {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}]  # fmt: skip
    again = served.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, max_tokens=4)
    assert again.choices[0].finish_reason in ("stop", "length")


def test_served_refusals_name_the_field(served: Any) -> None:
    import openai

    for kwargs, param in [
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            served.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, **kwargs)
        assert err.value.body["param"] == param  # type: ignore[index]


def test_a_backend_overriding_stream_chat_as_before_tools_still_chats() -> None:
    # a plugin written before tools existed: stream_chat(messages, params, **overrides)
    from unillm.testing import MockEngine

    class OldStyle(MockEngine):
        def stream_chat(self, messages: Any, params: Any = None, **overrides: Any) -> Any:
            assert "tools" not in overrides and "tool_choice" not in overrides
            return self.stream("old style", params, **overrides)

    with OldStyle(lambda p, s: "fine") as engine:
        assert engine.chat([{"role": "user", "content": "hi"}]).text == "fine"
