"""ExLlamaV2Filter: the base class of exllamav2's sampling filters, as in
exllamav2/generator/filters/base.py (0.3.x), without torch.

A filter is told the completion so far one token at a time (``begin``, then ``feed`` after each
sampled token) and says what may come next: ``next()`` returns ``(pass_tokens, end_tokens)``, the
ids the sampler may draw from (None: any) and those whose drawing ends the job (``eos_reason``
"end_filter"). ``use_background_worker()`` asks the generator to run ``next()`` on its thread pool
while the forward pass runs. The logit-mask path (``can_mask_logits``/``mask_logits``) works on
torch tensors: not modelled here, as in the base class it is off by default.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class ExLlamaV2Filter:
    # For compatibility
    allow_return_type_list: bool = True

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.sequence_str = ""
        self.background_result: Future[Any] | None = None

    def clone(self, c: Any = None) -> Any:
        if c is None:
            c = ExLlamaV2Filter.__new__(ExLlamaV2Filter)
        c.model = self.model
        c.tokenizer = self.tokenizer
        c.sequence_str = self.sequence_str
        return c

    def begin(self, prefix_str: str) -> None:
        raise NotImplementedError

    def feed(self, token: Any) -> None:
        raise NotImplementedError

    def next(self) -> tuple[Any, Any]:
        raise NotImplementedError

    def use_background_worker(self) -> bool:
        return False

    def can_mask_logits(self) -> bool:
        return False

    def prepare_logit_mask(self) -> bool:
        raise NotImplementedError

    def mask_logits(self, logits: Any) -> Any:
        raise NotImplementedError

    def background_next(self, pool: ThreadPoolExecutor) -> None:
        assert self.background_result is None
        self.background_result = pool.submit(self.next)

    def background_prepare_logit_mask(self, pool: ThreadPoolExecutor) -> None:
        assert self.background_result is None
        self.background_result = pool.submit(self.prepare_logit_mask)

    def background_drop(self) -> None:
        if self.background_result is not None:
            self.background_result.result()
            self.background_result = None

    def get_next(self, mask: bool = False) -> Any:
        if self.background_result is None:
            return self.prepare_logit_mask() if mask else self.next()
        r = self.background_result.result()
        self.background_result = None
        return r
