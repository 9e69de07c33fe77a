"""Structured output: the one reading of ``response_format`` that every backend uses, and the
checking of what came back.

A request asks for a format in one of these shapes, all read by :func:`output_format`:

- a pydantic model class: JSON that validates into it (``Completion.parsed()`` returns the instance);
- OpenAI's ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``;
- OpenAI's ``{"type": "json_object"}``: any JSON object;
- a bare JSON schema (``{"type": "object", "properties": ...}``);
- ``{"type": "text"}``: no format (the same as None);
- ``{"type": "regex", "pattern": "..."}``: text that the regular expression matches whole;
- ``{"type": "choice", "choices": ["...", ...]}``: exactly one of the strings.

Regex and choice outputs are plain text, not JSON: ``Completion.parsed()`` returns the text once it
matches. Regexes use the syntax common to Python's ``re`` and the engines' libraries (classes,
repetition, alternation, groups); lookaround and backreferences are refused.

Each backend enforces the format with its engine's own mechanism (llama.cpp's grammars, vLLM's
structured outputs, ...) or refuses it; none ignores it. jsonschema is imported only to check a
schema or an output, never by ``import unillm``.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from unillm._errors import ConfigError, GenerationError

__all__ = ["ANNOTATIONS", "OutputFormat", "StructuredOutputError", "output_format", "unenforced"]

_WRAPPERS = ("json_schema", "json_object", "text", "regex", "choice")
# what a regex may not use: engines' regex libraries (Rust's regex, GBNF) have no lookaround or
# backreferences, so such a pattern could not be enforced the same everywhere
_UNPORTABLE = re.compile(r"\(\?[=!<]|\(\?P[=>]|\\[1-9]|\(\?[aiLmsux]")
MAX_CHOICES = 4096
# keywords that make a mapping a JSON schema rather than a mistyped wrapper
_SCHEMA_KEYS = frozenset(
    {"type", "properties", "items", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "$schema"}
)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


#: JSON as the standard has it: NaN and Infinity are errors (Python's reader takes them). A
#: number past a double's range (1e999) is JSON and reads as inf; ``unillm._chat._tools.json_text``
#: writes it back as such a number.
STRICT_JSON = json.JSONDecoder(parse_constant=_no_constant)


class StructuredOutputError(GenerationError):
    """The output does not parse or validate under the format asked for (cut by ``max_tokens``,
    most often). ``raw`` holds the text as generated; nothing is lost."""

    def __init__(self, message: str, raw: str, finish_reason: str | None = None) -> None:
        self.raw = raw
        self.finish_reason = finish_reason
        hint = (
            " The output was cut by max_tokens: raise max_tokens."
            if finish_reason == "length"
            else " The raw text is on this error's .raw."
        )
        super().__init__(message + "." + hint)


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """A response format, read once: ``schema`` is None for any JSON object (``json_object``);
    ``pattern`` is the regex of ``regex``, ``choices`` the strings of ``choice``."""

    kind: Literal["json_schema", "json_object", "regex", "choice"]
    schema: Mapping[str, Any] | None = None
    model: type[BaseModel] | None = None
    pattern: str | None = None
    choices: tuple[str, ...] = ()

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_schema", "json_object")

    @property
    def json_schema(self) -> dict[str, Any]:
        """The schema to enforce; ``json_object`` is ``{"type": "object"}``. A regex or choice has
        none: asking raises ``ConfigError``, so a backend that only knows JSON refuses it loudly
        instead of enforcing the wrong thing."""
        if not self.is_json:
            raise ConfigError(
                f"this response_format is a {self.kind}, not JSON, and this backend enforces JSON "
                "formats only; use a JSON schema, or a backend that enforces regexes and choices"
            )
        return dict(self.schema) if self.schema is not None else {"type": "object"}

    def parse(self, text: str, finish_reason: str | None = None) -> Any:
        """``text`` parsed and validated: the pydantic instance when a model class was given, else
        the JSON value. Raises ``StructuredOutputError`` (with the raw text) when it does not
        parse or validate."""
        if self.kind == "regex":
            if re.fullmatch(self.pattern or "", text) is None:
                msg = f"the output does not match {self.pattern!r}"
                raise StructuredOutputError(msg, text, finish_reason)
            return text
        if self.kind == "choice":
            if text not in self.choices:
                raise StructuredOutputError("the output is not one of the choices", text, finish_reason)
            return text
        try:
            value = STRICT_JSON.decode(text)
        except ValueError as exc:
            raise StructuredOutputError(f"the output is not JSON ({exc})", text, finish_reason) from None
        if self.model is not None:
            from pydantic import ValidationError

            try:
                return self.model.model_validate(value)
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"]) or "the top level"
                raise StructuredOutputError(
                    f"the output does not validate as {self.model.__name__}: {where}: {first['msg']}",
                    text,
                    finish_reason,
                ) from None
        if self.kind == "json_object" and not isinstance(value, dict):
            raise StructuredOutputError(
                f"the output is JSON but not an object ({type(value).__name__})", text, finish_reason
            )
        if self.schema is not None:
            import jsonschema

            error = jsonschema.exceptions.best_match(_validator(self.schema).iter_errors(value))
            if error is not None:
                where = "/".join(str(p) for p in error.absolute_path) or "the top level"
                raise StructuredOutputError(
                    f"the output does not validate against the schema: {where}: {error.message}",
                    text,
                    finish_reason,
                )
        return value


#: keywords that say nothing about what is valid: no engine needs to enforce them
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly"}
    | {"writeOnly", "$defs", "definitions"}
)
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = (
    "items", "additionalProperties", "not", "if", "then", "else", "contains", "additionalItems",
    "propertyNames", "unevaluatedProperties",
)  # fmt: skip


def subschemas(node: Mapping[str, Any]) -> Iterator[Any]:
    """The schemas directly inside schema ``node`` (under ``properties``, ``anyOf``, ``items``,
    ...), in the order :func:`unenforced` walks them; what is not a schema is passed over."""
    for key, value in node.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, Mapping):
            yield from value.values()
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            yield from value
        elif key in _SUBSCHEMAS:
            yield from value if isinstance(value, list) else [value]


def unenforced(schema: Any, enforced: frozenset[str], formats: frozenset[str] = frozenset()) -> list[str]:
    """Where ``schema`` uses a keyword outside ``enforced`` (or a ``format`` outside ``formats``),
    as ``"path: keyword"``: what an engine's mechanism would silently let through."""
    found: list[str] = []

    def walk(node: Any, path: str) -> None:
        if not isinstance(node, Mapping):
            return
        for key, value in node.items():
            if key not in ANNOTATIONS and key not in enforced:
                found.append(f"{path or '/'}: {key}")
            elif key == "format" and value not in formats:
                found.append(f"{path or '/'}: format {value!r}")
            if key in _SUBSCHEMA_MAPS and isinstance(value, Mapping):
                for name, sub in value.items():
                    walk(sub, f"{path}/{key}/{name}")
            elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
                for i, sub in enumerate(value):
                    walk(sub, f"{path}/{key}/{i}")
            elif key in _SUBSCHEMAS:
                subs = value if isinstance(value, list) else [value]
                for i, sub in enumerate(subs):
                    walk(sub, f"{path}/{key}" + (f"/{i}" if isinstance(value, list) else ""))

    walk(schema, "")
    return found


