"""Top-k logprobs in one shape on every engine that has them: ``logprobs=k`` gives the chosen
token's logprob and, above 0, the k most likely ``(token_id, logprob)`` per token, best first, ties
by the lower id. Real engines on the tiny model (llama.cpp on its f32 GGUF, MLX single and batched
and vLLM on its HF directory: the same tensors), each opened once for the module; the OpenAI shapes
through a real ``unillm serve`` and the official client.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from unillm import Chunk, SamplingParams, load_engine
from unillm._contract._run import Request, Run, fold
from unillm.backend import TopLogprobs
from unillm.testing import TinyModel

from ._server_util import Server, start_server

HAS = {m: importlib.util.find_spec(m) is not None for m in ("llama_cpp", "mlx_lm", "vllm")}
pytestmark = pytest.mark.skipif(not (HAS["llama_cpp"] and HAS["mlx_lm"]), reason="needs llama.cpp and MLX")

K = 5
PROMPTS = ["The quick brown fox", "Once upon a time", "0 1 2 3 4 5", "Why is the sky blue?"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=K)
# The largest difference between two engines' logprob of the same token at the same step, on these
# prompts' greedy paths, top 5 (2026-12-01): 3.2e-3 nats between llama.cpp and MLX or vLLM
# (llama.cpp keeps its KV cache in f16 by default, the likely cause), 8.6e-6 between MLX and vLLM,
# 0 between MLX single and batched. About 5x the largest.
TOLERANCE = 1.5e-2
ENGINES = ["llama.cpp", "mlx-single", "mlx-batched", "vllm"]


def _open(name: str, tiny: TinyModel) -> Any:
    if name == "llama.cpp":
        spec = {
            "model": str(tiny.gguf_path),
            "backend": "llama.cpp",
            "backend_options": {"llama.cpp": {"n_threads": 2}},
        }
    else:
        spec = {"model": str(tiny.hf_dir), "backend": "mlx",
                "backend_options": {"mlx": {"batch_size": 8 if name == "mlx-batched" else 1}}}  # fmt: skip
    return load_engine({**spec, "context_length": 512})


@pytest.fixture(scope="module")
def engines(tiny: TinyModel, request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """Every engine installed here: llama.cpp and MLX opened once for the module, vLLM the
    session's shared engine (tests/conftest.py; its start is the longest wait)."""
    opened: dict[str, Any] = {}
    try:
        for name in ENGINES:
            if name != "vllm":
                opened[name] = _open(name, tiny)
        shared = {"vllm": request.getfixturevalue("vllm_engine")} if HAS["vllm"] else {}
        yield {**opened, **shared}
    finally:
        for e in opened.values():
            e.close()


@pytest.fixture(scope="module")
def runs(engines: dict[str, Any]) -> dict[str, list[Any]]:
    """Each engine's greedy completions of PROMPTS with top-5 logprobs."""
    return {name: [e.generate(p, GREEDY) for p in PROMPTS] for name, e in engines.items()}


def _logsumexp(xs: list[float]) -> float:
    top = max(xs)
    return top + math.log(sum(math.exp(x - top) for x in xs))


@pytest.mark.parametrize("name", ENGINES)
def test_shape_sorting_and_the_chosen_token(name: str, runs: dict[str, list[Any]]) -> None:
    if name not in runs:
        pytest.skip(f"{name} is not installed")
    for c in runs[name]:
        assert c.top_logprobs is not None and c.logprobs is not None
        assert len(c.top_logprobs) == len(c.logprobs) == len(c.token_ids) == 16
        for tok, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True):
            assert len(top) == K and len({t for t, _ in top}) == K, top
            assert all(isinstance(t, int) and isinstance(v, float) for t, v in top)
            assert list(top) == sorted(top, key=lambda p: (-p[1], p[0])), top
            assert _logsumexp([v for _, v in top]) <= 1e-5, top  # k tokens hold at most all the mass
            assert lp <= 0.0
            mine = dict(top)
            assert tok in mine, (tok, top)  # greedy: the chosen token is the most likely
            assert mine[tok] == pytest.approx(lp, abs=1e-6)
            assert lp == pytest.approx(top[0][1], abs=1e-6)


