"""``/v1/completions``, OpenAI's legacy text completions, streamed or not: a prompt or a batch of
them (strings or token ids), ``n`` choices each, ``best_of`` candidates ranked by their log
probability, ``echo`` of the prompt, and ``max_tokens: 0`` (the prompt counted, nothing
generated).

Choice ``i * n + j`` is prompt i's j-th, as OpenAI numbers them. With ``best_of`` above ``n``,
each prompt's ``best_of`` candidates are generated side by side and the ``n`` with the highest
mean log probability per token are returned, best first; the usage counts every candidate's tokens
(they were all generated). A ``null`` prompt is OpenAI's default, ``<|endoftext|>``, the start of
a document: here the model's own start (an empty text, which the engine opens with its BOS token).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request

from unillm._types import Chunk, Completion
from unillm.server._errors import ApiError
from unillm.server._generate import fits, nothing, stream
from unillm.server._openai_logprobs import completion_logprobs
from unillm.server._openai_wire import Framing, finish_reason, folded, seeded, sse, summed, whole
from unillm.server._request import check_common, dumps, engine_for, openai_sampling, record_of

# FastAPI reads the body model from the annotation at runtime
from unillm.server._schemas import CompletionRequest

if TYPE_CHECKING:
    from unillm._contract._engine import Engine

__all__ = ["FIM_TOKENS", "MAX_GENERATIONS", "fim_tokens", "router"]

router = APIRouter()

#: the most generations one request may start (prompts x best_of): each is a request of its own
#: to the engine, and one client's batch should not fill every queue
MAX_GENERATIONS = 128

Prompt = str | list[int]


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    state, record = request.app.state.unillm, record_of(request)
    check_common(body)
    prompts = _prompts(body.prompt)
    n, best = body.n, body.best_of or body.n  # best_of 0 or null: n
    _check_counts(body, len(prompts), n, best)
    slot, engine = await engine_for(state, body.model, record)
    _check_engine(body, engine, best > n)
    # best_of ranks candidates by their log probabilities: asked for (0 alternatives) when the
    # request did not ask for them itself, and then not shown
    k = body.logprobs if body.logprobs is not None else (0 if best > n else None)
    asked = body.max_tokens
    # max_tokens 0 generates nothing; the other fields are checked as for one token
    params = openai_sampling(
        state, engine, slot.alias, body, 1 if asked == 0 else asked, logprobs=k, lora=record.adapter
    )
    echoes = [await _text_of(engine, p) for p in prompts] if body.echo else None
    if body.suffix is not None:
        prompts = [await _fim(engine, slot.alias, p, body.suffix) for p in prompts]
    prompts = [await _started(engine, p) for p in prompts]
    if asked == 0:
        streams = [await nothing(engine, p, params, body.echo) for p in prompts for _ in range(n)]
        echoes = None  # the text is the echo already
    else:
        for each in prompts:  # every prompt of a batch fits, before any of them takes a place in the queue
            await fits(engine, each, params)
        streams = [stream(state, slot, engine, p, q, record) for p in prompts for q in seeded(params, best)]
    cid, created = "cmpl-" + secrets.token_hex(12), int(time.time())
    want_lp = body.logprobs is not None
    per_prompt = n if asked == 0 else best
    if not body.stream:
        answers = await folded(request, streams)
        usage = summed([a.usage for a in answers], per_prompt)
        choices: list[dict[str, Any]] = []
        for p in range(len(prompts)):
            for done in _best(answers[p * per_prompt : (p + 1) * per_prompt], n):
                choices.append({
                    "index": len(choices),
                    "text": (echoes[p] if echoes else "") + done.text,
                    "logprobs": completion_logprobs(engine, done) if want_lp else None,
                    "finish_reason": finish_reason(done.finish_reason),
                    "stop_reason": done.stop_sequence,  # vLLM's field: the stop string that ended it
                })  # fmt: skip
        return whole(cid, "text_completion", created, slot.alias, choices, usage)
    framing = Framing(cid, "text_completion", created, slot.alias, body, '"text":""', len(streams))
    heads = framing.heads
    sent = [0] * len(streams)  # per choice, the text sent so far: where its next tokens start

    def event(i: int, chunk: Chunk) -> str:
        lp = "null"
        if want_lp:
            lp = dumps(completion_logprobs(engine, chunk, sent[i]))
            sent[i] += len(chunk.text)
        return f'data: {heads[i]}"text":{dumps(chunk.text)},"logprobs":{lp},"finish_reason":null}}]}}\n\n'

    def opening(i: int) -> str:
        assert echoes is not None
        echo = dumps(echoes[i // n])
        return f'data: {heads[i]}"text":{echo},"logprobs":null,"finish_reason":null}}]}}\n\n'

    return await sse(
        request, streams, event, framing, opening=opening if echoes else None, keep_empty=want_lp,
        per_prompt=n,
    )  # fmt: skip


def _prompts(prompt: str | list[int] | list[str] | list[list[int]] | None) -> list[Prompt]:
    """The request's prompts: one text, one list of token ids, or a batch of either."""
    if prompt is None or (isinstance(prompt, list) and not prompt):  # [] as null: no prompt given
        return [""]
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    out: list[Prompt] = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, list) and p:
            out.append(list(p))
        else:
            raise ApiError(
                400, f"prompt[{i}] is an empty list of token ids", param="prompt", code="invalid_value"
            )
    return out


