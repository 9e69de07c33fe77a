"""Embeddings and rerank on vLLM: its pooling runner, started for the task, and the requests.

vLLM runs a model either for generation or for pooling, chosen when the engine starts
(``runner``): an embedding engine starts ``runner="pooling", convert="embed"`` with the pooling
unillm resolved (``pooler_config``, vLLM's own normalization off: unillm normalizes, one rule on
every engine), a reranker ``convert="classify"`` (a one-label ``*ForSequenceClassification``: the
last token's state through the score head, the raw logit). A generation engine says
``runner="generate"``: vLLM would otherwise start a model with sentence-transformers files as a
pooling model. Mean and cls pooling read the whole prompt in one step, so prefix caching (which
would skip part of it) is off and the token budget of a step holds the longest input.

Requests go through ``AsyncLLM.encode`` one per input, all at once: vLLM's scheduler batches them.

Used by ``unillm.engines.vllm`` only; it does not import that module.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence
from typing import Any

from unillm import ConfigError

__all__ = ["encode_all", "pair_prompts", "runner_args"]

_POOLING = {"mean": "MEAN", "last": "LAST", "cls": "CLS"}


def runner_args(
    task: str, pooling: str, max_len: int | None, batched_tokens: int | None
) -> tuple[dict[str, Any], list[str]]:
    """The ``AsyncEngineArgs`` keywords that start vLLM for ``task``, and notes on what they changed."""
    if task == "generate":
        return {"runner": "generate"}, []
    if task == "rerank":
        return {"runner": "pooling", "convert": "classify", "pooler_config": {"use_activation": False}}, []
    args: dict[str, Any] = {
        "runner": "pooling",
        "convert": "embed",
        "pooler_config": {"pooling_type": _POOLING[pooling], "use_activation": False},
    }
    notes = []
    if pooling != "last":  # vLLM pools mean and cls over a prompt read in one step
        args["enable_prefix_caching"] = False
        notes.append(f"prefix caching off: vLLM pools {pooling} over a prompt read whole")
        if max_len is not None and (batched_tokens or 0) < max_len:
            args["max_num_batched_tokens"] = max_len
    return args, notes


async def encode_all(engine: Any, vllm: Any, prompts: Sequence[list[int]], task: str) -> list[Any]:
    """Each prompt's pooled output (a vector for embed, the score logits for classify), in order."""
    params = vllm.PoolingParams(task=task, use_activation=False)

    async def one(ids: list[int]) -> Any:
        out = None
        async for step in engine.encode(vllm.tokens_input(ids), params, request_id=secrets.token_hex(8)):
            out = step  # one output per request: the pooled one, when it finishes
        if out is None:
            raise RuntimeError("vLLM returned no output for an input")
        return out.outputs.data

    return list(await asyncio.gather(*(one(ids) for ids in prompts)))


def pair_prompts(tok: Any, query: str, documents: Sequence[str], limit: int) -> list[list[int]]:
    """The token ids a cross-encoder reads for each (query, document) pair: the tokenizer's own
    pair template, as vLLM's scorer builds it. A pair past the context is refused with the limit."""
    out = []
    for i, doc in enumerate(documents):
        ids = list(tok(text=query, text_pair=doc)["input_ids"])
        if len(ids) > limit:
            raise ConfigError(
                f"the query and document {i} make {len(ids)} tokens, more than the {limit} the "
                "reranker reads; shorten the document"
            )
        out.append(ids)
    return out