@pytest.mark.parametrize("name", ENGINES)
def test_k0_gives_the_chosen_only_and_none_gives_nothing(name: str, engines: dict[str, Any]) -> None:
    if name not in engines:
        pytest.skip(f"{name} is not installed")
    e = engines[name]
    zero = e.generate(PROMPTS[0], GREEDY.model_copy(update={"logprobs": 0}))
    assert zero.logprobs is not None and len(zero.logprobs) == len(zero.token_ids)
    assert zero.top_logprobs is None
    none = e.generate(PROMPTS[0], GREEDY.model_copy(update={"logprobs": None}))
    assert none.logprobs is None and none.top_logprobs is None
    assert none.token_ids == zero.token_ids


@pytest.mark.parametrize("name", ENGINES)
def test_streamed_and_whole_agree(name: str, engines: dict[str, Any], runs: dict[str, list[Any]]) -> None:
    if name not in engines:
        pytest.skip(f"{name} is not installed")
    chunks = list(engines[name].stream(PROMPTS[1], GREEDY))
    tops = [t for c in chunks if c.top_logprobs for t in c.top_logprobs]
    whole = runs[name][1]
    assert whole.top_logprobs is not None
    assert sum(len(c.token_ids) for c in chunks) == len(tops) == len(whole.top_logprobs)
    for got, want in zip(tops, whole.top_logprobs, strict=True):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-5)


def test_the_same_weights_give_the_same_top_k_on_every_engine(runs: dict[str, list[Any]]) -> None:
    """Greedy, same tensors: along the steps where two engines chose the same tokens, the same
    top-5 ids and logprobs within TOLERANCE. An id one engine ranks in its top 5 and another not
    must sit at the other's boundary (a near-tie for fifth place)."""
    worst: dict[str, float] = {}
    steps = 0
    for x, y in itertools.combinations(runs, 2):
        pair = f"{x} / {y}"
        worst[pair] = 0.0
        for a, b in zip(runs[x], runs[y], strict=True):
            assert a.top_logprobs is not None and b.top_logprobs is not None
            for ta, tb, ia, ib in zip(a.top_logprobs, b.top_logprobs, a.token_ids, b.token_ids, strict=True):
                da, db = dict(ta), dict(tb)
                for tok in da.keys() & db.keys():
                    worst[pair] = max(worst[pair], abs(da[tok] - db[tok]))
                for tok in da.keys() ^ db.keys():  # only at the boundary
                    here, there = (da, db) if tok in da else (db, da)
                    assert here[tok] <= min(there.values()) + TOLERANCE, (pair, tok, ta, tb)
                steps += 1
                if ia != ib:  # the paths part here (a near-tie); what follows is not comparable
                    break
    print("max abs logprob difference:", {k: f"{v:.2e}" for k, v in worst.items()})
    assert all(w <= TOLERANCE for w in worst.values()), worst
    pairs = len(runs) * (len(runs) - 1) // 2
    assert steps >= pairs * len(PROMPTS) * 8  # most of each path was compared


@pytest.mark.parametrize("name", ENGINES)
def test_penalties_leave_the_logprobs_the_models_own(name: str, engines: dict[str, Any]) -> None:
    """Under strong penalties, each step's logprobs equal those of the same prefix generated
    without them (teacher-forced, one token at a time): the raw model's distribution."""
    if name not in engines:
        pytest.skip(f"{name} is not installed")
    e = engines[name]
    penal = GREEDY.model_copy(update={"max_tokens": 8, "repetition_penalty": 2.0, "presence_penalty": 1.5})
    prompt = e.tokenize("the the the the the")
    out = e.generate(prompt, penal)
    assert out.top_logprobs is not None and out.logprobs is not None
    plain = GREEDY.model_copy(update={"max_tokens": 1})
    for i, (lp, top) in enumerate(zip(out.logprobs, out.top_logprobs, strict=True)):
        ref = e.generate([*prompt, *out.token_ids[:i]], plain)
        assert ref.top_logprobs is not None
        assert [t for t, _ in top] == [t for t, _ in ref.top_logprobs[0]], (i, top, ref.top_logprobs[0])
        assert [v for _, v in top] == pytest.approx([v for _, v in ref.top_logprobs[0]], abs=1e-4), i
        assert lp == pytest.approx(dict(ref.top_logprobs[0]).get(out.token_ids[i], lp), abs=1e-4)


