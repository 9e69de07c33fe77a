"""``unillm serve``'s ``/v1/embeddings`` and rerank routes end to end: one real server (started
once, from a config file) serving the tiny last-pooling embedding GGUF and the tiny generative
GGUF on llama.cpp, spoken to by the official ``openai`` client, LangChain's ``OpenAIEmbeddings``
and httpx; its vectors equal the in-process engine's on the same GGUF. The key and body limits on
these routes are checked in-process through the ASGI app; ``--task`` and ``--pooling`` through the
CLI with the loader stubbed.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from typer.testing import CliRunner

import unillm
from unillm.cli import app
from unillm.server import Pool, ServerConfig, create_app, model_spec
from unillm.testing import MockEngine, TinyModel, tiny_embedding_model

from ._server_util import Server, metric, metrics, start_server, wait_until
from .conftest import HAS_LLAMA_CPP

pytestmark = pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed")

EMBED, GEN = "embed", "tiny"
KEY = "sk-unillm-embed-key"
#: texts of 1 to ~150 tokens, ASCII and not
TEXTS = [
    "a",
    "Hello, world!",
    "Why is the sky blue? Because air scatters blue light more than red light.",
    "Once upon a time, there was a small model that wanted to tell stories. " * 6,
    "ünïcödé ✓ 中文 🙂",
]
LIMIT = 4096  # what llama.cpp embeds at once from the tiny model (its trained context)
NOT_A_RERANKER = "a generic embedding model is not a reranker"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return tiny_embedding_model("last", cache_dir=tmp_path_factory.mktemp("embed"))


@pytest.fixture(scope="module")
def server(model: TinyModel, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The embedding model and a generative one side by side (each loads in a fraction of a second)."""
    config = tmp_path_factory.mktemp("server") / "server.toml"
    config.write_text(
        f'[models.{EMBED}]\nmodel = {json.dumps(str(model.gguf_path))}\nbackend = "llama.cpp"\n\n'
        f'[models.{GEN}]\nmodel = {json.dumps(str(tiny_gguf))}\nbackend = "llama.cpp"\n'
    )
    s = start_server(["--config", str(config)])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(model: TinyModel) -> Iterator[Any]:
    """The in-process engine on the same GGUF, whose vectors the server's must equal."""
    with unillm.load_engine({"model": str(model.gguf_path), "backend": "llama.cpp"}) as e:
        assert e.task == "embed"
        yield e


def _same(got: Any, want: Any) -> None:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.min() >= 0.9999, cos
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def _vectors(r: Any) -> list[list[float]]:
    assert [d.index for d in r.data] == list(range(len(r.data)))
    return [d.embedding for d in r.data]


# ---- /v1/embeddings with the official client ----


def test_the_clients_base64_default_and_floats_both_equal_the_engine(oai: openai.OpenAI, engine: Any) -> None:
    want = engine.embed(TEXTS)
    assert want.dimensions == 128 and want.usage.prompt_tokens > len(TEXTS)
    default = oai.embeddings.create(model=EMBED, input=TEXTS)  # the client asks base64 and decodes
    floats = oai.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
    for r in (default, floats):
        assert r.model == EMBED and r.object == "list"
        assert (r.usage.prompt_tokens, r.usage.total_tokens) == (want.usage.prompt_tokens,) * 2
        _same(_vectors(r), want.array())
    assert _vectors(default) == _vectors(floats)  # the same float32s, however they travel


def test_base64_is_little_endian_float32(server: Server, engine: Any) -> None:
    ask = {"model": EMBED, "input": TEXTS[1], "encoding_format": "base64"}
    r = httpx.post(server.v1 + "/embeddings", json=ask)
    assert r.status_code == 200, r.text
    (item,) = r.json()["data"]
    assert isinstance(item["embedding"], str) and item["object"] == "embedding"
    decoded = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
    _same([decoded], engine.embed(TEXTS[1]).array())


