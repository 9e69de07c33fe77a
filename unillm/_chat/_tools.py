"""Tool calling: reading ``tools`` and ``tool_choice``, the schema a forced call decodes under, and
the one parser of the calls models write.

``tools`` come in OpenAI's shape (``{"type": "function", "function": {"name", "description",
"parameters"}}``) and reach the chat template as that shape, which is what templates that take a
``tools`` variable expect. ``tool_choice`` is ``"auto"`` (the default with tools: the model writes
freely, the output is parsed), ``"none"`` (plain chat: the tools are neither rendered nor parsed),
``"required"`` or ``{"type": "function", "function": {"name": ...}}``: then decoding is held to
:meth:`ToolSpec.call_schema`, ``{"name": <a tool's name>, "arguments": <its parameters>}``, through
the backend's own structured output (``response_format``).

:func:`parse_tool_calls` reads what real templates make models write:

- Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or more
  (the closing tag may be missing at the end);
- Llama 3.1 / 3.2: ``{"name": ..., "parameters": {...}}`` as the whole reply, with or without
  ``<|python_tag|>`` before it, several separated by ``;``;
- Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` and the newer
  ``[TOOL_CALLS]name[ARGS]{...}``;
- the constrained format (``{"name": ..., "arguments": {...}}``), which the Llama reading covers.

Only calls to a tool that was offered count: a JSON reply that merely looks like a call to
something else stays text. Reading never raises for the ``auto`` case; a forced call that does
not parse (cut by ``max_tokens``) raises ``ToolCallParseError`` with the raw text.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from unillm._errors import ConfigError, GenerationError
from unillm._structured import STRICT_JSON, checked_schema
from unillm._types import ToolCall

__all__ = [
    "MAX_TOOLS",
    "InvalidTools",
    "ToolCallParseError",
    "ToolSpec",
    "json_text",
    "openai_tool_call",
    "parse_tool_calls",
    "read_tools",
]

#: OpenAI's limit on the tools of one request.
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_CHOICES = ("auto", "none", "required")


class InvalidTools(ConfigError):
    """``tools`` or ``tool_choice`` cannot be used as given; ``field`` says where
    (``"tools[2].function.name"``), as the message does."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")
        self.fields = (field,)


class ToolCallParseError(GenerationError):
    """The model had to call a tool (``tool_choice`` required or named) and what it wrote is not a
    call (``max_tokens`` cut it, most often). ``raw`` holds the text as generated."""

    def __init__(self, message: str, raw: str, finish_reason: str | None = None) -> None:
        self.raw = raw
        self.finish_reason = finish_reason
        hint = " It was cut by max_tokens: raise max_tokens." if finish_reason == "length" else ""
        super().__init__(f"{message}.{hint} The raw text is on this error's .raw.")