def test_a_plugin_yielding_plain_tuples_still_works_and_top_logprobs_fold() -> None:
    """``RawPiece``'s third item may be a plain tuple (plugins written before top-k) or
    ``TopLogprobs``; the Run and the folds carry both."""
    params = SamplingParams(max_tokens=8, logprobs=2)
    run, req = Run(params), Request()
    top = ((3, -0.1), (4, -2.5))
    chunks: list[Chunk] = []
    for piece in [("a", (3,), (-0.1,)), ("b", (3,), TopLogprobs((-0.1,), (top,))), ("", (), None)]:
        chunk = run.step(*piece)
        assert chunk is not None
        chunks.append(chunk)
    chunks.append(run.last(req, 0.0))
    assert chunks[0].logprobs == (-0.1,) and chunks[0].top_logprobs is None
    assert chunks[1].logprobs == (-0.1,) and chunks[1].top_logprobs == (top,)
    done = fold(iter(chunks))
    assert done.logprobs == (-0.1, -0.1) and done.top_logprobs == (top,)


# ---- the OpenAI shapes, through a real server on llama.cpp ----


@pytest.fixture(scope="module")
def server(tiny_gguf: Path) -> Iterator[Server]:
    s = start_server([str(tiny_gguf), "--backend", "llama.cpp", "--alias", "tiny"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)


def _own(engines: dict[str, Any], prompt: str) -> Any:
    return engines["llama.cpp"].generate(prompt, GREEDY.model_copy(update={"max_tokens": 8, "logprobs": 3}))


def test_completions_return_the_legacy_object(client: openai.OpenAI, engines: dict[str, Any]) -> None:
    want = _own(engines, PROMPTS[0])
    llama = engines["llama.cpp"]
    kw: dict[str, Any] = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
                          "logprobs": 3, "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = client.completions.create(**kw).choices[0].logprobs
    assert whole is not None and whole.top_logprobs is not None and whole.token_logprobs is not None
    assert whole.tokens == [llama.detokenize([t]) for t in want.token_ids]
    assert whole.token_logprobs == pytest.approx(list(want.logprobs), abs=1e-5)
    for token, lp, got, top in zip(whole.tokens, whole.token_logprobs, whole.top_logprobs, want.top_logprobs,
                                   strict=True):  # fmt: skip
        expected = {}
        for t, v in top:
            expected.setdefault(llama.detokenize([t]), v)
        expected.setdefault(token, lp)  # the chosen token is always there, as OpenAI's
        assert got.keys() == expected.keys() and list(got.values()) == pytest.approx(
            list(expected.values()), abs=1e-5
        )
    streamed = [c.choices[0].logprobs for c in client.completions.create(**kw, stream=True) if c.choices]
    parts = [lp for lp in streamed if lp is not None and lp.tokens]
    assert [t for p in parts for t in p.tokens] == whole.tokens
    streamed_top = [d for p in parts for d in (p.top_logprobs or [])]
    assert [list(d) for d in streamed_top] == [list(d) for d in whole.top_logprobs]
    # another run of the same greedy request (its prompt now cached): equal to float32 rounding
    for got, want in zip(streamed_top, whole.top_logprobs, strict=True):
        assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-5)
    assert [o for p in parts for o in (p.text_offset or [])] == whole.text_offset
    zero = client.completions.create(**{**kw, "logprobs": 0}).choices[0].logprobs
    assert zero is not None and len(zero.token_logprobs or []) == 8
    # no alternatives, but OpenAI's shape: a dict per token, the chosen token's own (as vLLM's)
    assert zero.top_logprobs == [
        {t: lp} for t, lp in zip(zero.tokens or [], zero.token_logprobs or [], strict=True)
    ]


