"""The cross-engine check: the same weights give the same greedy tokens on every engine.

    from unillm.testing import check_parity

    report = check_parity([reference_engine, my_engine], prompts, max_tokens=64)
    print(report.summary())
    report.assert_parity(min_share=0.95)

For each prompt every engine decodes greedily with its default options; the token ids, the finish
reason and the usage counts are compared with the reference engine's (the first, unless told). At
the first token where two engines disagree, each engine's margin between its two most likely tokens
there is measured, so a near-tie (two tokens a float rounding apart, which different kernels may
order either way) is told apart from a bug: a real difference has a clear winner on at least one
side. The margin needs ``logprobs`` and ``logit_bias`` (the runner-up is the greedy choice once
the top token is pushed down; logprobs are of the model's distribution, before the bias); an engine
without them reports no margin, and its differences count as unexplained.

Engines loaded for embeddings (``task="embed"``, each with the same pooling) are compared on their
vectors instead: every prompt's vector on each engine against the reference's, equal when the
cosine is at least ``min_cosine`` (0.999), and the prompts' token counts must agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from unillm._contract._engine import Engine
from unillm._types import Completion, SamplingParams

__all__ = ["Divergence", "ParityReport", "PromptParity", "check_parity"]


@dataclass(frozen=True)
class Divergence:
    """Where one engine's greedy tokens leave the reference's.

    ``index`` is the position in the completion; ``tokens`` each engine's token there (None: it
    had stopped); ``margins`` each engine's logprob gap between its top two tokens there, in nats
    (None where it cannot be measured).
    """

    engine: str
    index: int
    tokens: dict[str, int | None]
    margins: dict[str, float | None]
    near_tie: bool


@dataclass(frozen=True)
class PromptParity:
    """One prompt's result on every engine and what differs from the reference."""

    prompt: str
    completions: dict[str, Completion]
    differences: tuple[str, ...] = ()
    divergences: tuple[Divergence, ...] = ()
    #: embedding engines: each engine's cosine to the reference's vector of this prompt
    cosines: dict[str, float] = field(default_factory=dict)

    @property
    def equal(self) -> bool:
        return not self.differences

    @property
    def explained(self) -> bool:
        """Every difference follows from a near-tie at the first diverging token."""
        return self.equal or (bool(self.divergences) and all(d.near_tie for d in self.divergences))


@dataclass(frozen=True)
class ParityReport:
    """What ``check_parity`` found, prompt by prompt."""

    reference: str
    engines: tuple[str, ...]
    prompts: tuple[PromptParity, ...] = field(default=())
    tie_margin: float = 0.1

    @property
    def equal_share(self) -> float:
        return sum(p.equal for p in self.prompts) / len(self.prompts) if self.prompts else 1.0

    @property
    def unexplained(self) -> list[PromptParity]:
        return [p for p in self.prompts if not p.explained]

    def summary(self) -> str:
        lines = [
            f"parity of {', '.join(self.engines)} against {self.reference}: "
            f"{sum(p.equal for p in self.prompts)}/{len(self.prompts)} prompts equal "
            f"({self.equal_share:.0%}); near-tie margin {self.tie_margin} nats"
        ]
        for p in self.prompts:
            if p.equal:
                continue
            lines.append(f"- {p.prompt[:60]!r}: {'; '.join(p.differences)}")
            for d in p.divergences:
                margins = ", ".join(
                    f"{name} {m:.4f}" if m is not None else f"{name} ?" for name, m in d.margins.items()
                )
                kind = "near-tie" if d.near_tie else "NOT a near-tie"
                lines.append(
                    f"    {d.engine} diverges at token {d.index}: {d.tokens}; margins {margins} ({kind})"
                )
        return "\n".join(lines)

    def assert_parity(self, min_share: float = 1.0) -> None:
        """Raise ``AssertionError`` (with the summary) unless at least ``min_share`` of the
        prompts are equal on every engine and every other difference is a near-tie."""
        if self.equal_share < min_share or self.unexplained:
            raise AssertionError(self.summary())


def check_parity(
    engines: Sequence[Engine[Any]] | Mapping[str, Engine[Any]],
    prompts: Sequence[str],
    *,
    max_tokens: int = 64,
    reference: int | str = 0,
    tie_margin: float = 0.1,
    params: SamplingParams | Mapping[str, Any] | None = None,
    min_cosine: float = 0.999,
) -> ParityReport:
    """Decode ``prompts`` greedily on each loaded engine and compare them with the reference.

    :param engines: loaded engines on the same weights (a mapping names them; a sequence uses
        each engine's ``name``, numbered when two share one).
    :param prompts: text prompts; each engine tokenizes them itself.
    :param max_tokens: tokens per completion.
    :param reference: the engine the others are compared with (index or name).
    :param tie_margin: a divergence is a near-tie when, on both sides, the top two tokens are
        closer than this (in nats).
    :param params: more sampling fields (e.g. ``ignore_eos``); temperature is always 0.
    :param min_cosine: engines loaded for embeddings: the least cosine between an engine's vector
        and the reference's that counts as equal.
    :returns: a ``ParityReport``; ``report.assert_parity(min_share)`` turns it into a test.
    """
    named = _named(engines)
    if len(named) < 2:
        raise ValueError("check_parity needs at least two engines")
    ref = reference if isinstance(reference, str) else list(named)[reference]
    if ref not in named:
        raise ValueError(f"no engine named {ref!r}; have {list(named)}")
    tasks = {str(e.task) for e in named.values() if e.task is not None}  # None: a server's, not known
    if tasks == {"embed"}:
        return _vectors(named, prompts, ref, min_cosine)
    if len(tasks) > 1:
        raise ValueError(
            f"check_parity compares engines loaded for one task; these are loaded for {sorted(tasks)}"
        )
    base = dict(params.model_dump(exclude_unset=True) if isinstance(params, SamplingParams) else params or {})
    sp = SamplingParams(**{**base, "temperature": 0.0, "max_tokens": max_tokens})
    results = []
    for prompt in prompts:
        done = {name: engine.generate(prompt, sp) for name, engine in named.items()}
        results.append(_compare(prompt, done, ref, named, tie_margin))
    return ParityReport(ref, tuple(named), tuple(results), tie_margin)


