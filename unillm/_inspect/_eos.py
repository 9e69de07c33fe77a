"""One end-of-sequence set per model, from what the model declares.

Engines guess their stop tokens differently: llama.cpp marks tokens end-of-generation by *name*
(``<|endoftext|>``, ``<|im_end|>``, ...) whatever the GGUF's EOS id says; vLLM stops on the
tokenizer's EOS plus ``generation_config.json``'s list; mlx-lm on the tokenizer's and the config's.
So the same weights stop at different tokens on different engines. unillm computes the set once,
from the model's own declarations, and every backend stops on exactly that set:

- HF directories: ``generation_config.json`` and ``config.json`` ``eos_token_id`` (an id or a
  list), ``tokenizer_config.json``'s ``eos_token``;
- GGUF files: ``tokenizer.ggml.eos_token_id``, ``eot_token_id`` and ``eom_token_id``;
- both: the chat template's end-of-turn token, where the template writes one of the well-known
  ones after each message (``<|im_end|>``, ``<|eot_id|>``, ...) and it is one token of the vocabulary.

Token *strings* are turned into ids by the caller's tokenizer (``to_id``), since a backend has one
loaded; ids the vocabulary does not hold are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from unillm._inspect._chat_template import gguf_chat_template, hf_chat_template
from unillm._inspect._json import advisory_json

__all__ = ["END_OF_TURN_TOKENS", "declared_eos", "eos_from_gguf_metadata", "eos_from_hf_dir"]

#: End-of-turn tokens of the common chat formats, found in a chat template's text.
END_OF_TURN_TOKENS = (
    "<|im_end|>",  # ChatML (Qwen, many fine-tunes)
    "<|eot_id|>",  # Llama 3
    "<|eom_id|>",  # Llama 3.1 tool calls
    "<|end|>",  # Phi-3
    "<end_of_turn>",  # Gemma
    "<|end_of_turn|>",
    "<|endofturn|>",
)

ToId = Callable[[str], "int | None"]


def declared_eos(
    *,
    ids: Iterable[Any] = (),
    tokens: Iterable[Any] = (),
    chat_template: str | None = None,
    to_id: ToId | None = None,
    vocab_size: int | None = None,
) -> frozenset[int]:
    """The end-of-sequence set from declared ``ids``, token strings and a chat template.

    ``to_id`` maps a token string to its id (None when it is not one token); without it strings
    are ignored. Ids outside ``0 <= id < vocab_size`` (when given) are dropped: a config that
    names a token the vocabulary lacks would otherwise make an engine index out of range.
    """
    out: set[int] = {i for i in _ints(ids) if vocab_size is None or 0 <= i < vocab_size}
    if to_id is not None:
        names = [t for t in tokens if isinstance(t, str) and t]
        if chat_template:
            names += [t for t in END_OF_TURN_TOKENS if t in chat_template]
        for name in names:
            tok = to_id(name)
            if isinstance(tok, int) and (vocab_size is None or 0 <= tok < vocab_size):
                out.add(tok)
    return frozenset(out)


def eos_from_hf_dir(directory: str | Path, *, to_id: ToId | None, vocab_size: int | None) -> frozenset[int]:
    """The declared set of an HF model directory (``config.json`` and its neighbours)."""
    d = Path(directory)
    gen, cfg, tok = (
        advisory_json(d / n) for n in ("generation_config.json", "config.json", "tokenizer_config.json")
    )
    sub = cfg.get("text_config")
    text_cfg: dict[str, Any] = sub if isinstance(sub, dict) else {}
    eos_token = tok.get("eos_token")
    if isinstance(eos_token, dict):  # {"content": "<|im_end|>", "special": true, ...}
        eos_token = eos_token.get("content")
    template = hf_chat_template(d, tok)
    return declared_eos(
        ids=[*_listed(gen.get("eos_token_id")), *_listed(cfg.get("eos_token_id")),
             *_listed(text_cfg.get("eos_token_id"))],
        tokens=[eos_token],
        chat_template=template,
        to_id=to_id,
        vocab_size=vocab_size,
    )  # fmt: skip


def eos_from_gguf_metadata(
    metadata: Mapping[str, Any], *, to_id: ToId | None, vocab_size: int | None
) -> frozenset[int]:
    """The declared set of a GGUF file, from its header's metadata."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return declared_eos(
        ids=[metadata.get(k) for k in keys],
        chat_template=gguf_chat_template(metadata),
        to_id=to_id,
        vocab_size=vocab_size,
    )


def _listed(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _ints(values: Iterable[Any]) -> Iterable[int]:
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool):
            yield v
