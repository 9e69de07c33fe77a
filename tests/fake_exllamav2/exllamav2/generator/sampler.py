"""ExLlamaV2Sampler: its Settings dataclass and a numpy version of its sampling chain, filters
included (exllamav2/generator/sampler.py, 0.3.x: ``sample``'s "Evaluate filters" block)."""

from __future__ import annotations

from copy import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from exllamav2._tensor import Tensor


class ExLlamaV2Sampler:
    @dataclass
    class Settings:
        token_repetition_penalty: float = 1.025
        token_repetition_range: int = -1
        token_repetition_decay: int = 0
        token_frequency_penalty: float = 0.0
        token_presence_penalty: float = 0.0
        temperature: float = 0.8
        smoothing_factor: float = 0.0
        min_temp: float = 0
        max_temp: float = 0.0
        temp_exponent: float = 1.0
        top_k: int = 50
        top_p: float = 0.8
        top_a: float = 0.0
        min_p: float = 0
        tfs: float = 0
        typical: float = 0
        skew: float = 0
        temperature_last: bool = False
        mirostat: bool = False
        mirostat_tau: float = 1.5
        mirostat_eta: float = 0.1
        mirostat_mu: float | None = None
        token_bias: Any = None
        cfg_scale: float | None = None
        post_sampling_hooks: list[Any] = field(default_factory=list)
        dry_allowed_length: int = 2
        dry_base: float = 1.75
        dry_multiplier: float = 0.0
        dry_sequence_breakers: set[int] | None = None
        dry_range: int = 0
        dry_max_ngram: int = 20
        xtc_probability: float = 0.0
        xtc_threshold: float = 0.1
        xtc_ignore_tokens: frozenset[int] | None = None

        @staticmethod
        def greedy(**kwargs: Any) -> ExLlamaV2Sampler.Settings:
            defaults: dict[str, Any] = {
                "temperature": 1.0,
                "token_repetition_penalty": 1.0,
                "top_p": 0.0,
                "top_k": 1,
            }
            defaults.update(kwargs)
            return ExLlamaV2Sampler.Settings(**defaults)

        def clone(self) -> ExLlamaV2Sampler.Settings:
            return copy(self)

    @staticmethod
    def sample(
        logits: Any,
        settings: ExLlamaV2Sampler.Settings,
        sequence_ids: list[int],
        random: float,
        tokenizer: Any,
        prefix_token: Any = None,
        return_top_tokens: int = 0,
        blocked_tokens: list[int] | None = None,
        filters: Any = None,
        filter_prefer_eos: bool = False,
        sync: bool = False,
    ) -> tuple[Tensor, None, None, Tensor, bool]:
        """One token from 1-D ``logits``: penalties, the filters' allowed tokens, temperature,
        top-k, top-p, min-p, then the point ``random`` in [0, 1) of the remaining distribution
        (candidates by falling probability), as exllamav2's sample_basic does. The last value
        says whether the token is one of the filters' end tokens."""
        logits = np.array(logits, dtype=np.float64)
        s = settings
        if s.token_repetition_penalty != 1.0 or s.token_frequency_penalty or s.token_presence_penalty:
            window = (
                sequence_ids if s.token_repetition_range < 0 else sequence_ids[-s.token_repetition_range :]
            )
            counts: dict[int, int] = {}
            for t in window:
                counts[t] = counts.get(t, 0) + 1
            for t, c in counts.items():
                x = logits[t]
                x = x / s.token_repetition_penalty if x > 0 else x * s.token_repetition_penalty
                logits[t] = x - s.token_frequency_penalty * c - s.token_presence_penalty
        if blocked_tokens:
            logits[blocked_tokens] = -1e30
        filters = filters or []
        assert not (filters and all(f.can_mask_logits() for f in filters)), "logit-mask filters: not faked"
        end_tokens = None
        if filters:  # the allowed sets intersect, the end sets unite; a filter may return None for either
            pass_tokens = None
            pts, ets = [], []
            for f in filters:
                pt, et = f.get_next()
                if pt is not None:
                    pts.append(pt)
                    ets.append(et)
            for pt0, et0 in zip(pts, ets, strict=True):
                pt, et = (set(pt0), set(et0)) if len(pts) > 1 and not isinstance(pt0, set) else (pt0, et0)
                if pt is not None:
                    pass_tokens = pt if pass_tokens is None else pass_tokens & pt
                if et is not None:
                    end_tokens = et if end_tokens is None else end_tokens | et
            if pass_tokens is not None:
                assert len(pass_tokens), "Filter excluded all tokens"
                if len(pass_tokens) == 1 and return_top_tokens == 0 and prefix_token is None:
                    # one token passes: taken without sampling, probability 1
                    single = next(iter(pass_tokens))
                    return Tensor([[single]]), None, None, Tensor([[1.0]], np.float32), single in end_tokens
                if filter_prefer_eos and tokenizer.eos_token_id in pass_tokens:
                    pass_tokens = [tokenizer.eos_token_id]
                keep = np.zeros(logits.shape[-1], dtype=bool)
                keep[sorted(pass_tokens) if isinstance(pass_tokens, set) else pass_tokens] = True
                logits[~keep] = -np.inf  # sample_basic's logit_filter: the rest are never drawn
        vs = tokenizer.get_vocab_size()
        if vs < logits.shape[-1]:
            logits[vs:] = -np.inf
        temperature, top_k = s.temperature, s.top_k
        if temperature < 0.01:
            temperature, top_k = 1.0, 1
        order = np.argsort(-logits, kind="stable")
        z = logits[order] / temperature
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        n = len(probs)
        if 0 < top_k < n:
            n = top_k
        if n > 1 and 0.0 < s.top_p < 1.0:
            n = min(n, int(np.searchsorted(np.cumsum(probs[:n]) / probs[:n].sum(), s.top_p)) + 1)
        if n > 1 and 0.0 < s.min_p < 1.0:
            n = max(1, int(np.sum(probs[:n] >= s.min_p * probs[0])))
        if filters:  # never past the last allowed candidate (float rounding of the cumulative sum)
            n = max(1, min(n, int(np.count_nonzero(probs > 0))))
        kept = probs[:n] / probs[:n].sum()
        idx = min(int(np.searchsorted(np.cumsum(kept), random, side="right")), n - 1)
        token = int(order[idx])
        end_filter = bool(filters) and end_tokens is not None and token in end_tokens
        return Tensor([[token]]), None, None, Tensor([[float(kept[idx])]], np.float32), end_filter
