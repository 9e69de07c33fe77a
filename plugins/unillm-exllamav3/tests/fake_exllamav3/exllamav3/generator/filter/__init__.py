"""The filter base class only (exllamav3/generator/filter/filter.py): the fake models no filter
(llguidance, formatron); a Job given one asserts."""


class Filter:
    def __init__(self, tokenizer, trigger_token=None, prefix_str=None, eos_after_completed=False):  # type: ignore[no-untyped-def]
        self.tokenizer = tokenizer
        self.trigger_token = trigger_token
        self.prefix_str = prefix_str
        self.eos_after_completed = eos_after_completed
        self.is_active = trigger_token is None


__all__ = ["Filter"]
