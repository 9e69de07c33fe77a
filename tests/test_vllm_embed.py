"""Embeddings and rerank on vLLM's pooling runner (the CPU build): two engine starts of their own,
because vLLM runs a model for generation or for pooling, fixed when it starts (the session's
generation engine cannot embed). The same vectors as llama.cpp on the same weights, batched or one
at a time, sync and async; rerank scores equal to the score head over another engine's hidden
state; refusals (too long, dimensions past the model, generation on an embedding engine)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import HAS_LLAMA_CPP, HAS_VLLM
from unillm import ConfigError, ContextLengthExceeded, load_engine
from unillm.testing import TinyModel, check_parity, tiny_reranker_model
from unillm.testing._tiny_embed import score_head

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not (HAS_VLLM and HAS_LLAMA_CPP), reason="needs vllm and llama-cpp-python"),
]

#: as the session's engine (tests/conftest.py): eager (no torch.compile), a small KV cache
OPTIONS = {"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20, "max_num_seqs": 16}
TEXTS = [
    "a",
    "Hello, world!",
    "Why is the sky blue? Because air scatters blue light more than red light.",
    "Once upon a time, there was a small model that wanted to tell stories. " * 6,
    "ünïcödé ✓ 中文 🙂",
]


@pytest.fixture(scope="module")
def vllm_embed(vllm_embed_engine: Any) -> Any:
    return vllm_embed_engine


@pytest.fixture(scope="module")
def llama_embed(embed_last: TinyModel) -> Iterator[Any]:
    config = {"model": str(embed_last.gguf_path), "backend": "llama.cpp", "context_length": 256}
    with load_engine(config) as e:
        yield e


def test_loads_for_embed_from_the_model_files(vllm_embed: Any) -> None:
    assert (vllm_embed.task, vllm_embed.pooling) == ("embed", "last")
    assert vllm_embed.engine_args["runner"] == "pooling"
    assert vllm_embed.engine_args["pooler_config"] == {"pooling_type": "LAST", "use_activation": False}


def test_same_vectors_as_llamacpp_batched_or_one_at_a_time(vllm_embed: Any, llama_embed: Any) -> None:
    check_parity({"llama.cpp": llama_embed, "vllm": vllm_embed}, TEXTS).assert_parity()
    batch = vllm_embed.embed(TEXTS, normalize=False).array()
    one = np.stack([vllm_embed.embed(t, normalize=False).array()[0] for t in TEXTS])
    assert np.abs(batch - one).max() < 1e-4
    # vLLM's own normalization is off: the raw vectors are the engine's, unillm normalizes
    assert np.abs(np.linalg.norm(batch, axis=1) - 1).max() > 0.01
    theirs = llama_embed.embed(TEXTS, normalize=False).array()
    assert np.abs(batch - theirs).max() / np.abs(theirs).max() < 1e-3


def test_async_dimensions_and_limits(vllm_embed: Any, llama_embed: Any) -> None:
    got = asyncio.run(vllm_embed.aembed(TEXTS, dimensions=16))
    want = llama_embed.embed(TEXTS, dimensions=16).array()
    assert got.array().shape == (len(TEXTS), 16)
    assert (got.array() * want).sum(1).min() >= 0.999
    long = "the quick brown fox jumps over the lazy dog " * 80
    with pytest.raises(ContextLengthExceeded, match="truncate=True"):
        vllm_embed.embed(long)
    assert vllm_embed.embed(long, truncate=True).truncated == (0,)
    with pytest.raises(ConfigError, match="loaded for embed; load the model with task='generate'"):
        vllm_embed.generate("hi", max_tokens=2)
    with pytest.raises(ConfigError, match="load the model with pooling='mean'"):
        vllm_embed.embed("a", pooling="mean")


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    path = tiny_reranker_model(cache_dir=tmp_path_factory.mktemp("rerank"))
    with load_engine({"model": str(path), "backend": "vllm", "context_length": 256, "options": OPTIONS}) as e:
        yield e, path


def test_rerank_scores_are_the_score_head_over_the_last_state(
    reranker: tuple[Any, Path], llama_embed: Any
) -> None:
    engine, path = reranker
    assert engine.task == "rerank" and engine.engine_args["convert"] == "classify"
    query = "What is the capital of France?"
    docs = ["Paris is the capital of France.", "Why is the sky blue?", "0 1 2 3", "Hello, world!"]
    ranked = engine.rerank(query, docs)
    assert sorted(r.index for r in ranked) == [0, 1, 2, 3]
    scores = [r.score for r in ranked]
    assert scores == sorted(scores, reverse=True)
    # the same weights on llama.cpp (an embedding load, last pooling, unnormalized) times the head:
    # the pair is the tokenizer's pair template (this tokenizer joins the two as they are)
    head = score_head(path)
    pairs = [llama_embed.tokenize(query) + llama_embed.tokenize(d) for d in docs]
    want = llama_embed.embed(pairs, normalize=False).array() @ head
    got = dict((r.index, r.score) for r in ranked)
    assert np.allclose([got[i] for i in range(4)], want, rtol=1e-3, atol=1e-4)
    assert ranked.usage.prompt_tokens == sum(map(len, pairs))
    top = engine.rerank(query, docs, top_n=2)
    assert [r.index for r in top] == [r.index for r in ranked][:2]
    with pytest.raises(ConfigError, match="not a reranker"):
        llama_embed.rerank(query, docs)
    with pytest.raises(ConfigError, match="top_n is a positive int"):
        engine.rerank(query, docs, top_n=0)


def test_the_server_serves_the_reranker_in_cohere_and_jinas_shape(reranker: tuple[Any, Path]) -> None:
    """unillm serve's app over this (already started) reranker: /v2/rerank in Cohere's shape,
    /v1/rerank with top_n in Jina's, the engine's own scores; an embeddings request is a 400."""
    import httpx

    from unillm.server import Pool, ServerConfig, create_app, model_spec

    engine, path = reranker
    cfg = ServerConfig(models=(model_spec("rr", {"model": str(path), "backend": "vllm"}),), lazy=True)
    app = create_app(cfg, pool=Pool(cfg, loader=lambda config: engine))  # the pool is never closed:
    query = "What is the capital of France?"  # the module's fixture closes the engine
    docs = ["Paris is the capital of France.", "Why is the sky blue?", "0 1 2 3", "Hello, world!"]
    want = engine.rerank(query, docs)

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://u") as c:
            r = await c.post("/v2/rerank", json={"model": "rr", "query": query, "documents": docs})
            assert r.status_code == 200, r.text
            got = r.json()
            assert [(x["index"], x["relevance_score"]) for x in got["results"]] == [
                (w.index, pytest.approx(w.score, rel=1e-5)) for w in want
            ]
            assert [x["document"]["text"] for x in got["results"]] == [docs[w.index] for w in want]
            assert got["meta"]["billed_units"]["input_tokens"] == want.usage.prompt_tokens
            jina = {"model": "rr", "query": query, "documents": [{"text": d} for d in docs], "top_n": 2}
            r = await c.post("/v1/rerank", json=jina)
            assert [x["index"] for x in r.json()["results"]] == [w.index for w in want][:2]
            r = await c.post("/v1/embeddings", json={"model": "rr", "input": "a"})
            assert r.status_code == 400 and "task='embed'" in r.json()["error"]["message"]

    asyncio.run(main())
