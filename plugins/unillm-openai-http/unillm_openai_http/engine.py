"""``OpenAIHTTPEngine``: a unillm Engine over any OpenAI-compatible HTTP server.

vLLM's ``vllm serve``, SGLang, TGI, llama.cpp's ``llama-server``, llama-cpp-python's
``python -m llama_cpp.server``, ``mlx_lm.server`` and ``unillm serve`` all speak
``/v1/completions`` and ``/v1/chat/completions``; this backend streams both over server-sent events.
The server owns the model: "load" asks ``/v1/models`` what it serves and what kind of server it is,
which decides the sampling parameters it honours (the rest are refused, per the config's
``unsupported_params`` policy), whether it takes token-id prompts, and where its tokenizer is.

Usage is the server's own (``stream_options.include_usage``) when it sends it; otherwise it is
counted here: one completion token per streamed event, the prompt through the server's tokenizer
route. Token ids are the server's where it streams them (vLLM's ``token_ids``, asked for with
``return_token_ids``); the others stream text only, so chunks carry no ids there. Timings are
measured here, on the client's clock.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from time import perf_counter
from typing import Any, ClassVar, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from unillm import ChatMessage, Chunk, ConfigError, KVStats, SamplingParams, UnsupportedParameter
from unillm.backend import Availability, Capabilities, Engine, RawPiece, Request, Suitability, check_text
from unillm_openai_http._errors import (
    ServedModelNotFound,
    ServerFailed,
    TokenizerUnavailable,
    http_error,
)
from unillm_openai_http._http import Event, Wire, aevents, events
from unillm_openai_http._metrics import kv_from_metrics
from unillm_openai_http._servers import (
    OPENAI,
    OWNED_BY,
    RENAMED,
    SAMPLING,
    TOKEN_IDS,
    TOKEN_PROMPTS,
    TOKENIZER,
    auth,
    match,
    root,
)

__all__ = ["BASE_URL_ENV", "OpenAIHTTPEngine", "OpenAIHTTPOptions"]

BASE_URL_ENV = "UNILLM_OPENAI_BASE_URL"
API_KEY_ENV = "UNILLM_OPENAI_API_KEY"
Kind = Literal["auto", "unillm", "vllm", "sglang", "llama.cpp", "llama-cpp-python", "mlx", "openai"]


# ---- options ----


class OpenAIHTTPOptions(BaseModel):
    """Where the server is and how to talk to it (``options`` / ``backend_options["openai-http"]``)."""

    model_config = ConfigDict(extra="forbid")

    base_url: str | None = Field(
        None,
        description="The server's root, http://host:port (a trailing /v1 is fine). "
        f"Default: ${BASE_URL_ENV}.",
    )
    model_name: str | None = Field(
        None, description="The model's id on the server (GET /v1/models). Default: the config's model, "
        "matched against what the server lists by id, file name or stem.",
    )  # fmt: skip
    api_key: str | None = Field(
        None, repr=False, description=f"Sent as 'Authorization: Bearer <key>'. Default: ${API_KEY_ENV}."
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="Longest wait to connect, per attempt.")
    read_timeout_s: float = Field(
        300.0, gt=0, description="Longest wait for the next bytes of an answer (the first token included)."
    )
    retries: int = Field(
        3, ge=0, le=1000, description="Attempts after the first on a refused connection, a connect "
        "timeout or HTTP 429/503; only before any token arrived, never mid-stream.",
    )  # fmt: skip
    retry_backoff_s: float = Field(0.25, ge=0, description="Wait before the first retry; doubles after each.")
    max_backoff_s: float = Field(
        4.0, ge=0, description="Longest wait between attempts, Retry-After included."
    )
    server_kind: Kind = Field(
        "auto", description="What the server is; 'auto' reads it from /v1/models (owned_by). It decides "
        "the sampling parameters sent and where the tokenizer is.",
    )  # fmt: skip


@dataclass(slots=True)
class _Call:
    """One request: where it goes and what it sends; ``_stream`` fills in what came back."""

    path: str
    body: dict[str, Any]
    prompt: str | list[int] | None = None  # what to count client-side if the server sends no usage
    usage: Mapping[str, Any] | None = None
    finish: str | None = None
    stop_reason: str | None = None
    events: int = 0
    settled: bool = False


class OpenAIHTTPEngine(Engine[OpenAIHTTPOptions]):
    """An Engine whose model runs in an OpenAI-compatible server, reached over HTTP."""

    name: ClassVar[str] = "openai-http"
    # no model detector reports this format: the server, not a file, is what this backend reads
    formats: ClassVar[frozenset[str]] = frozenset({"openai-http"})
    # a server schedules its own requests, so many callers stream at once (batching=True keeps
    # the base class from serializing them, and astream native on the caller's loop)
    # servers stream text; the ids are not known here (the usage count is the server's) unless
    # the server streams them (vLLM: set at load)
    capabilities: ClassVar[Capabilities] = Capabilities(
        sampling=OPENAI, batching=True, token_prompts=False, token_ids=False, embeddings=True
    )
    # the server's /v1/embeddings tokenizes, pools and keeps its own limit: texts go as given
    embeds_text: ClassVar[bool] = True
    Options: ClassVar[type[BaseModel]] = OpenAIHTTPOptions
    install_hint: ClassVar[str | None] = "pip install unillm-openai-http"

    # ---- availability and suitability (class level: cheap) ----

    @classmethod
    def available(cls) -> Availability:
        return Availability(True, version=httpx.__version__)

    @classmethod
    def suitability(cls, hardware: Any, model: Any, workload: Any, plan: Any = None) -> Suitability:
        """Eligible only with ``$UNILLM_OPENAI_BASE_URL`` set (the selector sees no options) and
        a server there that lists this model in ``/v1/models``; blocked otherwise, saying why."""
        base = os.environ.get(BASE_URL_ENV)
        if not base:
            return Suitability(
                0.0,
                blockers=(
                    f"no server configured: set ${BASE_URL_ENV}, or pass backend='openai-http' "
                    "with options base_url",
                ),
            )
        url = root(base)
        try:
            r = httpx.get(url + "/v1/models", headers=auth(os.environ.get(API_KEY_ENV)), timeout=2.0)
            r.raise_for_status()
            served = [str(m.get("id")) for m in r.json().get("data", []) if isinstance(m, dict)]
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            return Suitability(0.0, blockers=(f"the server at {url} did not list its models: {exc}",))
        found = match(str(getattr(model, "path", "") or ""), served)
        if found is None:
            return Suitability(
                0.0, blockers=(f"{url} serves {', '.join(served) or 'nothing'}, not this model",)
            )
        return Suitability(1.0, reasons=(f"{url} serves it as {found!r}: already loaded there",))

    # ---- load ----

    def _load(self) -> None:
        opts = self.options
        base = opts.base_url or os.environ.get(BASE_URL_ENV)
        if not base:
            raise ConfigError(f"openai-http needs the server's URL: set options base_url or ${BASE_URL_ENV}")
        headers = {**auth(opts.api_key or os.environ.get(API_KEY_ENV)), "Accept": "application/json"}
        timeout = httpx.Timeout(opts.read_timeout_s, connect=opts.connect_timeout_s)
        wire = Wire(root(base), headers, timeout, opts.retries, opts.retry_backoff_s, opts.max_backoff_s)
        wire.model = opts.model_name or self.config.model
        try:
            answer = wire.open("GET", "/v1/models")
        except BaseException:
            wire.close()
            raise
        try:  # (not around open(): a ConfigError raised there is a ValueError too)
            listed = answer.json().get("data", [])
        except (ValueError, AttributeError) as exc:
            wire.close()
            raise ServerFailed(wire.url("/v1/models"), 200, "the answer is not a model list") from exc
        entries = {str(m.get("id")): m for m in listed if isinstance(m, dict)}
        name = opts.model_name if opts.model_name in entries else match(wire.model, list(entries))
        if name is None:
            wire.close()
            raise ServedModelNotFound(wire.url("/v1/models"), wire.model, list(entries))
        entry = entries[name]
        kind = (
            opts.server_kind
            if opts.server_kind != "auto"
            else OWNED_BY.get(str(entry.get("owned_by")), "openai")
        )
        wire.model, self._wire, self._kind, self._served = name, wire, kind, name
        self._usage_source: Literal["server", "client"] | None = None
        # what this server honours: known only now, so set on the instance (the class keeps the
        # OpenAI baseline, which is what the selector and docs read)
        sampling = SAMPLING[kind]
        listed = entry.get("sampling")  # unillm serve lists what its backend takes
        if isinstance(listed, list):
            sampling = sampling & frozenset(str(n) for n in listed)
        caps = replace(
            self.capabilities,
            sampling=sampling,
            token_prompts=kind in TOKEN_PROMPTS,
            token_ids=kind in TOKEN_IDS,
        )
        self.capabilities = caps  # type: ignore[misc]
        ctx = entry.get("max_model_len")
        self.context_length = ctx if isinstance(ctx, int) else None
        # what the server's model is for and how it pools, where the server lists it (unillm serve
        # does); else not known here, and the server refuses what its model does not do
        task, pooling = entry.get("task"), entry.get("pooling")
        self.task = task if task in ("generate", "embed", "rerank") else None
        self.pooling = pooling if pooling in ("mean", "last", "cls") else None

    @property
    def server_kind(self) -> str:
        """What the server is, as read from ``/v1/models`` (or the server_kind option)."""
        return self._kind

    @property
    def usage_source(self) -> Literal["server", "client"] | None:
        """Where the last finished request's usage came from: ``"server"`` (its usage event) or
        ``"client"`` (counted here: the server ignores ``include_usage``); None before any."""
        return self._usage_source

    # ---- stream: completions and chat, sync and async ----

    def _body(self, params: SamplingParams, **what: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self._served, **what, "max_tokens": params.max_tokens}
        body["temperature"] = params.temperature
        renamed = RENAMED.get(self._kind, {})
        fields = SamplingParams.model_fields
        for name in sorted(self.capabilities.sampling - {"max_tokens", "temperature"}):
            value = getattr(params, name)
            if value != fields[name].default:
                body[renamed.get(name, name)] = list(value) if isinstance(value, tuple) else value
        if params.logit_bias and "logit_bias" in body:
            body["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
        if "response_format" in body and (fmt := params.output_format) is not None:
            # the wire shape of any format unillm reads (a model class included): the server enforces it
            body["response_format"] = (
                {"type": "json_schema", "json_schema": {"name": "response", "schema": fmt.json_schema}}
                if fmt.kind == "json_schema"
                else {"type": "json_object"}
            )
        if self._kind in TOKEN_IDS:
            body["return_token_ids"] = True
        return {**body, "stream": True, "stream_options": {"include_usage": True}}

    def _encode(self, prompt: str | Sequence[int], params: SamplingParams) -> _Call:
        sent = prompt if isinstance(prompt, str) else list(prompt)
        return _Call("/v1/completions", self._body(params, prompt=sent), prompt=sent)

    def _chat_call(
        self, messages: Sequence[ChatMessage | Mapping[str, Any]], params: SamplingParams
    ) -> _Call:
        if isinstance(messages, (str, bytes, Mapping)) or not messages:
            raise ConfigError(
                "chat() takes a non-empty list of messages: [{'role': 'user', 'content': '...'}]"
            )
        msgs = [ChatMessage.coerce(m) for m in messages]
        for m in msgs:
            check_text(m.content, "chat content must be")
        return _Call(
            "/v1/chat/completions",
            self._body(params, messages=[{"role": m.role, "content": m.content} for m in msgs]),
        )

    def _stream(self, call: _Call, params: SamplingParams, req: Request) -> Iterator[RawPiece]:
        url = self._wire.url(call.path)
        response = self._wire.open("POST", call.path, call.body, stream=True)
        try:
            stream = events(response, url)
            for event in stream:
                piece = self._read(call, event, url)
                if event.finish_reason is not None:  # read the usage event behind it now: the
                    for rest in stream:  # base class may stop at this piece (max_tokens, a stop)
                        self._read(call, rest, url)
                if piece is not None:
                    yield piece
        finally:
            response.close()  # an early close is a disconnect the server sees
            # the prompt is counted on the server's tokenizer only after an answer that ended
            # well: never inside a break, a failure or a retry loop against a server that is gone
            self._settle(call, req, tokenize=call.finish is not None)

    async def _astream(
        self, call: _Call, params: SamplingParams, req: Request
    ) -> AsyncGenerator[RawPiece, None]:
        url = self._wire.url(call.path)
        response = await self._wire.aopen("POST", call.path, call.body)
        try:
            stream = aevents(response, url)
            async for event in stream:
                piece = self._read(call, event, url)
                if event.finish_reason is not None:
                    async for rest in stream:
                        self._read(call, rest, url)
                if piece is not None:
                    yield piece
        finally:
            await response.aclose()
            if call.finish is not None and call.usage is None:  # counting asks the server: off the loop
                await asyncio.to_thread(self._settle, call, req)
            self._settle(call, req, tokenize=False)

    def _read(self, call: _Call, event: Event, url: str) -> RawPiece | None:
        if event.error is not None:
            # vLLM checks some parameters (token ids against its vocabulary) inside a stream it
            # already answered 200: its error event carries the HTTP code it means
            code = event.error_code
            if code is not None and 400 <= code < 500:
                raise http_error(url, code, event.error, self._served)
            raise ServerFailed(url, code, event.error)
        if event.usage is not None:
            call.usage = event.usage
        if event.finish_reason is not None:
            call.finish = event.finish_reason
            call.stop_reason = event.stop_reason
        ids = event.token_ids
        if not ids and (event.text is None or (event.text == "" and event.finish_reason is not None)):
            return None  # the closing event adds no token (unless it carries the last one's id)
        call.events += max(1, len(ids))
        # an id without text: a token whose bytes the server holds back (part of a character, or
        # perhaps a stop string), or the one that ended it (a stop token's text is never sent)
        return event.text or "", ids, None

    def _settle(self, call: _Call, req: Request, *, tokenize: bool = True) -> None:
        """Fill ``req`` from the server's usage, or count it here when the server sent none."""
        if call.settled:
            return
        call.settled = True
        req.finish_reason = "length" if call.finish == "length" else "stop"
        req.stop_sequence = call.stop_reason  # the server matched it, so it never reached us
        usage = call.usage
        if usage is not None and isinstance(usage.get("completion_tokens"), int):
            req.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            req.completion_tokens = usage["completion_tokens"]
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            req.cached_tokens = cached if isinstance(cached, int) else None
            self._usage_source = "server"
            return
        req.completion_tokens, self._usage_source = call.events, "client"
        if isinstance(call.prompt, list):
            req.prompt_tokens = len(call.prompt)
        elif isinstance(call.prompt, str) and tokenize and self._kind in TOKENIZER:
            try:
                req.prompt_tokens = len(self._tokenize(call.prompt))
            except Exception:  # counting is best effort: the answer itself is already here
                req.prompt_tokens = 0

    def stream_chat(
        self,
        messages: Any,
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> Iterator[Chunk]:
        """The server's own chat (``/v1/chat/completions``, its template), unless the config
        gives a ``chat_template``: then it is rendered here and sent to ``/v1/completions``, and
        ``tools`` work as in-process (rendered and parsed here). Tools are not sent to a
        server's own chat yet: without a ``chat_template`` they are ``UnsupportedParameter``."""
        if self.config.chat_template:
            return super().stream_chat(messages, params, tools=tools, tool_choice=tool_choice, **overrides)
        self._no_tools(tools, tool_choice)
        sp = self._params(params, overrides)
        t0 = perf_counter()
        self._enter()  # EngineClosed now, not at the first token
        self._leave()
        call = self._chat_call(messages, sp)
        return self._drive(call, sp, t0)

    async def astream_chat(
        self,
        messages: Any,
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> AsyncIterator[Chunk]:
        """Async ``stream_chat``."""
        if self.config.chat_template:
            chunks = super().astream_chat(messages, params, tools=tools, tool_choice=tool_choice, **overrides)
            async for chunk in chunks:
                yield chunk
            return
        self._no_tools(tools, tool_choice)
        sp = self._params(params, overrides)
        if not self.loaded:
            raise self._closed_error()
        call = self._chat_call(messages, sp)
        async for chunk in self._adrive(call, sp, perf_counter()):
            yield chunk

    def _no_tools(self, tools: Any, tool_choice: Any) -> None:
        given = [n for n, v in (("tools", tools), ("tool_choice", tool_choice)) if v is not None]
        if given:
            raise UnsupportedParameter(
                self.name,
                given,
                hint="openai-http does not send tools to a server's own chat yet (its tool-call "
                "deltas are not read); set chat_template in the engine config to render the tools "
                "here and parse the calls from the reply, as in-process engines do.",
            )

    # ---- embeddings: the server's /v1/embeddings ----

    def _embed_body(self, inputs: list[Any]) -> dict[str, Any]:
        return {"model": self._served, "input": inputs, "encoding_format": "float"}

    def _embed(self, inputs: list[Any], pooling: Any) -> tuple[list[list[float]], int]:
        response = self._wire.open("POST", "/v1/embeddings", self._embed_body(inputs))
        try:
            answer = response.json()
        except ValueError as exc:
            raise ServerFailed(self._wire.url("/v1/embeddings"), 200, "the answer is not JSON") from exc
        return self._vectors(answer, len(inputs))

    async def _aembed(self, inputs: list[Any], pooling: Any) -> tuple[list[list[float]], int]:
        response = await self._wire.aopen("POST", "/v1/embeddings", self._embed_body(inputs))
        try:
            body = await response.aread()
        finally:
            await response.aclose()
        try:
            answer = json.loads(body)
        except ValueError as exc:
            raise ServerFailed(self._wire.url("/v1/embeddings"), 200, "the answer is not JSON") from exc
        return self._vectors(answer, len(inputs))

    def _vectors(self, answer: Any, n: int) -> tuple[list[list[float]], int]:
        """The vectors in input order and the prompt tokens from an OpenAI embeddings answer."""
        url = self._wire.url("/v1/embeddings")
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, list) or len(data) != n:
            raise ServerFailed(url, 200, f"the answer holds {len(data) if isinstance(data, list) else 'no'} "
                               f"vectors for {n} inputs")  # fmt: skip
        vectors: list[list[float]] = [[] for _ in range(n)]
        for i, item in enumerate(data):
            index = item.get("index", i) if isinstance(item, dict) else None
            vector = item.get("embedding") if isinstance(item, dict) else None
            if not isinstance(index, int) or not 0 <= index < n or not isinstance(vector, list):
                raise ServerFailed(url, 200, f"data[{i}] is not an embedding of an input")
            vectors[index] = vector
        usage = answer.get("usage")
        tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        return vectors, tokens if isinstance(tokens, int) else 0

    # ---- tokenizer, kv_stats, close ----

    def _tokenize(self, text: str) -> list[int]:
        route = TOKENIZER.get(self._kind)
        if route is None:
            raise TokenizerUnavailable(self._wire.base, self._kind)
        body: dict[str, Any] = {route[1]: text}
        if self._kind != "llama.cpp":
            body["model"] = self._served
        if self._kind in ("vllm", "sglang"):
            body["add_special_tokens"] = False
        tokens = self._wire.open("POST", route[0], body).json().get("tokens")
        if not isinstance(tokens, list):
            raise ServerFailed(self._wire.url(route[0]), 200, "the answer holds no 'tokens' list")
        return [int(t) for t in tokens]

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` from the server's tokenize route (``TokenizerUnavailable`` when
        it has none)."""
        return self._tokenize(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` from the server's detokenize route."""
        route = TOKENIZER.get(self._kind)
        if route is None:
            raise TokenizerUnavailable(self._wire.base, self._kind)
        body: dict[str, Any] = {"tokens": list(ids)}
        if self._kind not in ("llama.cpp", "llama-cpp-python"):
            body["model"] = self._served
        text = self._wire.open("POST", route[2], body).json().get(route[3])
        if not isinstance(text, str):
            raise ServerFailed(self._wire.url(route[2]), 200, f"the answer holds no {route[3]!r} text")
        return text

    def kv_stats(self) -> KVStats:
        """The KV cache as the server's ``/metrics`` tells it (vLLM, SGLang, llama.cpp and
        ``unillm serve`` gauges); all None when it publishes none."""
        try:
            response = self._wire.client().get("/metrics")
        except httpx.HTTPError:
            return KVStats()
        if response.status_code != 200:
            return KVStats()
        return kv_from_metrics(response.text, self._served)

    def _close(self) -> None:
        self._wire.close()

    async def aclose(self) -> None:
        wire = getattr(self, "_wire", None)
        if wire is not None and self.loaded:
            await wire.aclose()  # its sockets belong to this loop: close them here
        await super().aclose()
