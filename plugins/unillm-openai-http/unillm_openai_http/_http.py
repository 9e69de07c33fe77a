"""The wire: one pooled httpx client per engine (sync and async), bounded retries, SSE events.

Retries happen only before an answer starts: on a refused or timed-out connection, and on HTTP
429/503 (waiting ``Retry-After`` when the server says, capped, else an exponential backoff). Once
a 2xx answer has begun nothing is replayed, so a half-streamed completion is never generated twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from unillm_openai_http._errors import ServerBusy, ServerFailed, ServerUnreachable, http_error

__all__ = ["Event", "Wire", "detail_of", "parse_event"]

log = logging.getLogger("unillm_openai_http")

_RETRY_STATUS = frozenset({429, 503})
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)


@dataclass(slots=True)
class Event:
    """One server-sent event, read: the text it adds, and what the last ones carry."""

    text: str | None = None  # None: an event without a content delta (the chat role, usage)
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    stop_reason: str | None = None  # the stop string that ended it, where the server says (vLLM's field)
    usage: Mapping[str, Any] | None = None
    error: str | None = None
    error_code: int | None = None  # the HTTP status an error event names (vLLM's ``code``: 400)


@dataclass
class Wire:
    """The engine's HTTP side: its base URL, headers, timeouts, retry policy and two clients."""

    base: str
    headers: dict[str, str]
    timeout: httpx.Timeout
    retries: int
    backoff_s: float
    max_backoff_s: float
    model: str = ""
    _client: httpx.Client | None = None
    _aclient: httpx.AsyncClient | None = None
    _aloop: Any = None

    def client(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(base_url=self.base, headers=self.headers, timeout=self.timeout)
        return self._client

    def aclient(self) -> httpx.AsyncClient:
        """The async client of the running event loop: an httpx.AsyncClient's connections belong
        to the loop that opened them, so a new loop (each ``asyncio.run``) gets a client of its own."""
        loop = asyncio.get_running_loop()
        if self._aclient is None or self._aloop is not loop:
            self._aclient = httpx.AsyncClient(base_url=self.base, headers=self.headers, timeout=self.timeout)
            self._aloop = loop
        return self._aclient

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        # an async client's sockets belong to its loop; aclose() closes them there when it can
        self._aclient = self._aloop = None

    async def aclose(self) -> None:
        client, loop = self._aclient, self._aloop
        self._aclient = self._aloop = None
        if client is not None and loop is asyncio.get_running_loop():
            await client.aclose()
        self.close()

    def url(self, path: str) -> str:
        return self.base.rstrip("/") + path

    # ---- requests: retried before the answer starts, never after ----

    def _wait(self, attempt: int, response: httpx.Response | None) -> float:
        wait: float = self.backoff_s * 2.0**attempt
        after = response.headers.get("Retry-After") if response is not None else None
        if after is not None:
            with contextlib.suppress(ValueError):
                wait = float(after)
        return min(max(wait, 0.0), self.max_backoff_s)

    def open(self, method: str, path: str, body: Any = None, *, stream: bool = False) -> httpx.Response:
        """A 2xx response (its body unread when ``stream``), or the mapped unillm error."""
        client = self.client()
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                request = client.build_request(method, path, json=body)
                response = client.send(request, stream=True)
            except _CONNECT_ERRORS as exc:
                if last:
                    raise ServerUnreachable(self.url(path), _why(exc)) from exc
                self._note(attempt, path, _why(exc))
                time.sleep(self._wait(attempt, None))
                continue
            except httpx.HTTPError as exc:
                raise ServerFailed(self.url(path), None, _why(exc)) from exc
            if response.status_code < 400:
                if not stream:
                    response.read()
                    response.close()
                return response
            response.read()
            response.close()
            if response.status_code in _RETRY_STATUS and not last:
                self._note(attempt, path, f"HTTP {response.status_code}")
                time.sleep(self._wait(attempt, response))
                continue
            raise self._error(path, response, attempt + 1)
        raise AssertionError("unreachable")  # pragma: no cover

    async def aopen(self, method: str, path: str, body: Any = None) -> httpx.Response:
        """``open(..., stream=True)`` on the async client."""
        client = self.aclient()
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                request = client.build_request(method, path, json=body)
                response = await client.send(request, stream=True)
            except _CONNECT_ERRORS as exc:
                if last:
                    raise ServerUnreachable(self.url(path), _why(exc)) from exc
                self._note(attempt, path, _why(exc))
                await asyncio.sleep(self._wait(attempt, None))
                continue
            except httpx.HTTPError as exc:
                raise ServerFailed(self.url(path), None, _why(exc)) from exc
            if response.status_code < 400:
                return response
            await response.aread()
            await response.aclose()
            if response.status_code in _RETRY_STATUS and not last:
                self._note(attempt, path, f"HTTP {response.status_code}")
                await asyncio.sleep(self._wait(attempt, response))
                continue
            raise self._error(path, response, attempt + 1)
        raise AssertionError("unreachable")  # pragma: no cover

    def _note(self, attempt: int, path: str, why: str) -> None:
        log.info("retrying %s (attempt %d of %d): %s", self.url(path), attempt + 2, self.retries + 1, why)

    def _error(self, path: str, response: httpx.Response, attempts: int) -> Exception:
        detail = detail_of(response)
        status = response.status_code
        if status in _RETRY_STATUS:
            return ServerBusy(self.url(path), status, detail, attempts)
        return http_error(self.url(path), status, detail, self.model, attempts, code=code_of(response))


def events(response: httpx.Response, url: str) -> Iterator[Event]:
    """The events of a streamed answer, until ``[DONE]`` (or the end of the body)."""
    try:
        for line in response.iter_lines():
            event = parse_event(line, url)
            if event is _DONE:
                return
            if event is not None:
                yield event
    except httpx.HTTPError as exc:
        raise ServerFailed(url, None, _why(exc)) from exc


async def aevents(response: httpx.Response, url: str) -> AsyncIterator[Event]:
    """``events`` for an async response."""
    try:
        async for line in response.aiter_lines():
            event = parse_event(line, url)
            if event is _DONE:
                return
            if event is not None:
                yield event
    except httpx.HTTPError as exc:
        raise ServerFailed(url, None, _why(exc)) from exc


_DONE = Event()


def parse_event(line: str, url: str) -> Event | None:
    """One SSE line: an ``Event``, ``_DONE`` for ``[DONE]``, None for what carries nothing (blank
    lines, ``: keepalive`` comments, ``event:`` names)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return _DONE
    try:
        obj = json.loads(data)
    except ValueError as exc:
        raise ServerFailed(url, None, f"an event that is not JSON: {data[:200]!r}") from exc
    if not isinstance(obj, dict):
        raise ServerFailed(url, None, f"an event that is not a JSON object: {data[:200]!r}")
    if "error" in obj:
        err = obj["error"]
        if not isinstance(err, dict):
            return Event(error=str(err))
        code = err.get("code")
        return Event(
            error=str(err.get("message", err)),
            error_code=code if isinstance(code, int) and not isinstance(code, bool) else None,
        )
    usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else None
    choices = obj.get("choices") or []
    if not choices:
        return Event(usage=usage)
    choice = choices[0]
    if "delta" in choice:  # chat
        delta = choice.get("delta") or {}
        content = delta.get("content")
        if content == "" and "role" in delta:
            content = None  # the opening delta names the role; a token is still to come
    else:
        content = choice.get("text")
    ids = choice.get("token_ids")  # vLLM sends them when asked (return_token_ids)
    stop_reason = choice.get("stop_reason")  # vLLM and unillm serve: a stop string, or a token id
    return Event(
        text=content if isinstance(content, str) else None,
        token_ids=tuple(ids) if isinstance(ids, list) else (),
        finish_reason=choice.get("finish_reason"),
        stop_reason=stop_reason if isinstance(stop_reason, str) else None,
        usage=usage,
    )


def detail_of(response: httpx.Response) -> str:
    """The server's own words for an error answer: OpenAI's ``error.message``, FastAPI's
    ``detail``, or the start of the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:300] or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:500]
        if isinstance(err, str):
            return err[:500]
        if body.get("detail"):
            return str(body["detail"])[:500]
        if body.get("message"):
            return str(body["message"])[:500]
    return str(body)[:300]


def code_of(response: httpx.Response) -> str | None:
    """OpenAI's ``error.code`` of an error answer, where it has one."""
    try:
        err = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, str) else None


def _why(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.ConnectError) and "refused" in text.lower():
        return "connection refused"
    return f"{type(exc).__name__}: {text}"
