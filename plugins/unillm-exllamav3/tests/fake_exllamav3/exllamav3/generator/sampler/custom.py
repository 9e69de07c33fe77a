"""CustomSampler and its steps (exllamav3/generator/sampler/custom.py, v1.6.5, less SS_DRY and
the adaptive-p step): the same class names and constructor arguments, applied in order by a
numpy version of the chain."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "SS_Argmax",
    "SS_Base",
    "SS_LogitBias",
    "SS_MinP",
    "SS_NoOp",
    "SS_PresFreqP",
    "SS_RepP",
    "SS_Sample",
    "SS_Temperature",
    "SS_TopK",
    "SS_TopP",
    "CustomSampler",
]


class SS_Base:
    """One step: takes logits (float64, -inf for removed tokens) and returns them, or a token."""

    def run(self, logits: Any, past: list[int], rng: Any) -> Any:
        return logits


class SS_NoOp(SS_Base):
    pass


class SS_Argmax(SS_Base):
    def run(self, logits: Any, past: list[int], rng: Any) -> int:
        return int(np.argmax(logits))


class SS_Sample(SS_Base):
    def run(self, logits: Any, past: list[int], rng: Any) -> int:
        order = np.argsort(-logits, kind="stable")
        z = logits[order]
        finite = np.isfinite(z)
        probs = np.where(finite, np.exp(z - z[finite].max()), 0.0)
        probs /= probs.sum()
        idx = int(np.searchsorted(np.cumsum(probs), rng.random(), side="right"))
        return int(order[min(idx, int(finite.sum()) - 1)])


class SS_Temperature(SS_Base):
    def __init__(self, temperature: float):
        self.temperature = temperature

    def run(self, logits: Any, past: list[int], rng: Any) -> Any:
        return logits / self.temperature if self.temperature != 1.0 else logits


def _probs(logits: Any) -> Any:
    finite = np.isfinite(logits)
    p = np.where(finite, np.exp(logits - logits[finite].max()), 0.0)
    return p / p.sum()


class SS_MinP(SS_Base):
    def __init__(self, min_p: float):
        self.min_p = min_p

    def run(self, logits: Any, past: list[int], rng: Any) -> Any:
        if not self.min_p > 0.0:
            return logits
        p = _probs(logits)
        return np.where(p >= self.min_p * p.max(), logits, -np.inf)


class SS_TopK(SS_Base):
    def __init__(self, top_k: int):
        self.top_k = top_k

    def run(self, logits: Any, past: list[int], rng: Any) -> Any:
        if not 0 < self.top_k < len(logits):
            return logits
        keep = np.argsort(-logits, kind="stable")[: self.top_k]
        out = np.full_like(logits, -np.inf)
        out[keep] = logits[keep]
        return out


class SS_TopP(SS_Base):
    """The smallest set of top tokens with cumulative probability >= top_p: the token whose
    probability crosses top_p is kept (1.6.5's ``(cumsum - probs) < top_p``)."""

    def __init__(self, top_p: float):
        self.top_p = top_p

    def run(self, logits: Any, past: list[int], rng: Any) -> Any:
        if not 0.0 < self.top_p < 1.0:
            return logits
        order = np.argsort(-logits, kind="stable")
        p = _probs(logits)[order]
        n = int(np.searchsorted(np.cumsum(p), self.top_p)) + 1
        out = np.full_like(logits, -np.inf)
        out[order[:n]] = logits[order[:n]]
        return out


class SS_RepP(SS_Base):
    def __init__(self, rep_p: float = 1.0, sustain_range: int = int(10e7), decay_range: int = 0):
        self.rep_p = rep_p
        self.sustain_range = sustain_range
        self.decay_range = decay_range

    def run(self, logits: Any, past: list[int], rng: Any) -> Any:
        if self.rep_p == 1.0:
            return logits
        for t in set(past[-self.sustain_range :]):
            x = logits[t]
            logits[t] = x / self.rep_p if x > 0 else x * self.rep_p
        return logits


class SS_PresFreqP(SS_Base):
    def __init__(
        self, pres_p: float = 0.0, freq_p: float = 0.0, sustain_range: int = int(10e7), decay_range: int = 0
    ):
        self.pres_p = pres_p
        self.freq_p = freq_p
        self.sustain_range = sustain_range
        self.decay_range = decay_range

    def run(self, logits: Any, past: list[int], rng: Any) -> Any:
        if not (self.pres_p or self.freq_p):
            return logits
        counts: dict[int, int] = {}
        for t in past[-self.sustain_range :]:
            counts[t] = counts.get(t, 0) + 1
        for t, c in counts.items():
            logits[t] -= self.pres_p + self.freq_p * c
        return logits


class SS_LogitBias(SS_Base):
    def __init__(self, logit_bias: dict[int, float]):
        self.logit_bias = dict(logit_bias)

    def run(self, logits: Any, past: list[int], rng: Any) -> Any:
        for t, b in self.logit_bias.items():
            logits[t] += b
        return logits


class CustomSampler:
    """A chain of steps; the last one picks the token (``SS_Argmax`` or ``SS_Sample``)."""

    def __init__(self, steps: list[SS_Base]):
        self.steps = steps
        self.reqs_past_ids = any(isinstance(s, (SS_RepP, SS_PresFreqP)) for s in steps)

    def fake_sample(self, logits: Any, past: list[int], rng: Any, vocab_size: int) -> int:
        """Fake only: the token this chain picks from 1-D ``logits`` after ``past``."""
        x = np.array(logits, dtype=np.float64)
        if vocab_size < len(x):
            x[vocab_size:] = -np.inf
        for step in self.steps:
            x = step.run(x, past, rng)
            if isinstance(x, int):
                return x
        raise AssertionError("sampler chain must end in SS_Argmax or SS_Sample")