def _check_counts(body: CompletionRequest, prompts: int, n: int, best: int) -> None:
    if best < n:
        raise ApiError(
            400, f"best_of is {best}, fewer than n ({n}): best_of is how many candidates the n "
            "choices are picked from", param="best_of", code="invalid_value",
        )  # fmt: skip
    if body.stream and best > n:
        raise ApiError(
            400, f"best_of ({best}) above n ({n}) ranks whole candidates, so it cannot be streamed "
            "(as OpenAI's); ask without stream, or with best_of equal to n", param="best_of",
            code="invalid_value",
        )  # fmt: skip
    if prompts * best > MAX_GENERATIONS:
        raise ApiError(
            400, f"{prompts} prompts x {best} candidates each are {prompts * best} generations; one "
            f"request may start {MAX_GENERATIONS} at most: split the batch",
            param="prompt" if prompts > 1 else "best_of", code="invalid_value",
        )  # fmt: skip


def _check_engine(body: CompletionRequest, engine: Engine[Any], ranks: bool) -> None:
    """Refuse what this model's engine cannot honour, naming the field."""
    if body.echo and body.logprobs is not None:
        raise ApiError(
            400, f"echo with logprobs needs the log probabilities of the prompt's tokens, which "
            f"{engine.name} does not report here; ask for one or the other", param="echo",
            code="unsupported_value",
        )  # fmt: skip
    if ranks and "logprobs" not in engine.capabilities.sampling:
        raise ApiError(
            400, f"best_of ranks candidates by their log probability, which {engine.name} does not "
            "report; leave best_of out, or ask for n choices", param="best_of", code="unsupported_value",
        )  # fmt: skip


def _best(candidates: Sequence[Completion], n: int) -> Sequence[Completion]:
    """The ``n`` candidates of the highest mean log probability per token, best first (a tie keeps
    the earlier); all of them, in order, when there are ``n``."""
    if len(candidates) == n:
        return candidates

    def mean(c: Completion) -> float:
        lps = c.logprobs or ()
        return sum(lps) / len(lps) if lps else 0.0

    return sorted(candidates, key=mean, reverse=True)[:n]


#: fill-in-the-middle tokens as models name them (prefix, suffix, middle), each written before
#: its part and the middle's last: Qwen2.5-Coder's, StarCoder's and DeepSeek-Coder's
FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"),
)
_fim_of: weakref.WeakKeyDictionary[Any, tuple[str, str, str] | None] = weakref.WeakKeyDictionary()


def fim_tokens(engine: Engine[Any]) -> tuple[str, str, str] | None:
    """The model's fill-in-the-middle tokens: the first of ``FIM_TOKENS`` whose three texts are
    each one token of its vocabulary (found once per engine); None when it has none."""
    with contextlib.suppress(TypeError):  # an engine that cannot be weakly referenced: not kept
        if engine in _fim_of:
            return _fim_of[engine]
    found = None
    try:
        start = len(engine.tokenize(""))  # a BOS the engine puts before any text
        for style in FIM_TOKENS:
            if all(len(engine.tokenize(t)) == start + 1 for t in style):
                found = style
                break
    except NotImplementedError:
        pass
    with contextlib.suppress(TypeError):
        _fim_of[engine] = found
    return found


async def _fim(engine: Engine[Any], alias: str, prompt: Prompt, suffix: str) -> str:
    """The fill-in-the-middle prompt of the text before the gap (``prompt``) and after it."""
    style = await asyncio.to_thread(fim_tokens, engine)
    if style is None:
        raise ApiError(
            400, f"suffix asks for fill-in-the-middle, and {alias!r} has no fill-in-the-middle tokens "
            "(such as <|fim_prefix|>); leave suffix out and send the text before the gap as the prompt",
            param="suffix", code="unsupported_value",
        )  # fmt: skip
    before = await _text_of(engine, prompt)
    return f"{style[0]}{before}{style[1]}{suffix}{style[2]}"


async def _started(engine: Engine[Any], prompt: Prompt) -> Prompt:
    """An empty text as the start of a document: as is where the engine opens a text with its BOS
    token; else the model's BOS token, or its EOS token (GPT-2's ``<|endoftext|>``, the document
    separator OpenAI's default prompt is)."""
    if prompt != "":
        return prompt
    try:
        if await asyncio.to_thread(engine.tokenize, ""):
            return prompt
        special = engine._special_tokens()
    except NotImplementedError:
        return prompt  # the engine says what it makes of it
    for name in ("bos_token", "eos_token"):
        if text := special.get(name):
            return await asyncio.to_thread(engine.tokenize, text)
    return prompt


async def _text_of(engine: Engine[Any], prompt: Prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return await asyncio.to_thread(engine.detokenize, prompt)