def _validator(schema: Mapping[str, Any]) -> Any:
    import jsonschema

    cls = jsonschema.validators.validator_for(schema)
    return cls(schema)


def output_format(value: Any) -> OutputFormat | None:
    """Read a ``response_format`` in any of its shapes (see the module's docstring); None for no
    format. Raises ``ConfigError`` saying what is wrong with one that cannot be read, including a
    schema that is not valid JSON Schema."""
    if value is None:
        return None
    if isinstance(value, type) and issubclass(value, BaseModel):
        return OutputFormat("json_schema", value.model_json_schema(), value)
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"response_format must be a pydantic model class or a dict, got {type(value).__name__}; "
            'give {"type": "json_schema", "json_schema": {"schema": {...}}} or a model class'
        )
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat("json_object")
    if kind == "regex":
        return _regex(value.get("pattern", value.get("regex")))
    if kind == "choice":
        return _choice(value.get("choices"))
    if kind == "json_schema":
        inner = value.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, Mapping) else None
        if not isinstance(schema, Mapping):
            raise ConfigError(
                'response_format {"type": "json_schema"} needs "json_schema": {"schema": {...}} with '
                "the schema as an object"
            )
        return OutputFormat("json_schema", checked_schema(schema))
    if (isinstance(kind, str) and kind.startswith("json")) or not (_SCHEMA_KEYS & set(value)):
        raise ConfigError(
            f"response_format type {kind!r} is not one of {', '.join(_WRAPPERS)}, and the dict is not "
            "a JSON schema either (no type, properties, items, enum, anyOf, ... keyword)"
        )
    return OutputFormat("json_schema", checked_schema(value))


def _regex(pattern: Any) -> OutputFormat:
    if not isinstance(pattern, str) or not pattern:
        raise ConfigError('response_format {"type": "regex"} needs "pattern": a non-empty regular expression')
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ConfigError(f"response_format's pattern is not a regular expression: {exc}") from None
    if _UNPORTABLE.search(pattern):
        raise ConfigError(
            "response_format's pattern uses lookaround, a backreference or an inline flag, which the "
            "engines' constrained decoding cannot enforce; rewrite it without them"
        )
    return OutputFormat("regex", pattern=pattern)


def _choice(choices: Any) -> OutputFormat:
    ok = isinstance(choices, (list, tuple)) and all(isinstance(c, str) and c for c in choices)
    if not ok or not choices:
        raise ConfigError('response_format {"type": "choice"} needs "choices": a list of non-empty strings')
    if len(choices) > MAX_CHOICES:
        raise ConfigError(f"response_format has {len(choices)} choices; at most {MAX_CHOICES}")
    return OutputFormat("choice", choices=tuple(dict.fromkeys(choices)))


def checked_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` as a plain dict, once jsonschema has said it is a valid schema."""
    try:
        text = json.dumps(schema, sort_keys=True)
    except RecursionError:
        raise ConfigError("response_format's schema is nested too deeply to read") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"response_format's schema is not JSON ({exc})") from None
    _check_schema(text)
    return dict(schema)


@functools.lru_cache(maxsize=256)
def _check_schema(text: str) -> None:
    """Raise ``ConfigError`` unless the schema (as JSON text, so a request's repeat is a cache hit)
    is valid JSON Schema."""
    import jsonschema

    schema = json.loads(text)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except RecursionError:
        raise ConfigError("response_format's schema is nested too deeply to check") from None
    except jsonschema.exceptions.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "the top level"
        msg = f"response_format's schema is not valid JSON Schema: {where}: {exc.message}"
        raise ConfigError(msg) from None
    except Exception as exc:  # what jsonschema raises on a schema it cannot even look at ($schema: [])
        raise ConfigError(f"response_format's schema cannot be read as JSON Schema: {exc!r}") from None
