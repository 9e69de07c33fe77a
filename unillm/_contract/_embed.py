"""Embeddings and reranking on the ``Engine``: the rules every backend shares, decided once.

What an engine is loaded for (``task``: generate, embed, rerank) and how it pools are read at
load (``task_for``, ``pooling_for``: the config's word, else the model's); the base class then
checks every call here the same way before the backend's ``_embed`` or ``_rerank`` runs: inputs
are non-empty text (or token ids), each fits the engine's limit or is cut to it when the caller
said ``truncate=True`` (never silently), the pooling asked for is one the loaded engine gives, and
an engine loaded for the other task says how to load for this one. After the backend, the vectors
are cut to ``dimensions`` (Matryoshka) and normalized, in that order, with numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from unillm._contract._checks import check_text, check_token_ids
from unillm._errors import ConfigError, ContextLengthExceeded, GenerationError
from unillm._types import Embeddings, EngineConfig, Pooling, Ranked, Reranked, Usage

if TYPE_CHECKING:
    from unillm._contract._engine import Engine
    from unillm._inspect import ModelInfo

__all__ = [
    "POOLINGS",
    "EmbedJob",
    "check_rerank",
    "check_task",
    "pooling_for",
    "rank",
    "task_for",
]

#: The poolings an embedding engine gives (docs/embeddings.md); the model's, else "last".
POOLINGS: tuple[Pooling, ...] = ("mean", "last", "cls")
_MAX_INPUTS = 1 << 16


def task_for(config: EngineConfig, model: ModelInfo | None) -> str:
    """What an engine loads for: the config's ``task``, else the model's (``ModelInfo.task``)."""
    if config.task is not None:
        return config.task
    return model.task if model is not None else "generate"


def pooling_for(config: EngineConfig, model: ModelInfo | None) -> Pooling:
    """How an embedding engine pools: the config's ``pooling``, else the model's, else "last" (a
    decoder's one token that has seen every other)."""
    if config.pooling is not None:
        return config.pooling
    declared = model.pooling if model is not None else None
    return declared if declared in POOLINGS else "last"  # type: ignore[return-value]


def check_task(engine: Engine[Any], want: str) -> None:
    """Refuse ``want`` (generate, embed, rerank) on an engine loaded for another task, saying how
    to load for it (each task has a load of its own: llama.cpp and vLLM set their context or
    runner up for one)."""
    have = engine.task
    if have == want or have is None:  # None: the engine cannot tell; its server answers
        return
    if want == "embed" and not engine.capabilities.embeddings:
        raise ConfigError(
            f"{engine.name} does not compute embeddings; use a backend that does (docs/embeddings.md)"
        )
    if want == "rerank":
        raise ConfigError(
            f"{engine.name} is loaded for {have}, not as a reranker, and unillm does not make "
            "relevance scores up from embeddings or text: a generic embedding model is not a "
            "reranker. Load a cross-encoder (a *ForSequenceClassification with one label, or a "
            "GGUF with rank pooling) with task='rerank' (docs/embeddings.md#rerank)"
        )
    raise ConfigError(
        f"{engine.name} is loaded for {have}; load the model with task={want!r} "
        f"(EngineConfig(task={want!r}), or --task {want} on the command line) to {want}"
    )


@dataclass
class EmbedJob:
    """One ``embed`` call, checked: its inputs, pooling, normalization and dimensions."""

    inputs: list[str | list[int]]
    pooling: Pooling | None
    normalize: bool
    dimensions: int | None
    truncate: bool

    @classmethod
    def of(
        cls,
        engine: Engine[Any],
        texts: Any,
        pooling: Any,
        normalize: Any,
        dimensions: Any,
        truncate: Any,
    ) -> EmbedJob:
        check_task(engine, "embed")
        if isinstance(texts, (bytes, bytearray)) or not isinstance(texts, (Sequence, str)):
            raise ConfigError(
                f"embed() takes a str or a list of str (or of token id lists), got {type(texts).__name__}"
            )
        if isinstance(texts, str) or (texts and isinstance(texts[0], int)):
            texts = [texts]
        if not texts:
            raise ConfigError("embed() was given no input: pass one text or a list of them")
        if len(texts) > _MAX_INPUTS:
            raise ConfigError(
                f"embed() takes at most {_MAX_INPUTS} inputs a call, got {len(texts)}; split them"
            )
        inputs: list[str | list[int]] = []
        for i, t in enumerate(texts):
            if isinstance(t, str):
                check_text(t, f"input {i} is")
                if not t:
                    raise ConfigError(f"input {i} is an empty string: there is nothing to embed")
                inputs.append(t)
            else:
                ids = check_token_ids(t, engine.vocab_size)
                if not ids:
                    raise ConfigError(f"input {i} is an empty token list: there is nothing to embed")
                inputs.append(ids)
        if pooling is None:
            pooling = engine.pooling
        elif pooling not in POOLINGS:
            raise ConfigError(f"pooling is one of {', '.join(POOLINGS)}, got {pooling!r}")
        elif pooling != engine.pooling and not engine.pools_per_call:
            if engine.pooling is None:
                raise ConfigError(
                    f"{engine.name} pools as its model does, which it cannot choose per call; "
                    "leave pooling unset"
                )
            raise ConfigError(
                f"{engine.name} was loaded with {engine.pooling} pooling, which its engine fixes at "
                f"load; load the model with pooling={pooling!r} (EngineConfig(pooling={pooling!r})) "
                f"for {pooling} pooling"
            )
        if not isinstance(normalize, bool):
            raise ConfigError(f"normalize is True or False, got {normalize!r}")
        if dimensions is not None and (
            isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1
        ):
            raise ConfigError(
                f"dimensions is a positive int (the leading dimensions kept), got {dimensions!r}"
            )
        if not isinstance(truncate, bool):
            raise ConfigError(f"truncate is True or False, got {truncate!r}")
        if truncate and engine.embeds_text:
            raise ConfigError(f"{engine.name} embeds what it is given whole; shorten the inputs it refuses")
        return cls(inputs, pooling, normalize, dimensions, truncate)

    def encode(self, engine: Engine[Any]) -> tuple[list[list[int]], tuple[int, ...]]:
        """Every input as token ids inside the engine's limit (``embed_limit``): cut to it when
        ``truncate``, else ``ContextLengthExceeded`` naming the input. Also the indices cut."""
        limit = engine.embed_limit
        out: list[list[int]] = []
        cut: list[int] = []
        for i, t in enumerate(self.inputs):
            ids = engine.tokenize(t) if isinstance(t, str) else t
            if limit is not None and len(ids) > limit:
                if not self.truncate:
                    exc = ContextLengthExceeded(len(ids), limit)
                    exc.args = (
                        f"input {i} has {len(ids)} tokens, more than the {limit} {engine.name} embeds "
                        f"at once; shorten it, or pass truncate=True to embed its first {limit} tokens",
                    )
                    raise exc
                ids = ids[:limit]
                cut.append(i)
            out.append(ids)
        return out, tuple(cut)

    def finish(self, raw: Any, prompt_tokens: int, cut: tuple[int, ...]) -> Embeddings:
        """The backend's pooled vectors (rows of floats, any array-like) cut to ``dimensions`` and
        normalized when asked."""
        import numpy as np

        vectors = np.asarray(raw, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] != len(self.inputs):
            raise GenerationError(
                f"the backend returned vectors of shape {vectors.shape} for {len(self.inputs)} inputs"
            )
        width = vectors.shape[1]
        if self.dimensions is not None:
            if self.dimensions > width:
                raise ConfigError(
                    f"dimensions={self.dimensions} is more than the model's {width}; ask for {width} or fewer"
                )
            vectors = vectors[:, : self.dimensions]
        if self.normalize:
            norms = np.sqrt(np.einsum("ij,ij->i", vectors, vectors))
            norms[norms == 0] = 1.0  # a zero vector stays zero
            vectors = vectors / norms[:, None]  # a new, contiguous array
        else:
            vectors = np.ascontiguousarray(vectors)
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=0)
        return Embeddings(vectors, usage, self.pooling, self.normalize, truncated=cut)


