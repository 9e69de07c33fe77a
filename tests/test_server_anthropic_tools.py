"""Anthropic's tool use on ``/v1/messages``, spoken to by the official ``anthropic`` client, on
``unillm serve`` over llama.cpp with a template that renders tools (the tiny model's random
weights: a forced call validates because the constraint made it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from .test_tools import TOOLS, start_tool_server

anthropic = pytest.importorskip("anthropic")

#: the same tools as test_tools', in Anthropic's shape
ANT_TOOLS = [
    {"name": t["function"]["name"], "description": t["function"].get("description", ""),
     "input_schema": t["function"]["parameters"]}
    for t in TOOLS
]  # fmt: skip
SCHEMAS = {t["name"]: t["input_schema"] for t in ANT_TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def ant(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    server = start_tool_server(tiny_gguf, tmp_path_factory)
    yield anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    server.stop()


def _valid(block: Any) -> None:
    assert block.type == "tool_use" and block.id.startswith("toolu_") and block.name in SCHEMAS
    jsonschema.Draft202012Validator(SCHEMAS[block.name]).validate(block.input)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "add"}], ids=["any", "named"])
def test_a_forced_call_comes_back_as_a_tool_use_block(ant: Any, choice: dict[str, Any]) -> None:
    reply = ant.messages.create(
        model="tiny", max_tokens=300, messages=ASK, tools=ANT_TOOLS, tool_choice=choice
    )
    assert reply.stop_reason == "tool_use"
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert len(uses) == 1
    _valid(uses[0])
    if choice["type"] == "tool":
        assert uses[0].name == "add"
    # the round trip: the call and its result render back through the template
    follow = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"},
                                     {"type": "text", "text": "And tomorrow?"}]},
    ]  # fmt: skip
    again = ant.messages.create(model="tiny", max_tokens=4, messages=follow, tools=ANT_TOOLS)
    assert again.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_streamed_tool_use_gives_what_the_whole_reply_gives(ant: Any) -> None:
    kwargs = {"model": "tiny", "max_tokens": 300, "messages": ASK, "tools": ANT_TOOLS,
              "tool_choice": {"type": "any"}, "extra_body": {"temperature": 0.0}}  # fmt: skip
    whole = ant.messages.create(**kwargs)
    with ant.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == whole.stop_reason == "tool_use"
    got = [(b.name, b.input) for b in final.content if b.type == "tool_use"]
    assert got == [(b.name, b.input) for b in whole.content if b.type == "tool_use"]
    _valid(next(b for b in final.content if b.type == "tool_use"))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and "content_block_start" in kinds and kinds[-1] == "message_stop"


def test_auto_and_none_answer_in_text_and_the_template_sees_the_tools(ant: Any) -> None:
    for choice in ({"type": "auto"}, {"type": "none"}):
        reply = ant.messages.create(
            model="tiny", max_tokens=6, messages=ASK, tools=ANT_TOOLS, tool_choice=choice
        )
        assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # the tools reach the prompt: the same request costs more prompt tokens with them than without
    plain = ant.messages.create(model="tiny", max_tokens=1, messages=ASK)
    tooled = ant.messages.create(model="tiny", max_tokens=1, messages=ASK, tools=ANT_TOOLS)
    assert tooled.usage.input_tokens > plain.usage.input_tokens + 50


def test_one_call_at_most_when_parallel_use_is_disabled(ant: Any) -> None:
    reply = ant.messages.create(
        model="tiny", max_tokens=300, messages=ASK, tools=ANT_TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )  # fmt: skip
    assert len([b for b in reply.content if b.type == "tool_use"]) == 1


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tools": [{"name": "a b", "input_schema": {"type": "object"}}]}, "tools[0].name"),
        ({"tools": ANT_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
        ({"tools": ANT_TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"tools": ANT_TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
         "messages[0].content[0].tool_use_id"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "name": "add", "input": {}}]}]},
         "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0]"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(ant: Any, kwargs: dict[str, Any], param: str) -> None:
    body = {"model": "tiny", "max_tokens": 4, "messages": ASK, **kwargs}
    with pytest.raises(anthropic.BadRequestError) as err:
        ant.messages.create(**body)
    assert err.value.status_code == 400
    # Anthropic's error body has no param: its message begins with the field
    assert err.value.body["error"]["message"].startswith(param), (param, err.value.body)
