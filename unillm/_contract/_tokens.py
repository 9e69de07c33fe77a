"""The exact bytes of one token of a Hugging Face tokenizer.

A token that is part of a character (one byte of a multi-byte UTF-8 sequence) decodes alone to
U+FFFD, which loses the byte OpenAI's ``logprobs[].bytes`` is there to carry. Such a token is either
a byte-fallback piece (``<0xE6>``, SentencePiece vocabularies) or a piece of a byte-level BPE
vocabulary (GPT-2's byte-to-character alphabet); both spell the byte out. ``unillm.backend`` exports
this for plugins as ``hf_token_bytes``.
"""

from __future__ import annotations

import functools
import re
from typing import Any

__all__ = ["hf_token_bytes"]

_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.cache
def _byte_level() -> dict[str, int]:
    """Byte-level BPE's alphabet, character -> byte: the printable bytes stand for themselves, the
    others for the characters from U+0100 on, in order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in kept}
    shifted = (b for b in range(256) if b not in set(kept))
    for n, b in enumerate(shifted):
        table[chr(256 + n)] = b
    return table


def hf_token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The bytes ``token_id`` stands for: its text alone as UTF-8 where that text is whole
    characters, else the byte its piece spells (byte fallback, or byte-level BPE)."""
    text = str(tokenizer.decode([token_id]))
    if "\ufffd" not in text:
        return text.encode()
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        if found := _BYTE.match(piece):
            return bytes([int(found[1], 16)])
        table = _byte_level()
        if piece and all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
    return text.encode()
