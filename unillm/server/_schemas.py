"""Request bodies the server accepts, validated once at the edge.

Every model forbids unknown fields: a field the server does not know is a 400 naming it, never
silently dropped. Fields that OpenAI or Anthropic define but that change nothing about the output
(``user``, ``metadata``) are accepted and ignored; the sampling extensions vLLM's server accepts
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``) are accepted too.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """``null`` for an optional field means its default, as OpenAI's and Anthropic's documents
        mark them nullable (``"stream": null``, ``"n": null``); a required field stays refused."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool = True  # random padding against length side channels: none is added


class _Sampling(_Body):
    """Fields chat and completions share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=0)  # 0: the prompt counted, nothing generated
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)  # 0: the likeliest token only
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM-style extensions
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None
    model_config = ConfigDict(extra="allow")  # image_url and the like: refused by type, below


class ChatMessageIn(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None  # an assistant turn that refused: its text stands as the content
    audio: dict[str, Any] | None = None  # an earlier audio answer: refused (no audio here)
    function_call: dict[str, Any] | None = None  # the deprecated shape of tool_calls: refused


class ChatRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    # hints for OpenAI's own service, accepted and without effect here (docs/server.md)
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    # OpenAI's, valid, not served by a local engine: refused as unsupported_parameter when given
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None

    def unsupported(self) -> list[str]:
        """The fields given that this server cannot honour (``modalities`` only text is)."""
        given = [n for n in ("audio", "prediction", "verbosity", "web_search_options", "reasoning_effort")
                 if getattr(self, n) is not None]  # fmt: skip
        if self.modalities is not None and set(self.modalities) - {"text"}:
            given.append("modalities")
        return given


class CompletionRequest(_Sampling):
    # required, and nullable: null is OpenAI's default prompt (the start of a document)
    prompt: str | list[int] | list[str] | list[list[int]] | None
    logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_is_a_count(cls, value: Any) -> Any:
        """``false`` asks for none (clients send it); ``true`` says no count: refused, not read as 1."""
        if value is False:
            return None
        if value is True:
            raise ValueError("logprobs is a count of alternatives per token (0 to 20), not true")
        return value

    echo: bool = False
    best_of: int | None = Field(default=None, ge=0)  # 0: as if not given (the document allows it)
    suffix: str | None = None
    response_format: dict[str, Any] | None = None


class TokenizeRequest(_Body):
    model: str
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str
    tokens: list[int]


# ---- Anthropic Messages ----


class AnthropicBlock(_Body):
    type: str
    text: str | None = None
    # tool_use (an assistant's call) and tool_result (the user's answer to it)
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    model_config = ConfigDict(extra="allow")  # cache_control and the like


class AnthropicMessage(_Body):
    role: Literal["user", "assistant", "system"]  # system: an instruction among the turns
    content: str | list[AnthropicBlock]


class MessagesRequest(_Body):
    model: str
    max_tokens: int = Field(ge=0)  # 0: the prompt counted, nothing generated
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)  # 0: the likeliest token only
    top_k: int | None = Field(default=None, ge=0)  # 0: no cut (the document allows it)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None
    # hints for Anthropic's own service, accepted and without effect here (the engines' prefix
    # caches reuse a repeated prompt by themselves)
    cache_control: dict[str, Any] | None = None
    inference_geo: str | None = None
    # Anthropic's, valid, not served here: refused as unsupported_parameter when given
    container: Any = None
    output_config: dict[str, Any] | None = None


class CountTokensRequest(_Body):
    """``/v1/messages/count_tokens``: what a Messages request's prompt would be, without sampling."""

    cache_control: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


# ---- embeddings and rerank ----


class EmbeddingRequest(_Body):
    """``/v1/embeddings``, OpenAI's shape: ``input`` is one text, a list of texts, one list of
    token ids or a list of them. ``truncate`` (Hugging Face TEI's name) cuts an input longer than
    the model takes to its first tokens instead of refusing it."""

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    truncate: bool = False

    @field_validator("input", mode="before")
    @classmethod
    def _one_kind_of_input(cls, value: Any) -> Any:
        """One message for a mixed or odd list, rather than one per member of the union."""
        if isinstance(value, str):
            return value
        kinds = {type(v) for v in value} if isinstance(value, list) else {dict}
        if len(kinds) <= 1 and kinds <= {str, int, list}:
            return value
        raise ValueError("input is a text, a list of texts, a list of token ids or a list of token id lists")


class RerankDocument(_Body):
    text: str


class RerankRequest(_Body):
    """``/v1/rerank`` and ``/v2/rerank``, Jina's and Cohere's shape: a document is a text or
    ``{"text": ...}``; ``return_documents`` (default true, as Jina's) echoes each one's text."""

    model: str
    query: str
    documents: list[str | RerankDocument] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    user: str | None = None
