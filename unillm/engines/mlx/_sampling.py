"""The MLX backend's sampling: unillm's ``SamplingParams`` as mlx-lm's sampler and logits processors.

A seeded request draws from its own random key, so its tokens do not depend on what else runs in
the batch. Used by ``unillm.engines.mlx`` only (after mlx-lm is imported); it does not import
that module.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from unillm.backend import SamplingParams, TopLogprobs, logprobs_from_logprobs

__all__ = ["MLXLogprobs", "processors", "sampler"]


def sampler(mx: Any, params: SamplingParams, default_seed: int | None) -> Any:
    """mlx-lm's sampling chain for ``params``, with ``logit_bias`` applied where tokens are drawn."""
    chain = _chain(mx, params, default_seed)
    if not params.logit_bias:
        return chain
    # The bias applies where tokens are drawn, not as a logits processor: mlx-lm reports the
    # logprobs its processors return, and a logprob means the model's own distribution on
    # every backend (llama.cpp's and vLLM's are taken before the bias too).
    idx = mx.array([int(k) for k in params.logit_bias])
    val = mx.array([float(v) for v in params.logit_bias.values()])

    def biased(logprobs: Any) -> Any:
        return chain(logprobs.at[..., idx].add(val))

    return biased


def _chain(mx: Any, params: SamplingParams, default_seed: int | None) -> Any:
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

    temp = params.temperature
    seed = params.seed if params.seed is not None else default_seed
    if temp == 0.0 or seed is None:
        return make_sampler(
            temp=temp,
            top_p=params.top_p if params.top_p < 1.0 else 0.0,
            min_p=params.min_p,
            top_k=params.top_k or 0,
        )
    filters: list[Any] = []
    if params.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p > 0.0:
        filters.append(lambda x: apply_min_p(x, params.min_p, 1))
    if params.top_k:
        filters.append(lambda x: apply_top_k(x, params.top_k))
    key = [mx.random.key(seed)]

    def sample(logprobs: Any) -> Any:
        for f in filters:
            logprobs = f(logprobs)
        key[0], sub = mx.random.split(key[0])
        return mx.random.categorical(logprobs * (1.0 / temp), key=sub)

    return sample


def processors(params: SamplingParams) -> list[Any] | None:
    """mlx-lm's logits processors for the penalties (over the last 64 tokens), or None."""
    from mlx_lm.sample_utils import make_logits_processors

    penalties = params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
    if not penalties:
        return None
    return make_logits_processors(
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        repetition_context_size=64,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=64,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=64,
    )


def from_mlx(lp: Any, tok: int, k: int) -> tuple[float, ...] | TopLogprobs:
    """One token's logprobs from mlx-lm's vector of log-probabilities (an ``mx.array``)."""
    if k <= 0:
        return (float(lp[tok].item()),)
    import mlx.core as mx
    import numpy as np

    return logprobs_from_logprobs(np.array(lp.astype(mx.float32)), tok, k)


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
