"""Speculative decoding for the llama.cpp backend: a draft proposes tokens, the target checks them.

The adapter drives llama.cpp's token loop itself, so llama-cpp-python's own ``draft_model`` hook
(used only inside ``Llama.generate``) never runs; this module does the same in that loop. Each
step evaluates the pending token and the draft's proposals in one batch with logits for every
position, then samples position by position with the request's own sampler: a sample that equals
the next proposal keeps it, the first that differs ends the step and the KV cache past it is
dropped. Every emitted token is what the sampler drew from the target's logits after exactly the
tokens emitted before it, so the output is the one decoding without a draft gives (greedy: the
same tokens; sampled: the same distribution); the draft changes only how many target passes it
takes. Drafted and accepted counts are those comparisons, reported in ``Usage``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from time import perf_counter
from typing import Any, Protocol

from unillm import ConfigError, UnsupportedParameter
from unillm.backend import RequestState, SamplingParams, shared_prefix
from unillm.engines.llamacpp._load import eval_error

__all__ = ["PROMPT_LOOKUP", "Drafter", "check_request", "load_drafter", "Speculation", "no_step"]

#: ``draft_model`` value for llama-cpp-python's prompt-lookup drafter (n-grams of the context)
PROMPT_LOOKUP = "prompt-lookup"
_DEFAULT_DRAFT_TOKENS = {"model": 8, PROMPT_LOOKUP: 10}  # llama-cpp-python's own for lookup


class Drafter(Protocol):
    k: int
    seconds: float  # time spent drafting (not in the target's llama.cpp counters)

    def propose(self, ids: list[int], k: int) -> list[int]: ...

    def close(self) -> None: ...


class _ModelDrafter:
    """Greedy drafts from a second ``Llama`` that keeps its own KV cache across steps."""

    def __init__(self, llm: Any, k: int) -> None:
        self.llm, self.k, self.seconds = llm, k, 0.0
        self._n_vocab = llm.n_vocab()

    def propose(self, ids: list[int], k: int) -> list[int]:
        import numpy as np

        t0 = perf_counter()
        llm = self.llm
        cached = shared_prefix(llm.input_ids[: llm.n_tokens], ids)
        cached = min(cached, len(ids) - 1)  # evaluate at least one token: fresh logits
        llm.n_tokens = cached  # Llama.eval drops the KV cache past it
        out: list[int] = []
        todo = ids[cached:]
        while True:
            llm.eval(todo)
            logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(self._n_vocab,))
            out.append(int(logits.argmax()))
            if len(out) >= k:
                break
            todo = out[-1:]
        self.seconds += perf_counter() - t0
        return out

    def close(self) -> None:
        self.llm.close()


class _LookupDrafter:
    """llama-cpp-python's prompt-lookup decoding: the continuation of the last n-gram's earlier
    occurrence in the context. No second model."""

    def __init__(self, k: int) -> None:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self._lookup = LlamaPromptLookupDecoding(num_pred_tokens=k)
        self.k, self.seconds = k, 0.0

    def propose(self, ids: list[int], k: int) -> list[int]:
        import numpy as np

        t0 = perf_counter()
        out = [int(t) for t in self._lookup(np.asarray(ids, dtype=np.intc))[:k]]
        self.seconds += perf_counter() - t0
        return out

    def close(self) -> None:
        pass


def no_step(tok: int) -> None:
    """The plain loop's evaluation of a sampled token: ``speculate`` evaluates it with the drafts."""


def check_request(drafter: Drafter | None, params: SamplingParams) -> None:
    if drafter is not None and params.logprobs is not None:
        raise UnsupportedParameter(
            "llama.cpp", ["logprobs"], "Not with a draft_model (speculative decoding): unset one."
        )


def load_drafter(
    llama_cpp: Any, draft: str | None, k: int | None, kwargs: dict[str, Any], target: Any
) -> Drafter | None:
    """The drafter the ``draft_model`` option names: a GGUF loaded with the target's settings, or
    ``"prompt-lookup"``; None when unset. A draft whose vocabulary differs is refused. On failure
    the target is closed (its engine never finished loading)."""
    try:
        return _load_drafter(llama_cpp, draft, k, kwargs, target)
    except BaseException:
        target.close()
        raise


