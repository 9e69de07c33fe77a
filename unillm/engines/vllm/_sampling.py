"""The vLLM backend's translation of one request, both ways: unillm's ``SamplingParams`` into vLLM's
(the end-of-sequence set, structured output from ``response_format``), and each ``RequestOutput``
vLLM streams back into a raw piece with its usage and timings. vllm is never imported here: its
classes come in with the modules the backend imported at load."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unillm import ConfigError
from unillm.backend import TopLogprobs
from unillm.backend.llguidance import check, closed

if TYPE_CHECKING:
    from unillm.backend import RequestState, SamplingParams
    from unillm.engines.vllm._start import VLLMModules

__all__ = ["Piece", "piece", "sampling_params"]

Piece = tuple[str, tuple[int, ...], "tuple[float, ...] | TopLogprobs | None"]


def sampling_params(v: VLLMModules, params: SamplingParams, eos_token_ids: frozenset[int]) -> Any:
    """vLLM's SamplingParams for ``params``, built eagerly so a bad value fails at the call.

    vLLM's own end-of-sequence handling (the tokenizer's EOS plus generation_config's) is turned off
    with ``ignore_eos`` and the declared set (``eos_token_ids``) passed as stop ids instead: vLLM
    then stops on exactly that set (``check_stop``), min_tokens still masks it (stop ids join
    ``all_stop_token_ids``), and the final output names the id that stopped it (``stop_reason``),
    which ``piece`` drops."""
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids |= eos_token_ids
    structured = None
    if (fmt := params.output_format) is not None:  # enforced by vLLM's guidance backend (_args.py)
        check(fmt, "vLLM")  # refused at the call in the words every backend uses
        if fmt.kind == "regex":
            structured = v.StructuredOutputsParams(regex=fmt.pattern)
        elif fmt.kind == "choice":
            structured = v.StructuredOutputsParams(choice=list(fmt.choices))
        elif fmt.kind == "json_schema":
            structured = v.StructuredOutputsParams(json=closed(fmt.json_schema))  # unillm's rule
        else:
            structured = v.StructuredOutputsParams(json_object=True)
    try:
        return v.SamplingParams(
            max_tokens=params.max_tokens,
            min_tokens=params.min_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k or 0,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            seed=params.seed,
            stop=list(params.stop) or None,
            stop_token_ids=sorted(stop_ids) or None,
            ignore_eos=True,
            logprobs=params.logprobs,
            logit_bias=params.logit_bias,
            structured_outputs=structured,
            output_kind=v.RequestOutputKind.DELTA,
        )
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"vLLM refuses these sampling parameters: {exc}") from exc


def piece(out: Any, req: RequestState, k: int | None = None) -> Piece | None:
    """One vLLM ``RequestOutput`` (a delta) as a raw piece; the last one fills ``req``. ``k``: the
    request's ``logprobs`` (vLLM's logprobs are the raw model's, its default ``raw_logprobs``)."""
    o = out.outputs[0]
    ids = tuple(o.token_ids)
    if out.finished and isinstance(o.stop_reason, int) and ids and ids[-1] == o.stop_reason:
        # The stop token (an EOS of the set or a user's stop id) ends the completion without
        # being part of it, as on every backend; vLLM already left its text out.
        ids = ids[:-1]
    lp = from_vllm(o.logprobs, ids, k or 0) if o.logprobs else None
    if out.finished:
        req.finish_reason = "length" if o.finish_reason == "length" else "stop"
        if isinstance(o.stop_reason, str):  # vLLM matched one of our stop strings itself
            req.stop_sequence = o.stop_reason
        if out.prompt_token_ids:
            req.prompt_tokens = len(out.prompt_token_ids)
        req.cached_tokens = out.num_cached_tokens
        m = out.metrics
        if m is not None and m.first_token_ts:
            req.queue_s = max(0.0, m.scheduled_ts - m.queued_ts)
            req.prefill_s = max(0.0, m.first_token_ts - m.scheduled_ts)
            req.decode_s = max(0.0, m.last_token_ts - m.first_token_ts)
    if not ids and not o.text:
        return None
    return o.text, ids, lp


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
