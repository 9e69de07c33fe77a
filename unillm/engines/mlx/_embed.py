"""Embeddings on MLX: the model's final hidden states (after its last norm), pooled here.

mlx-lm's causal LMs keep their transformer as ``model.model``, whose output is the final hidden
state; inputs of a batch are right-padded (causal attention: a position never sees the padding
after it), grouped by length so padding stays small, and pooled per input (mean over its tokens,
its last token's state, or its first's).

Used by ``unillm.engines.mlx`` only; it does not import that module.
"""

from __future__ import annotations

from typing import Any

__all__ = ["embed_batch", "transformer"]

#: Padded tokens one forward pass takes at most (inputs are grouped under it, longest first).
_TOKENS_PER_PASS = 8192
#: The most padding a group carries, as a share of its tokens: on the CPU a padded token costs what
#: a real one does, so inputs of very different lengths run in groups of their own (measured on
#: the tiny bench model: 4 inputs of 25 to 267 tokens padded into one pass ran at 55 real tokens/s,
#: one at a time at 96; grouped, 68: docs/benchmarks.md)
_MAX_PADDING = 0.25


def transformer(model: Any) -> Any:
    """The part of an mlx-lm model that returns final hidden states, or None."""
    inner = getattr(model, "model", None)
    return inner if callable(inner) else None


def embed_batch(mx: Any, inner: Any, batch: list[list[int]], pooling: str) -> Any:
    """The pooled vectors of ``batch`` (float32 numpy rows, in the batch's order)."""
    import numpy as np

    order = sorted(range(len(batch)), key=lambda i: -len(batch[i]))
    out: list[Any] = [None] * len(batch)
    start = 0
    while start < len(order):
        group = _group(batch, order, start)
        start += len(group)
        width = len(batch[group[0]])
        ids = np.zeros((len(group), width), dtype=np.int32)
        for r, i in enumerate(group):
            ids[r, : len(batch[i])] = batch[i]
        hidden = inner(mx.array(ids)).astype(mx.float32)
        if pooling == "mean":
            lengths = np.array([len(batch[i]) for i in group], dtype=np.float32)
            mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.float32)
            pooled = (hidden * mx.array(mask)[:, :, None]).sum(axis=1) / mx.array(lengths)[:, None]
        elif pooling == "cls":
            pooled = hidden[:, 0, :]
        else:
            last = mx.array(np.array([len(batch[i]) - 1 for i in group], dtype=np.int32))
            pooled = hidden[mx.arange(len(group)), last, :]
        vectors = np.array(pooled, copy=False)
        for r, i in enumerate(group):
            out[i] = vectors[r]
    return np.stack(out)


def _group(batch: list[list[int]], order: list[int], start: int) -> list[int]:
    """The inputs (indices, longest first) of the pass that starts at ``order[start]``: as many as
    fit ``_TOKENS_PER_PASS`` padded to the first one's length with at most ``_MAX_PADDING`` padding."""
    width = len(batch[order[start]])
    group, real = [order[start]], width
    for i in order[start + 1 :]:
        n = len(group) + 1
        if n * width > _TOKENS_PER_PASS or (n * width - real - len(batch[i])) > _MAX_PADDING * n * width:
            break
        group.append(i)
        real += len(batch[i])
    return group