def test_token_ids_embed_as_their_text(oai: openai.OpenAI, engine: Any) -> None:
    ids = [engine.tokenize(t) for t in TEXTS[:3]]
    want = engine.embed(TEXTS[:3]).array()
    _same(_vectors(oai.embeddings.create(model=EMBED, input=ids)), want)
    one = oai.embeddings.create(model=EMBED, input=ids[2])  # one list of ids is one input
    _same(_vectors(one), want[2:])
    assert one.usage.prompt_tokens == len(ids[2])


def test_a_batch_equals_its_inputs_one_at_a_time(oai: openai.OpenAI) -> None:
    batch = _vectors(oai.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float"))
    alone = [_vectors(oai.embeddings.create(model=EMBED, input=t, encoding_format="float"))[0] for t in TEXTS]
    _same(batch, alone)


def test_dimensions_keeps_the_leading_ones_normalized(oai: openai.OpenAI, engine: Any) -> None:
    r = oai.embeddings.create(model=EMBED, input=TEXTS, dimensions=32)
    got = np.asarray(_vectors(r))
    assert got.shape == (len(TEXTS), 32)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)
    _same(got, engine.embed(TEXTS, dimensions=32).array())
    with pytest.raises(openai.BadRequestError, match="more than the model's 128") as err:
        oai.embeddings.create(model=EMBED, input="a", dimensions=129)
    assert err.value.body["param"] == "dimensions"  # type: ignore[index]