def _load_drafter(
    llama_cpp: Any, draft: str | None, k: int | None, kwargs: dict[str, Any], target: Any
) -> Drafter | None:
    if draft is None:
        if k is not None:
            raise ConfigError("num_draft_tokens is set without draft_model; set both or neither")
        return None
    if draft == PROMPT_LOOKUP:
        return _LookupDrafter(k or _DEFAULT_DRAFT_TOKENS[PROMPT_LOOKUP])
    path = Path(draft).expanduser()
    if not path.is_file() or path.suffix != ".gguf":
        what = "does not exist" if not path.exists() else "is not a .gguf file"
        raise ConfigError(
            f"draft_model {draft!r} {what}: llama.cpp drafts with a GGUF file (a small model "
            f"with the target's vocabulary), or with {PROMPT_LOOKUP!r}"
        )
    try:
        llm = llama_cpp.Llama(model_path=str(path), **kwargs)
    except (ValueError, RuntimeError, OSError) as exc:
        raise ConfigError(f"draft_model {draft!r} failed to load in llama.cpp: {exc}") from exc
    mismatch = _vocab_mismatch(llm, target)
    if mismatch:
        llm.close()
        raise ConfigError(
            f"draft_model {draft!r} has another vocabulary than the model ({mismatch}); a draft "
            "must share the target's tokenizer"
        )
    return _ModelDrafter(llm, k or _DEFAULT_DRAFT_TOKENS["model"])


def _vocab_mismatch(draft: Any, target: Any) -> str:
    n = target.n_vocab()
    if draft.n_vocab() != n:
        return f"{draft.n_vocab()} tokens, the model has {n}"
    # every token's text where the vocabulary is small, else a spread of 4096 of them
    for tok in range(0, n, max(1, n // 4096)):
        a, b = draft.detokenize([tok], special=True), target.detokenize([tok], special=True)
        if a != b:
            return f"token {tok} is {a!r} in the draft, {b!r} in the model"
    return ""


class Speculation(Iterator[int]):
    """The tokens of one request after its prompt was evaluated, sampled with ``sampler``, drafted
    by ``drafter``. The last token yielded is pending (not in the KV cache), as in the plain loop;
    stop pulling at any point. ``seconds``: the drafting time so far."""

    def __init__(self, llm: Any, sampler: Any, drafter: Drafter, max_tokens: int, req: RequestState) -> None:
        self._it = _speculate(llm, sampler, drafter, max_tokens, req)
        self._drafter, self._t0 = drafter, drafter.seconds

    def __next__(self) -> int:
        return next(self._it)

    @property
    def seconds(self) -> float:
        return self._drafter.seconds - self._t0


def _speculate(llm: Any, sampler: Any, drafter: Drafter, max_tokens: int, req: RequestState) -> Iterator[int]:
    import llama_cpp

    ctx, batch = llm._ctx, llm._batch
    room_batch, n_ctx = llm.n_batch - 1, len(llm.input_ids)
    input_ids = llm.input_ids
    drafted = accepted = req.draft_tokens = req.accepted_draft_tokens = 0
    tok = sampler.sample(ctx, -1)
    emitted = 1
    yield tok
    while True:
        n_past = llm.n_tokens
        # no more proposals than could be emitted (the sample after the last is one more)
        k = min(drafter.k, max_tokens - emitted - 1, n_ctx - n_past - 1, room_batch)
        drafts = drafter.propose([*input_ids[:n_past].tolist(), tok], k) if k > 0 else []
        seq = [tok, *drafts]
        batch.set_batch(seq, n_past, logits_all=True)
        rc = llama_cpp.llama_decode(ctx.ctx, batch.batch)
        if rc != 0:
            raise eval_error(RuntimeError(f"llama_decode returned {rc}"))
        input_ids[n_past : n_past + len(seq)] = seq
        llm.n_tokens = n_past + len(seq)
        drafted += len(drafts)
        req.draft_tokens = drafted
        for i in range(len(seq)):
            t = sampler.sample(ctx, i)
            emitted += 1
            if i < len(drafts) and t == drafts[i]:
                accepted += 1
                req.accepted_draft_tokens = accepted
                yield t
                continue
            keep = n_past + i + 1  # the KV cache is valid through seq[i]; t is pending
            if keep < llm.n_tokens:
                ctx.kv_cache_seq_rm(-1, keep, -1)
                llm.n_tokens = keep
            tok = t
            yield t
            break
