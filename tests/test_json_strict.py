"""What unillm reads as JSON (tool call arguments, a structured output) is JSON, and what it
writes back is too: NaN and Infinity (which Python's reader takes) are not JSON; a number past a
double's range (1e999: JSON, read as inf) is written back as such a number, never as Infinity."""

from __future__ import annotations

import json
import math

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from unillm import StructuredOutputError, ToolCallParseError
from unillm._chat._tools import json_text, openai_tool_call, parse_tool_calls
from unillm._structured import output_format

CONSTANTS = ["NaN", "Infinity", "-Infinity"]


def _forms(arg: str) -> list[str]:
    """One call of ``add`` with ``{"x": arg}`` in each format the parser reads."""
    return [
        f'{{"name": "add", "arguments": {{"x": {arg}}}}}',
        f'<tool_call>\n{{"name": "add", "arguments": {{"x": {arg}}}}}\n</tool_call>',
        f'[TOOL_CALLS]add[ARGS]{{"x": {arg}}}',
        f'{{"name": "add", "arguments": "{{\\"x\\": {arg}}}"}}',
    ]


@pytest.mark.parametrize("constant", CONSTANTS)
def test_a_call_with_nan_or_infinity_is_no_call(constant: str) -> None:
    for text in _forms(constant):
        assert parse_tool_calls(text, ["add"]) == (text, ()), text
        with pytest.raises(ToolCallParseError) as err:
            parse_tool_calls(text, ["add"], forced=True)
        assert err.value.raw == text


@pytest.mark.parametrize(("number", "value"), [("1e999", math.inf), ("-1E+400", -math.inf)])
def test_a_number_past_a_double_is_read_and_written_back_as_json(number: str, value: float) -> None:
    for text in _forms(number):
        _, (call,) = parse_tool_calls(text, ["add"])
        assert call.arguments == {"x": value}
        wire = openai_tool_call(call)["function"]["arguments"]
        assert "Infinity" not in wire and json.loads(wire) == {"x": value}
    assert json_text({"a": [value, 1.5, "s"]}) == f'{{"a": [{"-" if value < 0 else ""}1e999, 1.5, "s"]}}'


@pytest.mark.parametrize("constant", CONSTANTS)
def test_a_structured_output_with_nan_or_infinity_is_not_json(constant: str) -> None:
    fmt = output_format({"type": "json_object"})
    assert fmt is not None
    with pytest.raises(StructuredOutputError) as err:
        fmt.parse(f'{{"x": {constant}}}', "stop")
    assert err.value.raw == f'{{"x": {constant}}}'
    assert fmt.parse('{"x": 1e999}', "stop") == {"x": math.inf}  # JSON, past a double


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='{}[]":,0123456789.eE+-naNIfity addrgumens ', max_size=80))
def test_whatever_parses_writes_back_as_json(body: str) -> None:
    text = '{"name": "add", "arguments": ' + body
    _, calls = parse_tool_calls(text, ["add"])
    for call in calls:
        wire = openai_tool_call(call)["function"]["arguments"]
        assert "Infinity" not in wire and "NaN" not in wire
        json.loads(wire)