def test_refusals_are_400s_that_say_why(oai: openai.OpenAI, server: Server, engine: Any) -> None:
    for empty in ("", [], ["a", ""]):
        with pytest.raises(openai.BadRequestError, match="empty") as err:
            oai.embeddings.create(model=EMBED, input=empty)
        assert err.value.body["param"] == "input"  # type: ignore[index]
    long = "x" * (LIMIT + 100)
    assert len(engine.tokenize(long)) > LIMIT
    with pytest.raises(openai.BadRequestError, match=f"more than the {LIMIT}") as err:
        oai.embeddings.create(model=EMBED, input=["a", long])
    assert err.value.code == "context_length_exceeded" and "input 1" in err.value.message
    assert '"truncate": true' in err.value.message  # the body's knob, not the Python one
    # "truncate": true (Hugging Face TEI's field) embeds its first LIMIT tokens instead
    cut = oai.embeddings.create(model=EMBED, input=long, extra_body={"truncate": True})
    assert cut.usage.prompt_tokens == LIMIT
    _same(_vectors(cut), engine.embed(long, truncate=True).array())
    with pytest.raises(openai.NotFoundError, match="does not exist; this server serves: embed, tiny"):
        oai.embeddings.create(model="no-such", input="a")
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        oai.embeddings.create(model=EMBED, input=[[1, 2], [10**6]])
    r = httpx.post(server.v1 + "/embeddings", json={"model": EMBED, "input": ["a", 1]})
    assert r.status_code == 400 and "a list of token ids" in r.json()["error"]["message"]
    r = httpx.post(server.v1 + "/embeddings", json={"model": EMBED, "input": "a", "pooling": "mean"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"


def test_a_generation_model_says_how_to_load_for_embed(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="loaded for generate") as err:
        oai.embeddings.create(model=GEN, input="a")
    assert "task='embed'" in err.value.message and "--task embed" in err.value.message
    assert err.value.body["param"] == "model"  # type: ignore[index]


def test_models_lists_each_ones_task_and_pooling(server: Server) -> None:
    listed = {m["id"]: m for m in httpx.get(server.v1 + "/models").json()["data"]}
    assert (listed[EMBED]["task"], listed[EMBED]["pooling"]) == ("embed", "last")
    assert (listed[GEN]["task"], listed[GEN]["pooling"]) == ("generate", None)


def test_embeddings_count_in_the_metrics(server: Server, oai: openai.OpenAI) -> None:
    before = metrics(server.url)
    r = oai.embeddings.create(model=EMBED, input=TEXTS[:2])
    with pytest.raises(openai.NotFoundError):
        oai.embeddings.create(model="no-such", input="a")
    labels = {"model_name": EMBED, "backend": "llama.cpp"}

    def grown() -> Any:
        after = metrics(server.url)
        ok = metric(after, "unillm:requests_total", route="/v1/embeddings", status="200")
        gone = metric(after, "unillm:requests_total", route="/v1/embeddings", status="404")
        was = metric(before, "unillm:requests_total", route="/v1/embeddings", status="200")
        was_gone = metric(before, "unillm:requests_total", route="/v1/embeddings", status="404")
        return after if (ok - was, gone - was_gone) == (1, 1) else None

    after = wait_until(grown, 10, "the embeddings requests to be counted")  # counted as they end
    for name, grew in (("unillm:prompt_tokens_total", r.usage.prompt_tokens),
                       ("unillm:e2e_request_latency_seconds_count", 1)):  # fmt: skip
        assert metric(after, name, **labels) - metric(before, name, **labels) == grew, name


# ---- LangChain ----


def test_langchain_openai_embeddings(server: Server, engine: Any) -> None:
    OpenAIEmbeddings = pytest.importorskip("langchain_openai").OpenAIEmbeddings

    # check_embedding_ctx_length=False: by default LangChain first tokenizes with tiktoken, which
    # downloads its encoding from the internet (not reachable here); the server counts the
    # tokens and refuses an input too long itself
    lc = OpenAIEmbeddings(model=EMBED, base_url=server.v1, api_key="unused",  # type: ignore[arg-type]
                          check_embedding_ctx_length=False, max_retries=0)  # fmt: skip
    _same(lc.embed_documents(TEXTS), engine.embed(TEXTS).array())
    _same([lc.embed_query(TEXTS[2])], engine.embed(TEXTS[2]).array())


# ---- rerank: Cohere's and Jina's shape ----


def test_rerank_on_an_embedding_model_is_a_400_not_made_up_scores(server: Server) -> None:
    documents = ["Paris is the capital of France.", "Berlin is in Germany."]
    cohere = {"model": EMBED, "query": "What is the capital of France?", "documents": documents, "top_n": 1}
    jina = {**cohere, "documents": [{"text": d} for d in documents], "return_documents": True}
    for route, body in (("/v2/rerank", cohere), ("/v1/rerank", jina), ("/rerank", cohere)):
        r = httpx.post(server.url + route, json=body, timeout=30)
        assert r.status_code == 400, (route, r.text)
        error = r.json()["error"]
        assert NOT_A_RERANKER in error["message"] and "task='rerank'" in error["message"], error
        assert error["param"] == "model" and "results" not in r.json()
    r = httpx.post(server.url + "/v2/rerank", json={**cohere, "model": "no-such"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(server.url + "/v2/rerank", json={**cohere, "documents": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
    after = metrics(server.url)
    assert metric(after, "unillm:requests_total", route="/v2/rerank", status="400") >= 2


class _WordReranker(MockEngine):
    """A reranker for the routes' shapes: a document's score is the query words it holds."""

    task = "rerank"

    def _rerank(self, query: str, documents: list[str]) -> tuple[list[float], int]:
        words = set(query.lower().split())
        scores = [float(len(words & set(d.lower().split()))) for d in documents]
        return scores, sum(len(d.split()) + len(words) for d in documents)


def test_a_reranker_answers_in_cohere_and_jinas_shape() -> None:
    """The answer's shape on a reranker (an in-process stub: llama.cpp and MLX rerank nothing
    yet): results most relevant first, each document's text when asked, usage and meta."""
    cfg = ServerConfig(models=(model_spec("r", {"model": "r"}),), lazy=True, access_log=False)
    pool = Pool(cfg, loader=lambda config: _WordReranker(config).load())
    asgi = create_app(cfg, pool=pool)
    docs = ["the cat sat", "a dog ran far", "the cat and the dog"]

    async def main() -> None:
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://u") as c:
                r = await c.post("/v2/rerank", json={"model": "r", "query": "the dog", "documents": docs})
                assert r.status_code == 200, r.text
                got = r.json()
                assert got["model"] == "r" and got["id"].startswith("rerank-")
                assert [(x["index"], x["relevance_score"]) for x in got["results"]] == [
                    (2, 2.0),
                    (0, 1.0),
                    (1, 1.0),
                ]
                assert [x["document"]["text"] for x in got["results"]] == [docs[2], docs[0], docs[1]]
                tokens = sum(len(d.split()) + 2 for d in docs)
                assert got["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
                assert got["meta"] == {"billed_units": {"input_tokens": tokens}}
                jina = {"model": "r", "query": "the dog", "documents": [{"text": d} for d in docs],
                        "top_n": 1, "return_documents": False}  # fmt: skip
                r = await c.post("/v1/rerank", json=jina)
                assert r.status_code == 200 and r.json()["results"] == [{"index": 2, "relevance_score": 2.0}]
                r = await c.post("/v1/rerank", json={**jina, "query": ""})
                assert r.status_code == 400 and r.json()["error"]["param"] == "query"
                r = await c.post("/v1/embeddings", json={"model": "r", "input": "a"})
                assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        finally:
            await pool.close()

    asyncio.run(main())


# ---- the edge, in-process: the key and the body limit hold on these routes ----


def test_the_key_and_the_body_limit_guard_embeddings_and_rerank(model: TinyModel) -> None:
    spec = model_spec(EMBED, {"model": str(model.gguf_path), "backend": "llama.cpp"})
    cfg = ServerConfig(models=(spec,), lazy=True, access_log=False, api_key=KEY, max_body_bytes=4096)
    pool = Pool(cfg)
    asgi = create_app(cfg, pool=pool)
    auth = {"Authorization": f"Bearer {KEY}"}
    ask = {"model": EMBED, "input": "a"}
    rank = {"model": EMBED, "query": "q", "documents": ["d"]}

    async def main() -> None:
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://u") as c:
                for route, body in (("/v1/embeddings", ask), ("/v2/rerank", rank)):
                    r = await c.post(route, json=body)
                    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
                    r = await c.post(route, json={**body, "user": "x" * 5000}, headers=auth)
                    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
                assert (await c.post("/v1/embeddings", json=ask, headers=auth)).status_code == 200
                assert (await c.post("/v2/rerank", json=rank, headers=auth)).status_code == 400
        finally:
            await pool.close()

    asyncio.run(main())


# ---- unillm serve --task / --pooling ----


def test_serve_passes_task_and_pooling_into_the_engine_config(
    model: TinyModel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import unillm.cli._serve as serve

    loaded: list[Any] = []

    def load(config: Any) -> Any:
        loaded.append(config)
        return MockEngine()

    monkeypatch.setattr(serve, "_load", load)
    monkeypatch.setattr(serve, "_run", lambda cfg, pool, sock, family: sock.close())
    runner = CliRunner()
    out = runner.invoke(app, ["serve", str(model.gguf_path), "--task", "embed", "--pooling", "mean",
                              "--port", "0"])  # fmt: skip
    assert out.exit_code == 0, out.output
    assert (loaded[0].task, loaded[0].pooling) == ("embed", "mean")
    out = runner.invoke(app, ["serve", str(model.gguf_path), "--task", "classify"])
    assert out.exit_code == 2 and "classify" in out.output
    config = tmp_path / "server.toml"
    config.write_text(f"[models.m]\nmodel = {json.dumps(str(model.gguf_path))}\n")
    out = runner.invoke(app, ["serve", "--config", str(config), "--task", "embed"])
    assert out.exit_code == 2 and "go with MODEL" in out.output
