"""Batched MLX keeps the caches of several finished sequences, so users who take turns each find
their own prefix (one kept cache served only whoever finished last)."""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import pytest

from unillm import SamplingParams
from unillm.testing import TinyModel

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="mlx-lm is not installed")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
#: two users' conversations, no token in common at the start
USERS = [
    "Once upon a time, there was a small model that wanted to tell stories about the sea.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29",
]


def _engine(tiny: TinyModel, context_length: int) -> Any:
    from unillm.engines.mlx import MLXEngine

    return MLXEngine(model=str(tiny.hf_dir), context_length=context_length, options={"batch_size": 4})


def test_users_taking_turns_each_reuse_their_own_prefix(tiny: TinyModel) -> None:
    with _engine(tiny, 512) as mlx:
        firsts = [mlx.generate(u, GREEDY) for u in USERS]  # A then B: both kept
        assert [f.usage.cached_prompt_tokens for f in firsts] == [0, 0]
        for user, first in zip(USERS, firsts, strict=True):
            ids = [*mlx.tokenize(user), *first.token_ids]
            turn = mlx.generate([*ids, *mlx.tokenize(" and then")], GREEDY)
            # the whole first exchange is reused, not just the last user's
            assert turn.usage.cached_prompt_tokens == len(ids), user
        # reuse changes nothing in what is generated: the same turns on a fresh engine
        with _engine(tiny, 512) as fresh:
            for user, first in zip(USERS, firsts, strict=True):
                prompt = [*mlx.tokenize(user), *first.token_ids, *mlx.tokenize(" and then")]
                fresh.reset()
                assert fresh.generate(prompt, GREEDY).token_ids == mlx.generate(prompt, GREEDY).token_ids
        assert mlx.kv_stats().prefix_cache_hits


def test_kept_caches_stay_within_one_context(tiny: TinyModel) -> None:
    """The kept caches hold at most one context's worth of tokens together: the memory a single
    kept cache could take before, which the planner's estimate covers."""
    with _engine(tiny, 64) as mlx:
        a, b = (mlx.tokenize(u)[:24] for u in USERS)
        mlx.generate(a, GREEDY)
        mlx.generate(b, GREEDY)  # 32 + 32 tokens: both fit in 64
        assert mlx.kv_stats().used_tokens <= 64
        assert mlx.generate(a, GREEDY).usage.cached_prompt_tokens == len(a) - 1
        mlx.reset()
        mlx.generate([*a, *a], GREEDY)  # 56 tokens
        mlx.generate([*b, *b], GREEDY)  # 56 more: the older one goes
        assert mlx.kv_stats().used_tokens <= 64
        assert mlx.generate([*b, *b], GREEDY).usage.cached_prompt_tokens == 2 * len(b) - 1
        assert mlx.generate([*a, *a], GREEDY).usage.cached_prompt_tokens == 0


def test_concurrent_users_find_their_prefixes(tiny: TinyModel) -> None:
    """Four users at once, twice: the second round reuses each user's first exchange."""
    prompts = [f"User {i} asks: tell me a story about the number {i} and the sea" for i in range(4)]

    async def round_(ps: list[Any]) -> list[Any]:
        return list(await asyncio.gather(*(mlx.agenerate(p, GREEDY) for p in ps)))

    with _engine(tiny, 512) as mlx:
        first = asyncio.run(round_(prompts))
        then = mlx.tokenize(" then")
        follow = [[*mlx.tokenize(p), *f.token_ids, *then] for p, f in zip(prompts, first, strict=True)]
        second = asyncio.run(round_(follow))
        cached = [s.usage.cached_prompt_tokens for s in second]
        assert all(c >= len(mlx.tokenize(p)) for c, p in zip(cached, prompts, strict=True)), cached
