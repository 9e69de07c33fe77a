"""Logprobs in one shape for the built-in engines: the chosen token's, and with ``logprobs=k`` above
0 the k most likely tokens' (``TopLogprobs``), most likely first, ties by the lower id so engines
agree. Always of the model's own distribution: the log-softmax of the raw logits, before
temperature, penalties, bias or a format's mask. numpy is imported at the first call, by a request
that asked for logprobs.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from unillm._logprobs import from_logits, from_logprobs, top_k
from unillm.backend import SamplingParams, TopLogprobs

__all__ = ["MLXLogprobs", "from_logits", "from_logprobs", "from_mlx", "from_vllm", "llama_logprobs", "top_k"]


def llama_logprobs(ctx: Any, n_vocab: int, tok: int, k: int) -> tuple[float, ...] | TopLogprobs:
    """One token's logprobs from a llama.cpp context's last raw logits (``get_logits_ith(-1)``),
    which the sampler chain's penalties, bias and temperature never touch (they work on a copy)."""
    import numpy as np

    return from_logits(np.ctypeslib.as_array(ctx.get_logits_ith(-1), shape=(n_vocab,)), tok, k)


def from_mlx(lp: Any, tok: int, k: int) -> tuple[float, ...] | TopLogprobs:
    """One token's logprobs from mlx-lm's vector of log-probabilities (an ``mx.array``)."""
    if k <= 0:
        return (float(lp[tok].item()),)
    import mlx.core as mx
    import numpy as np

    return from_logprobs(np.array(lp.astype(mx.float32)), tok, k)


class MLXLogprobs:
    """A request's logprobs on MLX. mlx-lm takes its logprobs after the logits processors (the
    penalties): when a request has both, a first processor keeps each step's log-softmax of the
    raw logits (evaluated there: a sync per token, for these requests only), read in order
    (mlx-lm runs a step ahead of the token it hands out, so two may be waiting). Not with a draft
    model, whose verify step runs the processors over several positions: there the reported,
    penalised ones stay."""

    __slots__ = ("k", "processors", "raw")

    def __init__(self, params: SamplingParams, processors: list[Any] | None, *, draft: bool = False) -> None:
        self.k = params.logprobs or 0
        tap = processors and params.logprobs is not None and not draft
        self.raw: deque[Any] | None = deque() if tap else None
        self.processors = [self._keep, *processors] if tap and processors else processors

    def _keep(self, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx

        assert self.raw is not None
        raw = logits.astype(mx.float32)  # a new array: the repetition penalty assigns into logits
        lp = (raw - mx.logsumexp(raw, axis=-1, keepdims=True))[0]
        # evaluated here, on mlx-lm's stream: the thread that reads it has no such stream
        mx.eval(lp)
        self.raw.append(lp)
        return logits

    def __call__(self, reported: Any, tok: int) -> tuple[float, ...] | TopLogprobs:
        return from_mlx(reported if self.raw is None else self.raw.popleft(), tok, self.k)


def from_vllm(steps: Any, ids: tuple[int, ...], k: int) -> tuple[float, ...] | TopLogprobs:
    """A vLLM delta's logprobs: per token a dict ``{id: Logprob}`` of the top k plus the chosen
    one (k + 1 entries when the chosen is outside them). ``top`` gets exactly the top k."""
    chosen = tuple(step[t].logprob for step, t in zip(steps, ids, strict=False))
    if k <= 0:
        return chosen
    top = tuple(
        tuple(sorted(((int(t), float(p.logprob)) for t, p in step.items()), key=_best_first)[:k])
        for step in steps[: len(chosen)]
    )
    return TopLogprobs(chosen, top)


def _best_first(pair: tuple[int, float]) -> tuple[float, int]:
    return -pair[1], pair[0]
