"""``GgufishEngine``: reads a GGUF's facts and echoes the prompt's words; out of memory until it
has walked down to one slot (its own fallback steps)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from unillm import ModelFormatError, OutOfMemory
from unillm.backend import (
    Capabilities,
    Cost,
    Engine,
    EngineConfig,
    Facts,
    Fallback,
    Request,
    SamplingParams,
    Suitability,
)
from unillm.testing import WordVocab

#: every load attempt, as (slots, context_length): the test reads the walk from here
LOADS: list[tuple[int, int | None]] = []


class GgufishOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    slots: int = 8  # sequences served at once
    fits_at: int = 1  # the most slots this machine's memory takes (a test knob)


class GgufishEngine(Engine[GgufishOptions]):
    name: ClassVar[str] = "ggufish"
    formats: ClassVar[frozenset[str]] = frozenset({"gguf"})
    capabilities: ClassVar[Capabilities] = Capabilities(batching=True)
    Options: ClassVar[type[BaseModel]] = GgufishOptions
    install_hint: ClassVar[str | None] = "pip install unillm-ggufish"

    @classmethod
    def suitability(cls, hardware: Any, model: Any, workload: Any, plan: Any = None) -> Suitability:
        fit = super().suitability(hardware, model, workload)
        if fit.blockers:
            return fit
        # above the 1.0 a built-in scores for a format it reads: with its guide entry's rank-0
        # bonus (+2.0) this outranks llama.cpp's 1.0 + 2.0 where the entry applies, and only there
        return Suitability(1.5, (*fit.reasons, "serves several sequences from one GGUF"))

    @classmethod
    def fallbacks(cls, config: EngineConfig, facts: Facts) -> list[Fallback]:
        slots = int(config.options_for(cls.name).get("slots", 8))
        mine = []
        while slots > 1:
            slots //= 2
            mine.append(Fallback(f"slots={slots}", Cost.SPEED, options={"slots": slots}))
        return [*super().fallbacks(config, facts), *mine]

    def _load(self) -> None:
        model = self.facts.model  # what auto_engine inspected, handed in
        if model is None or model.format != "gguf":
            raise ModelFormatError(f"{self.config.model!r} is not a GGUF model")
        opts: GgufishOptions = self.options
        LOADS.append((opts.slots, self.config.context_length))
        if opts.slots > opts.fits_at:
            raise OutOfMemory(f"{opts.slots} slots of {model.layers} layers do not fit")
        self._vocab = WordVocab()

    def _encode(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        return self._vocab.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def _stream(self, ids: list[int], params: SamplingParams, req: Request) -> Iterator[Any]:
        req.prompt_tokens = len(ids)
        for i in ids[: params.max_tokens]:
            yield self._vocab.decode([i]), (i,), None
        req.finish_reason = "stop"
