"""Logprobs in OpenAI's two shapes: chat's ``choices[].logprobs.content`` (each token with its
``top_logprobs``, exactly the k asked) and the legacy completions object (``tokens``,
``token_logprobs``, ``top_logprobs`` as one ``{text: logprob}`` dict per token, ``text_offset``).
Token texts are each id detokenized alone, as OpenAI and vLLM show them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unillm._contract._engine import Engine
    from unillm._types import Chunk, Completion

__all__ = ["chat_logprobs", "completion_logprobs"]


class _Texts:
    """Each id's text, detokenized once per answer (the alternatives repeat), and its exact bytes
    (``Engine.token_bytes``: a byte of a multi-byte character is that byte, not U+FFFD's three)."""

    def __init__(self, engine: Engine[Any]) -> None:
        self._engine = engine
        self._seen: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def __call__(self, tid: int) -> str:
        text = self._seen.get(tid)
        if text is None:
            text = self._seen[tid] = self._engine.detokenize([tid])
        return text

    def bytes(self, tid: int) -> list[int]:
        got = self._bytes.get(tid)
        if got is None:
            got = self._bytes[tid] = list(self._engine.token_bytes(tid))
        return got


def chat_logprobs(engine: Engine[Any], out: Chunk | Completion) -> dict[str, Any]:
    ids, lps, tops = out.token_ids, out.logprobs, out.top_logprobs
    text = _Texts(engine)
    entries = []
    for i, (tid, lp) in enumerate(zip(ids, lps or (), strict=False)):
        token = text(tid)
        alternatives = []
        if tops is not None and i < len(tops):
            for alt, alt_lp in tops[i]:
                t = text(alt)
                alternatives.append({"token": t, "logprob": alt_lp, "bytes": text.bytes(alt)})
        entry = {"token": token, "logprob": lp, "bytes": text.bytes(tid), "top_logprobs": alternatives}
        entries.append(entry)
    return {"content": entries, "refusal": None}


def completion_logprobs(engine: Engine[Any], out: Chunk | Completion, at: int = 0) -> dict[str, Any]:
    """The legacy object; ``at`` is where these tokens start in the whole text. With ``logprobs``
    above 0 each token's dict holds the k most likely and, as OpenAI's, the chosen token too (k + 1
    entries when it is not among them); two ids with the same text keep the likelier."""
    ids, lps, tops = out.token_ids, out.logprobs, out.top_logprobs
    text = _Texts(engine)
    tokens = [text(t) for t in ids]
    offsets = []
    for t in tokens:
        offsets.append(at)
        at += len(t)
    # logprobs 0: no alternatives, each token's dict its own (OpenAI's shape has a dict per token)
    top: list[dict[str, float]] = []
    for i, (token, lp) in enumerate(zip(tokens, lps or (), strict=False)):
        d: dict[str, float] = {}
        for alt, alt_lp in tops[i] if tops is not None and i < len(tops) else ():
            d.setdefault(text(alt), alt_lp)
        d.setdefault(token, lp)
        top.append(d)
    return {"tokens": tokens, "token_logprobs": list(lps or ()), "top_logprobs": top, "text_offset": offsets}