@dataclass(frozen=True)
class ToolSpec:
    """``tools`` and ``tool_choice``, read: ``tools`` in OpenAI's shape as the template gets them,
    ``choice`` one of auto, none, required, or the name of the tool that must be called."""

    tools: tuple[dict[str, Any], ...]
    choice: str

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)

    @property
    def forced(self) -> bool:
        """Whether the model must call a tool (decoding is constrained)."""
        return self.choice not in ("auto", "none")

    def call_schema(self) -> dict[str, Any]:
        """The JSON schema of one call of an allowed tool: ``{"name": const, "arguments":
        parameters}``, an ``anyOf`` over the tools. Each tool's ``$defs`` move to the top under
        ``<index>.<name>`` so the references of different tools never collide."""
        defs: dict[str, Any] = {}
        branches = []
        for i, tool in enumerate(self.tools):
            fn = tool["function"]
            if self.choice != "required" and fn["name"] != self.choice:
                continue
            params = _moved_defs(fn["parameters"], f"t{i}.", defs)
            branches.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": fn["name"]}, "arguments": params},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            )
        schema: dict[str, Any] = branches[0] if len(branches) == 1 else {"anyOf": branches}
        return {**schema, "$defs": defs} if defs else schema

    def response_format(self) -> dict[str, Any]:
        """:meth:`call_schema` as a ``response_format``."""
        return {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": self.call_schema()}}


def read_tools(tools: Any, tool_choice: Any = None) -> ToolSpec | None:
    """``tools`` and ``tool_choice`` checked and read; None when there is nothing to do (no tools,
    or ``tool_choice="none"``: plain chat). Raises ``InvalidTools`` naming the field."""
    choice = _choice(tool_choice)
    if tools is None or (isinstance(tools, Sequence) and not isinstance(tools, (str, bytes)) and not tools):
        if choice not in (None, "auto", "none"):
            raise InvalidTools("tool_choice", f"{choice!r} needs tools to choose from; pass tools=[...]")
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidTools("tools", f"must be a list of tools, got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise InvalidTools("tools", f"has {len(tools)} tools; send at most {MAX_TOOLS}")
    read = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(tools))
    names = [t["function"]["name"] for t in read]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise InvalidTools("tools", f"names {twice} more than one tool; each name must be unique")
    if choice not in (None, *_CHOICES) and choice not in names:
        raise InvalidTools("tool_choice", f"names {choice!r}, which is not one of the tools ({names[:10]})")
    if choice == "none":
        return None
    return ToolSpec(read, choice or "auto")


def _choice(value: Any) -> str | None:
    if value is None or value in _CHOICES:
        return value  # type: ignore[no-any-return]
    fn = value.get("function") if isinstance(value, Mapping) and value.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise InvalidTools(
            "tool_choice",
            f"must be 'auto', 'none', 'required' or {{'type': 'function', 'function': {{'name': ...}}}}, "
            f"got {value!r:.200}",
        )
    return name


def _tool(tool: Any, where: str) -> dict[str, Any]:
    """One tool in OpenAI's shape, its parameters a checked JSON schema (a pydantic model class
    is taken too, as its schema)."""
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise InvalidTools(where, f"must be {{'type': 'function', 'function': {{...}}}}, got {tool!r:.200}")
    fn = tool.get("function")
    if not isinstance(fn, Mapping):
        raise InvalidTools(f"{where}.function", "must be an object with name, description and parameters")
    unknown = set(fn) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise InvalidTools(f"{where}.function", f"has unknown fields {sorted(unknown)}")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidTools(
            f"{where}.function.name",
            f"must be 1 to 64 letters, digits, '_', '.' or '-', got {name!r:.100}",
        )
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidTools(f"{where}.function.description", "must be a string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if isinstance(params, type) and issubclass(params, BaseModel):
        params = params.model_json_schema()
    if not isinstance(params, Mapping) or params.get("type", "object") != "object":
        raise InvalidTools(f"{where}.function.parameters", "must be a JSON schema of an object")
    try:
        params = checked_schema(params)
    except ConfigError as exc:
        raise InvalidTools(
            f"{where}.function.parameters", str(exc).replace("response_format's ", "")
        ) from None
    out: dict[str, Any] = {"name": name, "parameters": params}
    if description is not None:
        out["description"] = description
    return {"type": "function", "function": out}


def _moved_defs(schema: dict[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its ``$defs``/``definitions`` moved into ``defs`` under ``prefix`` and its
    local references rewritten to match. A reference to the schema's root is refused: the root is
    no longer the root once it sits under ``arguments``."""
    own = {**schema.get("definitions", {}), **schema.get("$defs", {})}

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        if not isinstance(node, Mapping):
            return node
        out = {}
        for key, value in node.items():
            out[key] = (
                _moved_ref(value, prefix) if key == "$ref" and isinstance(value, str) else rewrite(value)
            )
        return out

    for name, sub in own.items():
        defs[prefix + name] = rewrite(sub)
    return rewrite({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})  # type: ignore[no-any-return]


def _moved_ref(ref: str, prefix: str) -> str:
    for root in ("#/$defs/", "#/definitions/"):
        if ref.startswith(root):
            return "#/$defs/" + prefix + ref[len(root) :]
    raise InvalidTools("tools", f"a parameters schema refers to {ref!r}; refer only to its own $defs")


# ---- parsing what the model wrote ----

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL = "[TOOL_CALLS]"
_DECODER = STRICT_JSON


def parse_tool_calls(
    text: str, names: Collection[str], *, forced: bool = False, finish_reason: str | None = None
) -> tuple[str, tuple[ToolCall, ...]]:
    """The calls of tools in ``names`` that ``text`` holds, and the text around them (the content
    of the reply). With ``forced`` (the model had to call one), no call is a ``ToolCallParseError``;
    otherwise it is ``(text, ())``. Never raises anything else, whatever ``text`` holds."""
    try:
        content, calls = _parse(text, frozenset(names))
    except (RecursionError, ValueError, TypeError, AttributeError):  # nesting deeper than json reads
        content, calls = text, []
    if forced and not calls:
        raise ToolCallParseError(
            "the model had to call a tool and what it wrote is not a call", text, finish_reason
        )
    return content, tuple(calls)


def _parse(text: str, names: frozenset[str]) -> tuple[str, list[ToolCall]]:
    if "<tool_call>" in text:
        calls = [c for m in _HERMES.finditer(text) for c in _calls(_json_at(m[1].strip()), names)]
        if calls:
            return _HERMES.sub("", text).strip(), calls
    if _MISTRAL in text:
        before, _, after = text.partition(_MISTRAL)
        calls = _mistral(after, names)
        if calls:
            return before.strip(), calls
    before, tag, after = text.partition(_PYTHON_TAG)
    body = after if tag else text
    calls = []
    for part in _json_values(body.strip()):
        calls.extend(_calls(part, names))
    if calls:
        return (before.strip() if tag else ""), calls
    return text, []


def _mistral(after: str, names: frozenset[str]) -> list[ToolCall]:
    after = after.strip()
    if after.startswith(("[", "{")):
        return _calls(_json_at(after), names)
    calls = []
    for piece in after.split(_MISTRAL):  # name[ARGS]{...}, each after its own [TOOL_CALLS]
        name, sep, args = piece.partition("[ARGS]")
        if sep:
            calls.extend(_calls({"name": name.strip(), "arguments": _json_at(args.strip())}, names))
    return calls


def _json_at(text: str) -> Any:
    """The JSON value ``text`` starts with, or None."""
    try:
        return _DECODER.raw_decode(text)[0]
    except ValueError:
        return None


def _json_values(text: str) -> list[Any]:
    """The JSON values ``text`` is made of, separated by ``;`` or whitespace (Llama's parallel
    calls); [] when anything else is in it."""
    values, at = [], 0
    while at < len(text):
        try:
            value, at = _DECODER.raw_decode(text, at)
        except ValueError:
            return []
        values.append(value)
        while at < len(text) and text[at] in "; \t\r\n":
            at += 1
    return values


def _calls(value: Any, names: frozenset[str]) -> list[ToolCall]:
    """The calls in one parsed JSON value: a call object or a list of them."""
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        if not isinstance(item, dict):
            continue
        name = item.get("name")
        args = item["arguments"] if "arguments" in item else item.get("parameters")
        if isinstance(args, str):
            args = _json_at(args)
        if isinstance(name, str) and name in names and isinstance(args, dict):
            out.append(ToolCall(name, args))
    return out


_BEYOND = "\x00beyond\x00"


def json_text(value: Any, **dumps: Any) -> str:
    """``value`` as JSON text. A float past a double's range (the model wrote 1e999, which reads
    as inf) is written as such a number again, never as ``Infinity``, which is not JSON."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, **dumps)
    except ValueError:
        pass

    def marked(v: Any) -> Any:
        if isinstance(v, float) and v in (math.inf, -math.inf):
            return _BEYOND + ("-" if v < 0 else "")
        if isinstance(v, dict):
            return {k: marked(x) for k, x in v.items()}
        if isinstance(v, list):
            return [marked(x) for x in v]
        return v

    text = json.dumps(marked(value), ensure_ascii=False, allow_nan=False, **dumps)
    return text.replace('"\\u0000beyond\\u0000-"', "-1e999").replace('"\\u0000beyond\\u0000"', "1e999")


def openai_tool_call(call: ToolCall) -> dict[str, Any]:
    """``call`` in OpenAI's response shape: the arguments as JSON text."""
    arguments = json_text(call.arguments)
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}
