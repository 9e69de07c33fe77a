"""Filter, the base of exllamav3's constrained-sampling filters (exllamav3/generator/filter/filter.py,
the same in v1.4.1 and v1.6.5): trigger token, ``feed`` (advance on an emitted token; True when it
completed and ``eos_after_completed``), ``reset``; less the journal that banned strings rewind
with."""

from __future__ import annotations

from typing import Any


class Filter:
    def __init__(
        self, tokenizer: Any, trigger_token: int | None, prefix_str: str | None, eos_after_completed: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.trigger_token = trigger_token
        self.prefix_str = prefix_str
        self.eos_after_completed = eos_after_completed
        self.job: Any = None
        self.is_active = trigger_token is None

    def feed(self, token: int) -> bool:
        if not self.is_active:
            if token == self.trigger_token:
                self.is_active = True
                self.reset()
            return False
        self.accept_token(token)
        if self.is_completed():
            self.is_active = False
            return self.eos_after_completed
        return False

    def reset(self) -> None:
        raise NotImplementedError

    def accept_token(self, token: int) -> None:
        raise NotImplementedError

    def get_next_logit_mask(self) -> Any:
        raise NotImplementedError

    def is_completed(self) -> bool:
        raise NotImplementedError

    def use_background_worker(self) -> bool:
        return False

    def attach(self, job: Any) -> None:
        self.job = job
