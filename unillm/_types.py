"""The values unillm passes around.

Two kinds, on purpose: pydantic models validate what users hand in (``SamplingParams``,
``EngineConfig``, defined in ``unillm._params`` and re-exported here), once per request or load;
slotted frozen dataclasses carry what comes out (``Chunk`` once per token, ``Completion``,
``Usage``, ``Timings``, ``KVStats``) and cost next to nothing to create. No engine type (a
tensor, an ``mx.array``) ever appears in a public field.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Literal

from unillm._errors import ConfigError, OutOfMemory
from unillm._params import EngineConfig, SamplingParams, normalize_name

if TYPE_CHECKING:
    from unillm._structured import OutputFormat

__all__ = [
    "STANDARD_SAMPLING",
    "Availability",
    "Capabilities",
    "ChatMessage",
    "Chunk",
    "Completion",
    "Cost",
    "Embeddings",
    "EngineConfig",
    "Fallback",
    "FinishReason",
    "KVStats",
    "Pooling",
    "Ranked",
    "Reranked",
    "SamplingParams",
    "Suitability",
    "Timings",
    "ToolCall",
    "Usage",
    "normalize_name",
]

#: How token states become one vector (docs/embeddings.md): their mean, the last token's, the first's.
Pooling = Literal["mean", "last", "cls"]
#: "tool_calls": the model called a tool (``Completion.tool_calls``); it stopped to let it run.
FinishReason = Literal["stop", "length", "tool_calls", "cancelled", "error"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call of a tool the model made: the tool's ``name``, its ``arguments`` parsed from the
    JSON the model wrote, and an ``id`` (``call_<hex>``) a ``tool`` message answers by."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    @classmethod
    def coerce(cls, call: Any, where: str) -> ToolCall:
        """A ``ToolCall`` from itself or OpenAI's ``{"id", "type": "function", "function":
        {"name", "arguments"}}`` (arguments as a dict or its JSON text); a custom tool's call
        (``"type": "custom", "custom": {"name", "input"}``, free text) has that text as its one
        argument, ``input``."""
        if isinstance(call, ToolCall):
            return call
        fn = call.get("function", call) if isinstance(call, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else None
        args = fn.get("arguments", {}) if isinstance(fn, Mapping) else None
        custom = call.get("custom") if isinstance(call, Mapping) and call.get("type") == "custom" else None
        if isinstance(custom, Mapping) and isinstance(custom.get("input"), str):
            name, args = custom.get("name"), {"input": custom["input"]}
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if not isinstance(name, str) or not isinstance(args, dict):
            raise ConfigError(
                f"{where} must be a ToolCall or {{'function': {{'name': str, 'arguments': a JSON "
                f"object}}}}, got {call!r:.200}"
            )
        call_id = call.get("id") if isinstance(call, Mapping) else None
        return cls(name, args, call_id) if isinstance(call_id, str) else cls(name, args)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat turn. Plain ``{"role": ..., "content": ...}`` dicts are accepted everywhere too.
    An assistant turn may carry the ``tool_calls`` it made (its content may then be missing); a
    ``tool`` turn answers one of them by ``tool_call_id``."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    @classmethod
    def coerce(cls, message: ChatMessage | Mapping[str, Any]) -> ChatMessage:
        if isinstance(message, ChatMessage):
            return message
        calls = message.get("tool_calls") if isinstance(message, Mapping) else None
        if (
            not isinstance(message, Mapping)
            or "role" not in message
            or ("content" not in message and not calls)
        ):
            raise ConfigError(
                f"a chat message needs 'role' and 'content', got {message!r}; "
                "pass [{'role': 'user', 'content': '...'}]"
            )
        role, content = message["role"], message.get("content")
        if role not in ("system", "user", "assistant", "tool"):
            raise ConfigError(f"unknown chat role {role!r}; use 'system', 'user', 'assistant' or 'tool'")
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise ConfigError(f"chat content must be a string, got {type(content).__name__}")
        if calls and role != "assistant":
            raise ConfigError(f"only an assistant message carries tool_calls, not a {role!r} one")
        if calls is not None and not isinstance(calls, (list, tuple)):
            raise ConfigError(f"tool_calls must be a list, got {type(calls).__name__}")
        call_id = message.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise ConfigError(f"tool_call_id must be a string, got {type(call_id).__name__}")
        parsed = tuple(ToolCall.coerce(c, f"tool_calls[{i}]") for i, c in enumerate(calls or ()))
        return cls(role, content, parsed, call_id)


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request. ``cached_prompt_tokens`` is None when the engine cannot tell;
    ``draft_tokens``/``accepted_draft_tokens`` (speculative decoding: tokens a draft model
    proposed, and how many of them the target kept) are None unless the engine reports them."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int | None = None
    draft_tokens: int | None = None
    accepted_draft_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Timings:
    """Where one request's time went, in seconds. Rates are tokens per second, None when undefined.

    ``ttft_s`` is measured by unillm from the ``stream()`` call (tokenizing and waiting for a busy
    engine included) to the first token; ``prefill_s`` and
    ``decode_s`` come from the engine's own counters where it has them (``source`` says which).
    """

    ttft_s: float
    prefill_s: float
    decode_s: float
    total_s: float
    prefill_tokens_per_s: float | None
    decode_tokens_per_s: float | None
    source: Literal["engine", "wall"] = "wall"
    peak_memory_bytes: int | None = None  # the engine's peak memory so far, where it reports one
    queue_s: float | None = None  # waiting for a slot in a batching engine's scheduler, where it reports it


@dataclass(frozen=True, slots=True)
class Chunk:
    """A piece of a streamed completion: created once per token, so it stays small.

    ``finish_reason``, ``usage``, ``timings``, ``stop_sequence``, ``tool_calls``: last chunk only.
    """

    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    logprobs: tuple[float, ...] | None = None
    stop_sequence: str | None = None  # the stop string that ended the completion, if one did
    tool_calls: tuple[ToolCall, ...] = ()  # the calls parsed from the whole text (chat with tools)
    #: with ``logprobs=k`` above 0: per token, the k most likely ``(token_id, logprob)``, best first
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole completion: the fold of a stream."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    logprobs: tuple[float, ...] | None = None
    stop_sequence: str | None = None  # the stop string that ended the completion, if one did
    output_format: OutputFormat | None = None  # the response_format it was generated under
    #: the tool calls the model made (chat with ``tools``); ``text`` keeps what it wrote for them
    tool_calls: tuple[ToolCall, ...] = ()
    #: with ``logprobs=k`` above 0: per token, the k most likely ``(token_id, logprob)``, best first
    #: (ties: the lower id first); ``logprobs`` holds the chosen token's, which may be outside them
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None

    def parsed(self) -> Any:
        """The text parsed and validated under the request's ``response_format``: the pydantic
        instance when a model class was given, else the JSON value. Raises
        ``StructuredOutputError`` (its ``.raw`` holds the text) when the output does not parse or
        validate, e.g. when ``max_tokens`` cut it."""
        if self.output_format is None:
            raise ConfigError(
                "this completion was generated without a response_format; pass response_format= "
                "(a pydantic model class or a JSON schema) to generate() or chat() to parse it"
            )
        return self.output_format.parse(self.text, self.finish_reason)


@dataclass(frozen=True, slots=True)
class KVStats:
    """The KV cache as the engine sees it. None means the engine cannot tell, never zero.

    ``capacity_tokens`` is what the cache can hold, ``used_tokens`` what it holds now;
    ``bytes_per_token`` = 2 x layers x kv_heads x head_dim x bytes per element. A batching engine
    may say how many sequences run now (``running_sequences``) and the tokens each holds
    (``sequence_tokens``).
    """

    capacity_tokens: int | None = None
    used_tokens: int | None = None
    bytes_per_token: int | None = None
    capacity_bytes: int | None = None
    used_bytes: int | None = None
    block_size: int | None = None
    total_blocks: int | None = None
    used_blocks: int | None = None
    dtype: str | None = None
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    running_sequences: int | None = None
    sequence_tokens: tuple[int, ...] | None = None

    @property
    def prefix_hit_rate(self) -> float | None:
        if not self.prefix_cache_queries or self.prefix_cache_hits is None:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def utilization(self) -> float | None:
        if not self.capacity_tokens or self.used_tokens is None:
            return None
        return self.used_tokens / self.capacity_tokens


class Embeddings:
    """Vectors of a batch of inputs, in their order: ``vectors`` as lists of floats, ``array()`` as
    one float32 numpy array (rows: inputs), ``usage.prompt_tokens`` the tokens embedded. The
    ``pooling`` used (None: the server's model's, not known here), whether the vectors are
    ``normalized`` (unit length) and their ``dimensions`` travel with them."""

    __slots__ = ("_array", "_lists", "dimensions", "normalized", "pooling", "truncated", "usage")

    def __init__(
        self,
        vectors: Any,
        usage: Usage,
        pooling: Pooling | None,
        normalized: bool,
        *,
        truncated: tuple[int, ...] = (),
    ) -> None:
        self._array = vectors if hasattr(vectors, "shape") else None
        self._lists: list[list[float]] | None = None
        if self._array is not None:
            self.dimensions = int(self._array.shape[1])
        else:
            self._lists = [list(v) for v in vectors]
            self.dimensions = len(self._lists[0]) if self._lists else 0
        self.usage = usage
        self.pooling = pooling
        self.normalized = normalized
        self.truncated = truncated  # indices of the inputs cut to the context (truncate=True)

    @property
    def vectors(self) -> list[list[float]]:
        if self._lists is None:
            self._lists = self._array.tolist()  # type: ignore[union-attr]
        return self._lists

    def array(self) -> Any:
        """The vectors as a (inputs x dimensions) float32 numpy array."""
        if self._array is None:
            import numpy as np

            self._array = np.asarray(self._lists, dtype=np.float32).reshape(len(self), self.dimensions)
        return self._array

    def __len__(self) -> int:
        return len(self._lists) if self._lists is not None else int(self._array.shape[0])  # type: ignore[union-attr]

    def __getitem__(self, i: int) -> list[float]:
        return self.vectors[i]

    def __iter__(self) -> Any:
        return iter(self.vectors)

    def __repr__(self) -> str:
        return (
            f"Embeddings({len(self)} x {self.dimensions}, pooling={self.pooling!r}, "
            f"normalized={self.normalized}, prompt_tokens={self.usage.prompt_tokens})"
        )


@dataclass(frozen=True, slots=True)
class Ranked:
    """One document of a rerank: its ``index`` in the documents given and its ``score`` (the
    model's relevance logit; higher is more relevant)."""

    index: int
    score: float


@dataclass(frozen=True, slots=True)
class Reranked:
    """A rerank's results, most relevant first (``top_n`` of them when asked), and its usage."""

    results: tuple[Ranked, ...]
    usage: Usage

    def __iter__(self) -> Any:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)


