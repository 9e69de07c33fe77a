"""Logprobs from a vector of logits or log-probabilities, in the shape every backend yields: the
chosen token's, and with ``logprobs=k`` above 0 the k most likely (``TopLogprobs``), most likely
first, ties by the lower id so engines agree. Engine-neutral (numpy, imported at the first call);
``unillm.backend`` exports them for plugins as ``logprobs_from_logits`` and ``top_k_logprobs``.
"""

from __future__ import annotations

from typing import Any

from unillm._contract._run import TopLogprobs

__all__ = ["from_logits", "from_logprobs", "top_k"]


def top_k(lp: Any, k: int) -> tuple[tuple[int, float], ...]:
    """The ``k`` largest entries of a 1-D numpy array as ``(index, value)``, largest first, ties by
    the lower index (every entry tied with the k-th is a candidate, so the choice is exact)."""
    import numpy as np

    n = lp.shape[0]
    k = min(k, n)
    if k <= 0:
        return ()
    kth = np.partition(lp, n - k)[n - k]
    idx = np.flatnonzero(lp >= kth)
    vals = lp[idx]
    order = np.lexsort((idx, -vals))[:k]  # by value descending, then by id
    return tuple((int(idx[i]), float(vals[i])) for i in order)


def from_logprobs(lp: Any, tok: int, k: int) -> tuple[float, ...] | TopLogprobs:
    """One token's logprobs from a numpy vector of the model's log-probabilities."""
    chosen = (float(lp[tok]),)
    return TopLogprobs(chosen, (top_k(lp, k),)) if k > 0 else chosen


def from_logits(logits: Any, tok: int, k: int) -> tuple[float, ...] | TopLogprobs:
    """One token's logprobs from a numpy vector of raw logits (log-softmax in float32, as vLLM's)."""
    import numpy as np

    top = logits.max()
    lp = logits - (top + np.log(np.exp(logits - top).sum()))
    if k <= 0:
        return (float(lp[tok]),)
    return from_logprobs(lp, tok, k)
