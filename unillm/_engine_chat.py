"""``Engine``'s chat methods (``ChatMethods``, a base of ``Engine``) and what they share: messages
to a prompt under the chat template, the tools of a request (``unillm._tools``) into that prompt
and its sampling parameters, and the calls parsed from the reply onto the stream's last chunk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from unillm._checks import check_text
from unillm._errors import ConfigError, UnsupportedParameter
from unillm._lifetime import Lifetime
from unillm._run import afold, fold
from unillm._tools import InvalidTools, ToolSpec, parse_tool_calls, read_tools
from unillm._types import ChatMessage, Chunk, SamplingParams

if TYPE_CHECKING:
    from unillm._types import Completion, EngineConfig

__all__ = ["ChatMethods", "chat_request", "finish_with_calls", "forced_params", "render"]

Messages = Sequence[ChatMessage | Mapping[str, Any]]
Params = SamplingParams | Mapping[str, Any] | None
Tools = Sequence[Mapping[str, Any]]  # OpenAI's shape: {"type": "function", "function": {...}}
ToolChoice = str | Mapping[str, Any] | None  # "auto", "none", "required" or {"type": "function", ...}


class ChatMethods(Lifetime):
    """The chat half of ``Engine``'s derived methods: each renders the messages (and tools) under
    the chat template and streams or folds ``Engine.stream``/``astream``."""

    if TYPE_CHECKING:  # what Engine provides
        config: EngineConfig

        def _chat_template(self) -> str | None: ...
        def _special_tokens(self) -> dict[str, str]: ...
        def _params(self, params: Params, overrides: Mapping[str, Any]) -> SamplingParams: ...
        def stream(self, prompt: Any, params: Params = None, **overrides: Any) -> Iterator[Chunk]: ...
        def astream(self, prompt: Any, params: Params = None, **overrides: Any) -> AsyncIterator[Chunk]: ...

    def render_chat(
        self, messages: Messages, *, add_generation_prompt: bool = True, tools: Tools | None = None
    ) -> str:
        """The prompt text ``messages`` become under the chat template (sandboxed Jinja), with
        ``tools`` (OpenAI's shape) in its ``tools`` variable when given."""
        spec = read_tools(tools) if tools else None
        return render(self, messages, add_generation_prompt, spec.tools if spec else None)

    def stream_chat(
        self,
        messages: Messages,
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        tools: Tools | None = None,
        tool_choice: ToolChoice = None,
        **overrides: Any,
    ) -> Iterator[Chunk]:
        """Stream the assistant's reply to ``messages``. With ``tools`` (OpenAI's shape), the last
        chunk carries the ``tool_calls`` parsed from the reply (``finish_reason`` "tool_calls");
        ``tool_choice`` "required" or a named tool constrains decoding to a call (docs/structured.md)."""
        prompt, sp, spec = chat_request(self, messages, params, overrides, tools, tool_choice)
        return calls_in(self.stream(prompt, sp), spec)

    def chat(
        self,
        messages: Messages,
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        tools: Tools | None = None,
        tool_choice: ToolChoice = None,
        **overrides: Any,
    ) -> Completion:
        """The assistant's whole reply to ``messages``; ``tools`` as in ``stream_chat``."""
        sp = self._params(params, overrides)
        return fold(self.stream_chat(messages, sp, **_tool_args(tools, tool_choice)), sp)

    async def astream_chat(
        self,
        messages: Messages,
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        tools: Tools | None = None,
        tool_choice: ToolChoice = None,
        **overrides: Any,
    ) -> AsyncIterator[Chunk]:
        """Async ``stream_chat``."""
        prompt, sp, spec = chat_request(self, messages, params, overrides, tools, tool_choice)
        async for chunk in acalls_in(self.astream(prompt, sp), spec):
            yield chunk

    async def achat(
        self,
        messages: Messages,
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        tools: Tools | None = None,
        tool_choice: ToolChoice = None,
        **overrides: Any,
    ) -> Completion:
        """Async ``chat``."""
        sp = self._params(params, overrides)
        return await afold(self.astream_chat(messages, sp, **_tool_args(tools, tool_choice)), sp)


def _tool_args(tools: Any, tool_choice: Any) -> dict[str, Any]:
    """Only the tool arguments given: a backend that overrides ``stream_chat`` with the signature
    it had before tools (``messages, params, **overrides``) keeps working for plain chats."""
    args: dict[str, Any] = {}
    if tools is not None:
        args["tools"] = tools
    if tool_choice is not None:
        args["tool_choice"] = tool_choice
    return args


def render(
    engine: ChatMethods,
    messages: Any,
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """``Engine.render_chat``: ``tools`` already read (``read_tools``)."""
    from unillm._chat import render_chat_template

    if isinstance(messages, (str, bytes, Mapping)) or not hasattr(messages, "__iter__"):
        raise ConfigError(
            f"chat() takes a list of messages, got {type(messages).__name__}; pass "
            "[{'role': 'user', 'content': '...'}]"
        )
    msgs = [ChatMessage.coerce(m) for m in messages]
    if not msgs:
        raise ConfigError("chat() needs at least one message")
    for m in msgs:
        check_text(m.content, "chat content must be")
    engine._enter()
    try:
        template = engine.config.chat_template or engine._chat_template()
        special = engine._special_tokens()
    finally:
        engine._leave()
    if template is None:
        raise ConfigError(
            f"{engine.config.model!r} has no chat template; pass chat_template='...' (a Jinja "
            "template) in the engine config, or use generate() with a plain prompt"
        )
    source = "the engine config's chat_template" if engine.config.chat_template else engine.config.model
    return render_chat_template(
        template, msgs, add_generation_prompt=add_generation_prompt, source=source, tools=tools, **special
    )


def forced_params(engine: ChatMethods, params: SamplingParams, spec: ToolSpec) -> SamplingParams:
    """``params`` with decoding held to a call of ``spec``'s tools when it forces one; a backend
    that cannot constrain its output refuses (a forced call is never left to chance)."""
    if not spec.forced:
        return params
    if params.response_format is not None:
        raise InvalidTools(
            "tool_choice",
            f"{spec.choice!r} constrains the reply to a tool call, which response_format would "
            "constrain too; pass one of them",
        )
    if "response_format" not in engine.capabilities.sampling:
        raise UnsupportedParameter(
            engine.name,
            ["tool_choice"],
            hint=f"tool_choice={spec.choice!r} needs constrained decoding, which this backend lacks "
            "(no response_format in its capabilities.sampling): use tool_choice='auto', or a backend "
            "that has it.",
        )
    return SamplingParams(
        **{**params.model_dump(exclude_unset=True), "response_format": spec.response_format()}
    )


def chat_request(
    engine: ChatMethods,
    messages: Any,
    params: SamplingParams | Mapping[str, Any] | None,
    overrides: Mapping[str, Any],
    tools: Any,
    tool_choice: Any,
) -> tuple[str, SamplingParams, ToolSpec | None]:
    """The prompt, the sampling parameters and the read tools (None: plain chat) of one chat. The
    prompt comes from ``engine.render_chat``, which a backend may override (vLLM renders as vLLM
    does); ``tools`` is passed only when there are some, so an override without it still works."""
    spec = read_tools(tools, tool_choice)
    sp = engine._params(params, overrides)
    if spec is None:
        return engine.render_chat(messages), sp, None
    prompt = engine.render_chat(messages, tools=list(spec.tools))
    return prompt, forced_params(engine, sp, spec), spec


def finish_with_calls(last: Chunk, text: str, spec: ToolSpec) -> Chunk:
    """The stream's last chunk, carrying the calls parsed from the whole ``text``; its
    ``finish_reason`` is ``tool_calls`` when there are any. A forced call that does not parse is
    ``ToolCallParseError``."""
    _, calls = parse_tool_calls(text, spec.names, forced=spec.forced, finish_reason=last.finish_reason)
    if not calls:
        return last
    return dataclasses.replace(last, finish_reason="tool_calls", tool_calls=calls)


def calls_in(chunks: Iterator[Chunk], spec: ToolSpec | None) -> Iterator[Chunk]:
    """``chunks`` as they come, the last one with the calls (nothing to do without tools)."""
    return chunks if spec is None else _calls_in(chunks, spec)


def _calls_in(chunks: Iterator[Chunk], spec: ToolSpec) -> Iterator[Chunk]:
    parts: list[str] = []
    try:
        for chunk in chunks:
            parts.append(chunk.text)
            yield chunk if chunk.finish_reason is None else finish_with_calls(chunk, "".join(parts), spec)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


async def acalls_in(chunks: AsyncIterator[Chunk], spec: ToolSpec | None) -> AsyncIterator[Chunk]:
    """``calls_in`` for an async stream."""
    parts: list[str] = []
    try:
        async for chunk in chunks:
            parts.append(chunk.text)
            if spec is not None and chunk.finish_reason is not None:
                yield finish_with_calls(chunk, "".join(parts), spec)
            else:
                yield chunk
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