#: Every sampling parameter but ``response_format``: what a full-featured local engine honours.
#: ``top_logprobs`` is ``logprobs`` above 0 (the alternatives beside the chosen token's logprob),
#: declared on its own: a backend may give the chosen token's logprob only.
STANDARD_SAMPLING = frozenset(
    {
        "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
        "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
        "logprobs", "top_logprobs", "logit_bias",
    }
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do, declared as class data so the selector and docs can read it."""

    # max_tokens and stop are honoured by the base class for every backend, listed or not
    sampling: frozenset[str] = frozenset({"max_tokens", "stop", "temperature"})
    stream: bool = True
    chat: bool = True
    token_prompts: bool = True
    # chunks carry the token ids they decode (False: a remote server that streams text only)
    token_ids: bool = True
    batching: bool = False
    lora: bool = False
    embeddings: bool = False  # embed() with task="embed" (docs/embeddings.md)
    rerank: bool = False  # rerank() with task="rerank": a cross-encoder's scores
    devices: frozenset[str] = frozenset({"cpu"})
    # speculative decoding with a draft model (the ``draft_model`` load option)
    speculative: bool = False


@dataclass(frozen=True, slots=True)
class Availability:
    """Whether a backend can run here, and if not, why and how to fix it."""

    available: bool
    reason: str = ""
    install_hint: str | None = None
    version: str | None = None


@dataclass(frozen=True, slots=True)
class Suitability:
    """How well a backend fits a model, machine and workload; higher scores win.

    ``blockers`` make the backend ineligible; ``reasons`` explain the score either way.
    """

    score: float
    reasons: tuple[str, ...] = ()
    blockers: tuple[str, ...] = field(default=())


class Cost(IntEnum):
    """What a fallback step costs the user, cheapest first: ``auto_engine`` tries steps in this
    order, so it keeps as much of what was asked as loads."""

    FREE = 0  # nothing the user can notice (more context than the model was trained for)
    QUALITY = 1  # slightly different numbers (a quantized KV cache)
    SPEED = 2  # slower, same output (fewer layers on the GPU)
    CAPABILITY = 3  # the engine can do less than asked (a shorter context)


@dataclass(frozen=True)
class Fallback:
    """One step ``auto_engine`` may take when loading a backend fails, declared by the backend
    (``Engine.fallbacks``). Steps apply on top of one another, cheapest ``cost`` first.

    - ``label``: what the step does, as ``selection.steps`` records it (``"kv_cache_type=q8_0"``).
    - ``config``: ``EngineConfig`` fields it changes (``{"context_length": 2048}``).
    - ``options``: backend options it changes (``{"kv_cache_type": "q8_0"}``).
    - ``context_length`` / ``kv_cache_dtype``: the workload after the step, in the planner's terms
      (``kv_cache_dtype`` as ``unillm.backend.kv_dtype`` names it), so ``auto_engine`` can skip
      a step the memory plan says still cannot fit; None: unchanged.
    - ``on``: the errors the step answers (default: ``OutOfMemory``).
    """

    label: str
    cost: Cost = Cost.QUALITY
    config: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    context_length: int | None = None
    kv_cache_dtype: str | None = None
    on: tuple[type[BaseException], ...] = ()

    def answers(self, error: BaseException) -> bool:
        """Whether this step is worth trying after ``error``."""
        return isinstance(error, self.on or OutOfMemory)