def test_chat_returns_top_logprobs_per_token(client: openai.OpenAI) -> None:
    chat = [{"role": "user", "content": "Hello"}]
    kw: dict[str, Any] = {"model": "tiny", "messages": chat, "max_tokens": 8, "temperature": 0,
                          "logprobs": True, "top_logprobs": 3,
                          "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0].logprobs
    assert whole is not None and whole.content is not None and len(whole.content) == 8
    for entry in whole.content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the likeliest
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
        # each token's exact bytes: its text where that is whole characters (a lone byte of a
        # multi-byte character reads as U+FFFD, its bytes the byte itself)
        assert all(bytes(t.bytes).decode(errors="replace") == t.token for t in entry.top_logprobs)
    streamed = [
        e for c in client.chat.completions.create(**kw, stream=True)
        if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content
        for e in c.choices[0].logprobs.content
    ]  # fmt: skip
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, [t.token for t in e.top_logprobs]) for e in whole.content
    ]
    flat = [[e.logprob, *(t.logprob for t in e.top_logprobs)] for e in streamed]
    assert flat == [
        pytest.approx([e.logprob, *(t.logprob for t in e.top_logprobs)], abs=1e-5) for e in whole.content
    ]
    plain = client.chat.completions.create(**{**kw, "top_logprobs": 0}).choices[0].logprobs
    assert plain is not None and plain.content is not None
    assert all(e.top_logprobs == [] for e in plain.content)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**{**kw, "logprobs": False})
    assert refused.value.param == "top_logprobs"  # type: ignore[attr-defined]


def test_logprob_bytes_are_each_tokens_exact_bytes(client: openai.OpenAI, engines: dict[str, Any]) -> None:
    """A character the tokenizer splits into byte tokens: each token's ``bytes`` is its byte, so
    the entries' bytes join into the text; every engine gives each id of the vocabulary the same
    bytes (llama.cpp's pieces, and the Hugging Face tokenizer's through ``hf_token_bytes``)."""
    text = "敏捷的棕色狐狸 🙂 Ünïcödé"
    for name, e in engines.items():
        ids = e.tokenize(text)
        assert any("\ufffd" in e.detokenize([i]) for i in ids), name  # some token is part of a character
        assert b"".join(e.token_bytes(i) for i in ids) == text.encode(), name
    llama = engines["llama.cpp"]
    vocab = range(llama.vocab_size)
    want = [llama.token_bytes(i) for i in vocab]
    for name, e in engines.items():
        assert [e.token_bytes(i) for i in vocab] == want, name
    # through the server: a token that is a lone byte carries that byte, not U+FFFD's three
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=24, temperature=0,
        logprobs=True, top_logprobs=20, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    seen = [alt for entry in content for alt in [entry, *entry.top_logprobs]]
    lone = [alt for alt in seen if alt.token == "\ufffd"]
    assert lone, "no token of this answer or its alternatives is a lone byte: the check would be empty"
    assert all(len(alt.bytes) == 1 and alt.bytes[0] >= 0x80 for alt in lone), [a.bytes for a in lone][:5]
    assert all(bytes(alt.bytes).decode(errors="replace") == alt.token for alt in seen)
    joined = b"".join(bytes(e.bytes) for e in content)
    assert joined.decode(errors="replace") == chat.choices[0].message.content


def test_a_backend_without_alternatives_refuses_them_by_the_policy() -> None:
    """``top_logprobs`` is declared on its own: a backend that gives the chosen token's logprob
    only (MockEngine, several plugins) refuses ``logprobs`` above 0 instead of leaving
    ``top_logprobs`` empty; ``warn``/``drop`` keep the chosen token's logprob."""
    import warnings

    from unillm import UnillmWarning, UnsupportedParameter
    from unillm.testing import MockEngine

    with MockEngine("one two three") as mock:
        assert "top_logprobs" not in mock.capabilities.sampling
        assert mock.generate("x", logprobs=0).logprobs == (0.0, 0.0, 0.0)
        with pytest.raises(UnsupportedParameter) as err:
            mock.generate("x", logprobs=2)
        assert "top_logprobs" in str(err.value)
    for policy in ("warn", "drop"):
        with (
            MockEngine("one two", unsupported_params=policy) as mock,
            warnings.catch_warnings(record=True) as seen,
        ):
            warnings.simplefilter("always")
            done = mock.generate("x", logprobs=2)
        assert done.logprobs == (0.0, 0.0) and done.top_logprobs is None
        assert any(issubclass(w.category, UnillmWarning) for w in seen) == (policy == "warn")
