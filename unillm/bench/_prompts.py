"""The requests a workload sends, built with the model's own tokenizer so prompt lengths are exact.

A synthetic prompt is a run of words that are each one token of the model's vocabulary (found by
scanning it), so ``n`` words are ``n`` tokens; every prompt is checked against the tokenizer and
trimmed or padded until it is exactly as long as drawn. A shared-prefix workload puts one prefix of
``shared_prefix_len`` tokens in front of ``shared_prefix_fraction`` of the prompts (spread evenly
over them), each followed by a suffix of its own.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from unillm._errors import ConfigError
from unillm.bench._workload import BenchWorkload

__all__ = ["BenchRequest", "Prompts", "Tokenizer"]

_WORD = re.compile(r"^ [A-Za-z]{2,12}$")
_FALLBACK_WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "are", "with", "as", "be", "at",
    "by", "this", "had", "not", "but", "from", "or", "have", "an", "they", "which", "one", "you",
    "were", "her", "all", "she", "there", "would", "their", "we", "him", "been", "has", "when",
    "who", "will", "more", "no", "if", "out", "so", "said", "what", "up", "its", "about", "into",
    "than", "them", "can", "only", "other", "new", "some", "could", "time", "these", "two", "may",
    "then", "do", "first",
)  # fmt: skip
_SCAN_LIMIT = 30_000  # ids scanned for one-token words: common words come early in a BPE vocabulary


class Tokenizer(Protocol):
    """What prompt building needs of a tokenizer: an engine, or ``HFTokenizer`` for a URL."""

    def tokenize(self, text: str) -> list[int]: ...
    def detokenize(self, ids: Sequence[int]) -> str: ...


class HFTokenizer:
    """A ``tokenizer.json`` (an HF model directory's) read with the ``tokenizers`` package, for
    benchmarking a server whose model files are on this machine."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tok

        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise ConfigError(f"no tokenizer.json at {str(p)!r}; pass an HF model directory or the file")
        self._tok = _Tok.from_file(str(file))
        self.vocab_size: int | None = self._tok.get_vocab_size()

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload: its prompt and the lengths it was drawn with."""

    index: int
    prompt: str
    input_tokens: int  # the prompt's length under the tokenizer (chat: of the user message)
    output_tokens: int  # the output length asked for
    shared_prefix: bool = False


class Prompts:
    """The requests of ``workload``, drawn deterministically from its seed: ``get(i)`` is the
    same request every time, so levels of a sweep send the same prompts."""

    def __init__(
        self, workload: BenchWorkload, tokenizer: Tokenizer | None, *, vocab_size: int | None = None
    ) -> None:
        self.workload = workload
        self.tokenizer = tokenizer
        self.exact = tokenizer is not None
        self._cache: dict[int, BenchRequest] = {}
        self._base = len(tokenizer.tokenize("")) if tokenizer is not None else 0  # a BOS it adds
        self._jsonl = _read_jsonl(workload.prompts_jsonl) if workload.prompts_jsonl else None
        self._words = self._word_pool(vocab_size) if self._jsonl is None else []
        rng = random.Random(workload.seed)
        self.prefix = self._text(rng, workload.shared_prefix_len) if workload.shared_prefix_fraction else ""
        self._prefixed_every = workload.shared_prefix_fraction

    # ---- building ----

    def _count(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.tokenize(text)) - self._base

    def _word_pool(self, vocab_size: int | None) -> list[str]:
        tok = self.tokenizer
        if tok is None:
            return [" " + w for w in _FALLBACK_WORDS]
        pool: list[str] = []
        if vocab_size:
            for i in range(min(vocab_size, _SCAN_LIMIT)):
                try:
                    s = tok.detokenize([i])
                except Exception:  # ids a tokenizer cannot decode alone (byte pieces)
                    continue
                if _WORD.match(s) and self._count(s) == 1:
                    pool.append(s)
        if len(pool) < 16:
            pool += [" " + w for w in _FALLBACK_WORDS if self._count(" " + w) == 1 and " " + w not in pool]
        if not pool:
            raise ConfigError(
                "cannot build exact-length prompts: no word of this tokenizer's vocabulary is one "
                "token; give the workload prompts_jsonl instead"
            )
        return pool

    def _text(self, rng: random.Random, n: int) -> str:
        """Text of exactly ``n`` tokens (as near as the tokenizer allows: ``exact`` turns False)."""
        if n <= 0:
            return ""
        words = [rng.choice(self._words) for _ in range(n)]
        text = "".join(words)
        for _ in range(8):
            got = self._count(text)
            if got == n:
                return text
            if got > n:
                words = words[: max(1, len(words) - (got - n))]
            else:
                words += [rng.choice(self._words) for _ in range(n - got)]
            text = "".join(words)
        if self._count(text) != n:
            self.exact = False
        return text

    def _prefixed(self, i: int) -> bool:
        f = self._prefixed_every
        if f <= 0:
            return False
        # spread evenly: of the first N requests, exactly round(f * N) carry the prefix, for every
        # N, so a level cut short by a duration still has the share asked for
        return int((i + 1) * f + 0.5) - int(i * f + 0.5) == 1

    def get(self, i: int) -> BenchRequest:
        """Request ``i`` of the workload."""
        req = self._cache.get(i)
        if req is not None:
            return req
        wl = self.workload
        rng = random.Random(f"{wl.seed}:{i}")
        out_len = wl.output_len.sample(rng)
        if self._jsonl is not None:
            entry = self._jsonl[i % len(self._jsonl)]
            prompt = str(entry["prompt"])
            asked = entry.get("output_tokens")
            out_len = int(asked) if isinstance(asked, int) and asked > 0 else out_len
            req = BenchRequest(i, prompt, self._count(prompt), out_len)
        else:
            n = wl.input_len.sample(rng)
            if self._prefixed(i):
                suffix = self._text(rng, max(1, n - wl.shared_prefix_len))
                prompt = self.prefix + suffix
                req = BenchRequest(i, prompt, self._count(prompt), out_len, shared_prefix=True)
            else:
                prompt = self._text(rng, n)
                req = BenchRequest(i, prompt, self._count(prompt), out_len)
        if len(self._cache) < 100_000:
            self._cache[i] = req
        return req


def _read_jsonl(path: str) -> list[dict[str, object]]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"prompts_jsonl {path!r} does not exist")
    out: list[dict[str, object]] = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{n}: not JSON ({exc.msg})") from exc
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str) or not entry["prompt"]:
            raise ConfigError(f"{path}:{n}: each line needs a non-empty 'prompt' string")
        out.append(entry)
    if not out:
        raise ConfigError(f"prompts_jsonl {path!r} holds no prompts")
    return out