def rank(scores: Sequence[float], tokens: int, top_n: Any, n_documents: int) -> Reranked:
    """The documents' ``scores`` as results, most relevant first (ties keep the given order),
    ``top_n`` of them when asked."""
    if len(scores) != n_documents:
        raise ValueError(f"the backend scored {len(scores)} of {n_documents} documents")
    bad = [i for i, s in enumerate(scores) if not math.isfinite(s)]
    if bad:
        raise ValueError(f"the backend gave documents {bad[:5]} no finite score")
    order = sorted(range(n_documents), key=lambda i: -scores[i])
    if top_n is not None:
        order = order[:top_n]
    return Reranked(tuple(Ranked(i, float(scores[i])) for i in order), Usage(tokens, 0))


def check_rerank(engine: Engine[Any], query: Any, documents: Any, top_n: Any) -> list[str]:
    """The query and documents as text, checked; ``top_n`` a positive int or None."""
    check_task(engine, "rerank")
    check_text(query, "the query is")
    if not query:
        raise ConfigError("the query is empty: there is nothing to rank the documents by")
    if isinstance(documents, str) or not isinstance(documents, Sequence):
        raise ConfigError(f"documents is a list of str, got {type(documents).__name__}")
    if not documents:
        raise ConfigError("rerank() was given no documents")
    if len(documents) > _MAX_INPUTS:
        raise ConfigError(f"rerank() takes at most {_MAX_INPUTS} documents a call, got {len(documents)}")
    docs = [check_text(d, f"document {i} is") for i, d in enumerate(documents)]
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise ConfigError(f"top_n is a positive int (how many results to return), got {top_n!r}")
    return docs
