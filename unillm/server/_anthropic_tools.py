"""Anthropic's tool use on ``/v1/messages``, read into and written from unillm's one tool shape.

Requests: ``tools`` (``name``, ``description``, ``input_schema``) and ``tool_choice`` (``auto``,
``any``, ``tool`` with a ``name``, ``none``; ``disable_parallel_tool_use``) become OpenAI's shape,
which ``unillm._chat._tools`` reads for every route and backend; an assistant turn's ``tool_use`` blocks
become its ``tool_calls`` and a user turn's ``tool_result`` blocks become ``tool`` messages, so the
model's own template renders them. Replies: the calls the model made as ``tool_use`` blocks (their
``input`` the parsed arguments), ``stop_reason`` ``tool_use``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unillm._chat._tools import InvalidTools, ToolSpec, json_text, read_tools
from unillm.server._errors import ApiError
from unillm.server._request import text_of

if TYPE_CHECKING:
    from unillm._types import ToolCall
    from unillm.server._schemas import AnthropicMessage, CountTokensRequest, MessagesRequest

__all__ = ["read_anthropic_tools", "tool_use_blocks", "turns"]


def read_anthropic_tools(body: MessagesRequest | CountTokensRequest) -> tuple[ToolSpec | None, bool]:
    """The request's tools read (None: plain chat) and whether one call at most is wanted; a 400
    naming the field in Anthropic's terms when they cannot be used."""
    choice = body.tool_choice or {}
    kind = choice.get("type", "auto")
    if kind not in ("auto", "any", "tool", "none"):
        raise ApiError(
            400, f"tool_choice type {kind!r} is not one of auto, any, tool, none", param="tool_choice"
        )
    if kind == "tool" and not isinstance(choice.get("name"), str):
        raise ApiError(400, "tool_choice of type 'tool' needs the tool's name", param="tool_choice.name")
    openai_choice: Any = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        openai_choice = {"type": "function", "function": {"name": choice["name"]}}
    tools = body.tools
    converted: Any = tools
    if isinstance(tools, list):
        converted = [_openai_tool(t, i) for i, t in enumerate(tools)]
    try:
        spec = read_tools(converted, openai_choice)
    except InvalidTools as exc:
        param = exc.field.replace(".function.parameters", ".input_schema").replace(".function", "")
        raise ApiError(400, str(exc).replace("function.parameters", "input_schema"), param=param) from exc
    return spec, bool(choice.get("disable_parallel_tool_use"))


def _openai_tool(tool: Any, i: int) -> Any:
    if not isinstance(tool, dict):
        return tool  # read_tools names what is wrong with it
    if tool.get("type") not in (None, "custom"):
        raise ApiError(
            400, f"tools[{i}] is a {tool.get('type')!r} tool (a server tool of Anthropic's): this server "
            "runs the model's own tool calls only; send tools with name, description and input_schema",
            param=f"tools[{i}].type",
        )  # fmt: skip
    fn = {"name": tool.get("name"), "parameters": tool.get("input_schema", {"type": "object"})}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def turns(messages: list[AnthropicMessage]) -> list[dict[str, Any]]:
    """Anthropic's turns as chat messages: ``tool_use`` blocks as the assistant's ``tool_calls``,
    each ``tool_result`` block as a ``tool`` message answering its call."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls, results = [], [], []
        for j, block in enumerate(m.content):
            at = f"{where}[{j}]"
            if block.type == "tool_use" and m.role == "assistant":
                if not isinstance(block.name, str) or not isinstance(block.input, dict):
                    raise ApiError(400, "a tool_use block needs a name and an input object", param=at)
                calls.append({"id": block.id or f"toolu_{i}_{j}", "type": "function",
                              "function": {"name": block.name, "arguments": block.input}})  # fmt: skip
            elif block.type == "tool_result" and m.role == "user":
                if not isinstance(block.tool_use_id, str):
                    raise ApiError(400, "a tool_result block needs tool_use_id", param=f"{at}.tool_use_id")
                content = _result_text(block.content, f"{at}.content")
                if block.is_error:
                    content = f"Error: {content}"
                results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
            elif block.type in ("tool_use", "tool_result"):
                raise ApiError(400, f"a {block.type} block cannot be in a {m.role} turn", param=at)
            else:
                texts.append(text_of([block], at))
        out.extend(results)  # the results answer the calls of the turn before
        if texts or calls or not results:
            msg: dict[str, Any] = {"role": m.role, "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            if not isinstance(text, str):
                raise ApiError(400, "a tool_result's content is text or text blocks", param=f"{where}[{k}]")
            parts.append(text)
        return "\n".join(parts)
    raise ApiError(400, "a tool_result's content is text or text blocks", param=where)


def tool_use_blocks(calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    """The calls as Anthropic's ``tool_use`` content blocks."""
    return [{"type": "tool_use", "id": "toolu_" + c.id.removeprefix("call_"), "name": c.name,
             "input": c.arguments, "caller": {"type": "direct"}} for c in calls]  # fmt: skip


def input_json(block: dict[str, Any]) -> str:
    """A ``tool_use`` block's input as the JSON text a stream's ``input_json_delta`` carries."""
    return json_text(block["input"], separators=(",", ":"))
