"""What users hand in, validated once per request or load: ``SamplingParams`` and
``EngineConfig`` (pydantic models whose errors are ``ConfigError``s naming the bad fields).
``unillm._types`` re-exports both beside the values that come out.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from unillm._errors import ConfigError

if TYPE_CHECKING:
    from unillm._structured import OutputFormat

__all__ = ["EngineConfig", "SamplingParams", "UnsupportedPolicy", "normalize_name"]


def normalize_name(name: str) -> str:
    """``"llama.cpp"``, ``"llama-cpp"`` and ``"LlamaCpp"`` all name the same backend."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


UnsupportedPolicy = Literal["strict", "warn", "drop"]


class Validated(BaseModel):
    """A pydantic model whose validation errors are ``ConfigError``s naming the bad fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError.from_validation(exc, type(self).__name__) from exc


_FLAGS = frozenset({"ignore_eos"})


class SamplingParams(Validated):
    """How to sample one completion. Defaults mean "off"; a backend refuses what it cannot do.

    A parameter left at its default is never reported as unsupported; one set to anything else is
    checked against the backend's ``capabilities.sampling`` and handled by the config's
    ``unsupported_params`` policy (``strict`` raises ``UnsupportedParameter``).
    """

    max_tokens: int = Field(default=256, ge=1, description="Most new tokens to generate.")
    temperature: float = Field(default=1.0, ge=0.0, description="0 means greedy decoding.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1 is off.")
    top_k: int | None = Field(default=None, ge=1, description="Keep the k most likely tokens; None is off.")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="Drop tokens below min_p x the top one.")
    repetition_penalty: float = Field(default=1.0, gt=0.0, description="Multiplicative; 1 is off.")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="Additive, OpenAI-style.")
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="Additive, OpenAI-style.")
    seed: int | None = Field(default=None, description="Seed for this request's sampler.")
    stop: tuple[str, ...] = Field(default=(), description="Strings that end the completion; never emitted.")
    stop_token_ids: tuple[int, ...] = Field(default=(), description="Token ids that end the completion.")
    ignore_eos: bool = Field(default=False, description="Keep generating past the end-of-sequence token.")
    min_tokens: int = Field(
        default=0, ge=0, description="Generate at least this many tokens before EOS/stop ids."
    )
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=20,
        description=(
            "Return the chosen token's logprob and, above 0, the k most likely tokens' at each step "
            "(Completion.top_logprobs); the model's own distribution, before temperature and penalties."
        ),
    )
    logit_bias: dict[int, float] | None = Field(default=None, description="Token id -> added logit.")
    response_format: dict[str, Any] | type[BaseModel] | None = Field(
        default=None,
        description="Output format to enforce: a pydantic model class, OpenAI's json_schema or "
        "json_object dict, or a bare JSON schema.",
    )
    lora: str | None = Field(
        default=None, min_length=1, description="Name of the config's LoRA adapter to apply to this request."
    )

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: Any) -> Any:
        # pydantic takes True for 1 and 2.0 for 2; a flag given where a number is meant is a
        # mistake, never "one token"
        if isinstance(value, bool) and info.field_name not in _FLAGS:
            raise ValueError(f"a boolean is not a number; give {info.field_name} a number")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: Any) -> Any:
        if isinstance(value, str):
            return (value,)
        return value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _ids_are_ints(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)) and any(isinstance(t, (bool, float)) for t in value):
            raise ValueError("token ids must be ints")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _ids_not_negative(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(t < 0 for t in value):
            raise ValueError(f"token ids must not be negative, got {[t for t in value if t < 0][:5]}")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys_are_ids(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            for k, v in value.items():
                if isinstance(k, (bool, float)) or (isinstance(k, str) and not k.strip().isdigit()):
                    raise ValueError(f"logit_bias keys are token ids (ints >= 0), got {k!r}")
                if isinstance(v, bool):
                    raise ValueError(f"logit_bias values are numbers, got {v!r}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_ids_not_negative(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if value and any(k < 0 for k in value):
            raise ValueError("logit_bias keys are token ids and must not be negative")
        return value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("response_format", mode="before")
    @classmethod
    def _format_reads(cls, value: Any) -> Any:
        from unillm._structured import output_format

        return None if output_format(value) is None else value  # {"type": "text"} is no format

    @model_validator(mode="after")
    def _min_within_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) is more than max_tokens ({self.max_tokens}): the "
                "output could never hold both; lower min_tokens or raise max_tokens"
            )
        return self

    @model_validator(mode="after")
    def _format_ends_the_output(self) -> SamplingParams:
        if self.response_format is not None and self.ignore_eos:
            raise ValueError(
                "ignore_eos cannot be combined with response_format: the format decides where the "
                "output ends; drop one of them"
            )
        return self

    @property
    def output_format(self) -> OutputFormat | None:
        """``response_format`` read (see ``unillm._structured``), or None."""
        from unillm._structured import output_format

        return output_format(self.response_format)

    def non_default(self) -> list[str]:
        """Names of the fields set to something other than their default, and ``top_logprobs``
        when ``logprobs`` asks for alternatives (above 0), which a backend declares on its own."""
        fields = type(self).model_fields
        names = [name for name in fields if getattr(self, name) != fields[name].default]
        return [*names, "top_logprobs"] if self.logprobs else names


class EngineConfig(Validated):
    """What to load and how. Build it in code, from a dict, a TOML file or the environment.

    ``options`` are the backend's own load options (validated by its ``Options`` model);
    ``backend_options`` holds per-backend tables, so one config file can carry settings for
    every engine and ``UNILLM_BACKEND`` can swap between them without editing the file.
    """

    model: str = Field(
        description="Path of a .gguf file or a model directory, or a Hugging Face name "
        "(org/name[@revision][:QUANT], docs/models.md)."
    )
    backend: str | None = Field(default=None, description="Backend name; None lets auto_engine choose.")
    context_length: int | None = Field(
        default=None, ge=16, le=1 << 30, description="Context window to allocate."
    )
    options: dict[str, Any] = Field(default_factory=dict, description="Backend load options.")
    backend_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Per-backend options, keyed by backend name."
    )
    chat_template: str | None = Field(default=None, description="Jinja chat template overriding the model's.")
    unsupported_params: UnsupportedPolicy = Field(
        default="strict", description="What to do with a sampling parameter the backend cannot honour."
    )
    concurrency: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="Requests the application sends at once: the workload auto_engine selects for "
        "(several users favour a serving engine). Default 1.",
    )
    goal: Literal["latency", "throughput", "cost", "portability"] | None = Field(
        default=None, description="What to optimize when selecting a backend. Default latency."
    )
    task: Literal["generate", "embed", "rerank"] | None = Field(
        default=None,
        description="What the engine is loaded for: generate text, embed texts into vectors, or "
        "rerank documents (a cross-encoder). Default: what the model is (an embedding model, "
        "one with a sentence-transformers pooling or a GGUF pooling type, loads for embed), "
        "else generate (docs/embeddings.md).",
    )
    pooling: Literal["mean", "last", "cls"] | None = Field(
        default=None,
        description="How an embedding engine pools token states into one vector. Default: the "
        "model's (its sentence-transformers pooling config or GGUF pooling type), else last.",
    )
    lora: str | dict[str, str] | None = Field(
        default=None,
        description="A LoRA adapter applied to every request (its path), or several by name "
        "({name: path}) that requests pick with SamplingParams.lora where the backend can.",
    )
    variants: tuple[str, ...] = Field(
        default=(),
        max_length=32,
        description="Other copies of the same model (an AWQ, GPTQ or MLX conversion, a GGUF repo; "
        "paths or Hugging Face names) auto_engine may load instead of model: with no backend "
        "forced, the highest precision an installed backend runs that fits (docs/models.md).",
    )

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_paths(cls, value: Any) -> Any:
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if isinstance(value, Mapping):
            value = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in value.items()}
            if not value:
                raise ValueError("an empty mapping names no adapter; leave lora unset")
        for name, path in ({"": value} if isinstance(value, str) else dict(value or {})).items():
            if not isinstance(name, str) or (not name and not isinstance(value, str)):
                raise ValueError(f"adapter names are non-empty strings, got {name!r}")
            if isinstance(path, str) and not Path(path).expanduser().exists():
                where = f"adapter {name!r}" if name else "the adapter"
                raise ValueError(
                    f"{where} path {path!r} does not exist; give a LoRA adapter's file or directory"
                )
        return value

    def lora_adapters(self) -> dict[str, Path]:
        """``lora`` as {name: path}: a lone path is named ``"default"``."""
        if self.lora is None:
            return {}
        items = {"default": self.lora} if isinstance(self.lora, str) else self.lora
        return {name: Path(path).expanduser() for name, path in items.items()}

    def options_for(self, backend: str) -> dict[str, Any]:
        """``options`` merged under the ``backend_options`` table of ``backend``, if any."""
        merged = dict(self.options)
        for name, table in self.backend_options.items():
            if normalize_name(name) == normalize_name(backend):
                merged.update(table)
        return merged
