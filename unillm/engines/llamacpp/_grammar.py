"""The llama.cpp backend's structured output: a response format as a GBNF grammar, put first in
llama.cpp's sampler chain so that only tokens the grammar allows can be sampled.

The grammar comes from llama-cpp-python's JSON-schema converter (a port of llama.cpp's own). Two
things here guard the process: llama.cpp returns no sampler for a grammar it cannot parse (adding
that to the chain would crash), and once the grammar is complete it allows only end-of-generation
tokens, so the backend ends the output on every one of them.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from unillm import ConfigError, UnsupportedParameter
from unillm.backend import OutputFormat, unenforced

__all__ = ["add_grammar", "eog_ids", "gbnf", "grammar_for"]


#: what llama-cpp-python's converter turns into grammar rules; anything else it would drop silently
ENFORCED = frozenset(
    {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems"}
    | {"maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "pattern", "minLength"}
    | {"maxLength", "format"}
)
FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"})


def grammar_for(fmt: OutputFormat) -> str:
    """``fmt``'s GBNF grammar; raises ``UnsupportedParameter`` for a schema whose keywords the
    grammar would not enforce (integer bounds, say), never a grammar that half-enforces it."""
    if fmt.kind == "choice":
        return "root ::= " + " | ".join(_literal(c) for c in fmt.choices)
    if fmt.kind == "regex":
        raise UnsupportedParameter(
            "llama.cpp",
            ["response_format"],
            hint="llama.cpp's grammars are not regular expressions, and unillm does not translate "
            "them: use a choice or a JSON schema with a string pattern, or a backend that enforces "
            "regexes (MLX, vLLM).",
        )
    if fmt.schema is not None and (missing := unenforced(fmt.schema, ENFORCED, FORMATS)):
        raise UnsupportedParameter(
            "llama.cpp",
            ["response_format"],
            hint=f"Its grammar converter would not enforce {', '.join(missing[:6])}: drop those "
            "keywords (validate them after parsing), or use a backend that enforces them (vLLM).",
        )
    return gbnf(fmt.kind, json.dumps(fmt.schema, sort_keys=True) if fmt.schema is not None else None)


def add_grammar(sampler: Any, vocab: Any, fmt: OutputFormat) -> None:
    """Add ``fmt``'s grammar to llama-cpp-python's ``LlamaSampler`` chain ``sampler``."""
    import llama_cpp

    text = grammar_for(fmt)
    grammar = llama_cpp.llama_sampler_init_grammar(vocab, text.encode("utf-8"), b"root")
    if not grammar:  # a NULL sampler: llama.cpp could not parse the grammar (it logged why)
        raise ConfigError(
            "llama.cpp could not build a grammar from this response_format's schema; simplify the "
            "schema (the converter supports objects, arrays, enums, const, numbers and strings with "
            "bounds, anyOf and local $ref)"
        )
    llama_cpp.llama_sampler_chain_add(sampler.sampler, grammar)


@functools.lru_cache(maxsize=64)
def gbnf(kind: str, schema: str | None) -> str:
    """The GBNF grammar for a format (``schema`` as JSON text: repeats are cache hits)."""
    from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

    if schema is None:  # json_object: any JSON object
        return JSON_GBNF
    try:
        text = str(json_schema_to_gbnf(schema))
    except Exception as exc:  # the converter raises bare exceptions on what it does not support
        msg = f"llama.cpp cannot turn this response_format's schema into a grammar: {exc}"
        raise ConfigError(msg) from None
    # The converter's string character admits control characters, which JSON forbids inside a
    # string (llama.cpp's own JSON grammar excludes them); its other rules are kept as written.
    fixed = _CHAR.sub(lambda m: m[1] + r'[^"\\\x00-\x1F]' + m[2], text)
    if "char ::=" in text and fixed == text:
        raise ConfigError(
            "llama-cpp-python's JSON-schema converter changed its string rule; unillm cannot use it"
        )
    return fixed


_CHAR = re.compile(r'^(char ::= )\[\^"\\\\\](.*)$', re.MULTILINE)


def eog_ids(vocab: Any, n_vocab: int) -> frozenset[int]:
    """Every token llama.cpp counts as an end of generation (``llama_vocab_is_eog``)."""
    import llama_cpp

    is_eog = llama_cpp.llama_vocab_is_eog
    return frozenset(t for t in range(n_vocab) if is_eog(vocab, t))


def _literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ch == "\x7f":
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