def _vectors(
    named: dict[str, Engine[Any]], prompts: Sequence[str], ref: str, min_cosine: float
) -> ParityReport:
    """Embedding engines: each prompt's vector (one batch per engine) against the reference's."""
    import numpy as np

    poolings = {name: e.pooling for name, e in named.items()}
    if len(set(poolings.values())) > 1 or None in poolings.values():
        raise ValueError(f"the engines pool differently ({poolings}); load them with the same pooling")
    done = {name: e.embed(list(prompts)) for name, e in named.items()}
    vectors = {name: got.array().astype(np.float64) for name, got in done.items()}
    tokens = {name: [len(e.tokenize(p)) for p in prompts] for name, e in named.items()}
    results = []
    for i, prompt in enumerate(prompts):
        cosines: dict[str, float] = {}
        differences = []
        r = vectors[ref][i]
        for name, v in vectors.items():
            if name == ref:
                continue
            cos = float(v[i] @ r / (np.linalg.norm(v[i]) * np.linalg.norm(r)))
            cosines[name] = cos
            if not cos >= min_cosine:
                differences.append(f"{name}: cosine {cos:.6f} to {ref}'s vector, under {min_cosine}")
            if tokens[name][i] != tokens[ref][i]:
                differences.append(f"{name}: {tokens[name][i]} tokens, {ref} {tokens[ref][i]}")
        results.append(PromptParity(prompt, {}, tuple(differences), (), cosines))
    return ParityReport(ref, tuple(named), tuple(results))


def _named(engines: Sequence[Engine[Any]] | Mapping[str, Engine[Any]]) -> dict[str, Engine[Any]]:
    if isinstance(engines, Mapping):
        return dict(engines)
    out: dict[str, Engine[Any]] = {}
    for e in engines:
        name, n = e.name, 2
        while name in out:
            name, n = f"{e.name}#{n}", n + 1
        out[name] = e
    return out


def _compare(
    prompt: str,
    done: dict[str, Completion],
    ref: str,
    engines: dict[str, Engine[Any]],
    tie_margin: float,
) -> PromptParity:
    want = done[ref]
    differences: list[str] = []
    divergences: list[Divergence] = []
    for name, got in done.items():
        if name == ref:
            continue
        diffs = []
        if got.token_ids != want.token_ids:
            diffs.append("token ids")
        if got.finish_reason != want.finish_reason:
            diffs.append(f"finish {got.finish_reason} vs {want.finish_reason}")
        if (got.usage.prompt_tokens, got.usage.completion_tokens) != (
            want.usage.prompt_tokens,
            want.usage.completion_tokens,
        ):
            diffs.append(
                f"usage {got.usage.prompt_tokens}+{got.usage.completion_tokens} vs "
                f"{want.usage.prompt_tokens}+{want.usage.completion_tokens}"
            )
        if not diffs:
            continue
        differences.append(f"{name}: {', '.join(diffs)}")
        if got.token_ids != want.token_ids and got.usage.prompt_tokens == want.usage.prompt_tokens:
            divergences.append(_divergence(prompt, name, got, ref, want, engines, tie_margin))
    return PromptParity(prompt, done, tuple(differences), tuple(divergences))


def _divergence(
    prompt: str,
    name: str,
    got: Completion,
    ref: str,
    want: Completion,
    engines: dict[str, Engine[Any]],
    tie_margin: float,
) -> Divergence:
    a, b = want.token_ids, got.token_ids
    k = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
    tokens = {ref: a[k] if k < len(a) else None, name: b[k] if k < len(b) else None}
    margins = {n: _margin(engines[n], prompt, a[:k]) for n in (ref, name)}
    near = all(m is not None and m < tie_margin for m in margins.values())
    return Divergence(name, k, tokens, margins, near)


def _margin(engine: Engine[Any], prompt: str, prefix: Sequence[int]) -> float | None:
    """The gap between ``engine``'s two most likely next tokens after ``prompt`` + ``prefix``."""
    needed = {"logprobs", "logit_bias"}
    if not needed <= engine.capabilities.sampling:
        return None
    try:
        ids = [*engine.tokenize(prompt), *prefix]
        one = {"temperature": 0.0, "max_tokens": 1, "logprobs": 1, "ignore_eos": True}
        first = engine.generate(ids, one)
        if not first.token_ids or not first.logprobs:
            return None
        second = engine.generate(ids, {**one, "logit_bias": {first.token_ids[0]: -1e4}})
        if not second.token_ids or not second.logprobs:
            return None
    except Exception:  # a margin is a diagnosis; its failure must not hide the comparison
        return None
    return first.logprobs[0] - second.logprobs[0]
