"""Embeddings on llama.cpp: a context made for them (``embedding=True`` and the pooling), fed token
ids many sequences to a ``llama_decode``, each sequence's pooled vector read back.

The context pools (llama.cpp's ``pooling_type``, fixed when it is made) and holds one batch of
``n_batch`` tokens: the load sets ``n_batch`` and ``n_ubatch`` to the context, so any input up to
the context fits one decode, and packs as many inputs into each decode as fit it and the
context's sequence slots (``n_seq_max``), the way llama-cpp-python's own ``Llama.embed`` does.

Used by ``unillm.engines.llamacpp`` only; it does not import that module.
"""

from __future__ import annotations

from typing import Any

from unillm import ConfigError
from unillm.backend import GGUF_POOLING

__all__ = ["checked_task", "embed_batch", "embed_kwargs"]


def embed_kwargs(llama_cpp: Any, pooling: str, n_ctx: int) -> dict[str, Any]:
    """``Llama()``'s keywords for an embedding context pooling by ``pooling``."""
    return {"embedding": True, "pooling_type": GGUF_POOLING[pooling], "n_batch": n_ctx, "n_ubatch": n_ctx}


def checked_task(task: str, model: str, draft_model: str | None) -> str:
    """The task the engine loads for, refused where llama.cpp cannot serve it through unillm:
    rerank (llama.cpp scores with rank pooling only where its graph for the architecture builds a
    classification head, BERT-family and Qwen3 rerankers, which unillm does not drive yet), and
    embeddings with a draft model (which speeds up generation only)."""
    if task == "rerank":
        raise ConfigError(
            f"unillm does not run rerankers on llama.cpp yet: load {model!r} with task='rerank' on "
            "vLLM (its HF directory), or embed with task='embed' (docs/embeddings.md#rerank)"
        )
    if task == "embed" and draft_model:
        raise ConfigError("draft_model speeds up generation; an embedding engine (task='embed') takes none")
    return task


def embed_batch(llama_cpp: Any, llm: Any, batch: list[list[int]]) -> Any:
    """The pooled vectors of ``batch`` (float32 numpy rows, in order) from the embedding context."""
    import numpy as np

    ctx, b = llm._ctx, llm._batch
    n_embd, n_batch = llm.n_embd(), llm.n_batch
    n_seq_max = llm.context_params.n_seq_max
    out = np.empty((len(batch), n_embd), dtype=np.float32)
    done = 0  # inputs whose vectors are in out
    seqs = tokens = 0  # in the decode being packed

    def decode() -> None:
        nonlocal done
        ctx.kv_cache_clear()
        ctx.decode(b)
        b.reset()
        for s in range(seqs):
            ptr = llama_cpp.llama_get_embeddings_seq(ctx.ctx, s)
            if not ptr:
                raise RuntimeError(f"llama.cpp returned no pooled vector for sequence {s}")
            out[done + s] = np.ctypeslib.as_array(ptr, shape=(n_embd,))
        done += seqs

    b.reset()
    for ids in batch:
        if seqs and (tokens + len(ids) > n_batch or seqs >= n_seq_max):
            decode()
            seqs = tokens = 0
        b.add_sequence(ids, seqs, True)  # every token an output: llama.cpp's embedding mode asks it
        seqs += 1
        tokens += len(ids)
    if seqs:
        decode()
    return out
