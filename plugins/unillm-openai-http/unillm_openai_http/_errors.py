"""What an OpenAI-compatible server's failures become: subclasses of unillm's own errors.

::

    ServerUnreachable (BackendUnavailable)  nothing answers at the base URL (refused, DNS, timeout)
    AuthenticationFailed (ConfigError)      401/403: the API key is missing or wrong
    ServedModelNotFound (ModelNotFound)     404, or the model is not in /v1/models
    ServerRefused (ConfigError)             400/413/422: the server refused the request itself
    PromptTooLong (ServerRefused and ContextLengthExceeded)  400 saying the prompt overflows
    ServerBusy (GenerationError)            429/503, still, after the bounded retries
    ServerFailed (GenerationError)          5xx, or the stream broke after it started
    TokenizerUnavailable (NotImplementedError)  the server has no tokenize/detokenize route

Each carries ``url`` and ``status`` (None when no HTTP answer came), so a caller can tell them
apart without parsing messages; ``catch UnillmError`` still catches every one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from unillm import (
    BackendUnavailable,
    ConfigError,
    ContextLengthExceeded,
    GenerationError,
    ModelLoadError,
    ModelNotFound,
    UnillmError,
)

__all__ = [
    "AuthenticationFailed",
    "PromptTooLong",
    "ServedModelNotFound",
    "ServerBusy",
    "ServerFailed",
    "ServerRefused",
    "ServerUnreachable",
    "TokenizerUnavailable",
    "http_error",
]

_BACKEND = "openai-http"


class ServerUnreachable(BackendUnavailable):
    """Nothing answers at the base URL: connection refused, an unknown host, or a connect timeout."""

    def __init__(self, url: str, why: str) -> None:
        self.url, self.status = url, None
        super().__init__(
            _BACKEND,
            f"no OpenAI-compatible server answers at {url} ({why}). Check that the server is running, "
            "that it listens on that host and port, and the base_url option (or $UNILLM_OPENAI_BASE_URL)",
        )


class AuthenticationFailed(ConfigError):
    """The server refused the API key (HTTP 401 or 403)."""

    def __init__(self, url: str, status: int, detail: str) -> None:
        self.url, self.status = url, status
        super().__init__(
            f"{url} refused the API key (HTTP {status}: {detail}). Set the api_key option or "
            "$UNILLM_OPENAI_API_KEY (sent as 'Authorization: Bearer <key>') to the key the server expects"
        )


class ServedModelNotFound(ModelNotFound):
    """The server does not serve the model asked for (HTTP 404, or absent from /v1/models)."""

    def __init__(self, url: str, model: str, served: Sequence[str] = (), status: int | None = None) -> None:
        self.url, self.status, self.path = url, status, model
        self.served = list(served)
        listed = ", ".join(repr(s) for s in self.served) or "(it did not say)"
        ModelLoadError.__init__(
            self,
            f"the server at {url} does not serve a model named {model!r}; it serves: {listed}. "
            "Pass one of those as the model, or set the model_name option",
        )


class ServerRefused(ConfigError):
    """The server refused the request itself (HTTP 400, 413, 422): its message says why."""

    def __init__(self, url: str, status: int, detail: str) -> None:
        self.url, self.status = url, status
        what = (
            "the request is too large for the server" if status == 413 else "the server refused the request"
        )
        super().__init__(f"{what} (HTTP {status} from {url}): {detail}")


class ServerBusy(GenerationError):
    """The server was still busy (HTTP 429 or 503) after every retry."""

    def __init__(self, url: str, status: int, detail: str, attempts: int) -> None:
        self.url, self.status = url, status
        super().__init__(
            f"{url} answered HTTP {status} ({detail}) to {attempts} attempt(s); it is overloaded or still "
            "loading. Retry later, or raise the retries option"
        )


class ServerFailed(GenerationError):
    """The server failed (5xx), or its stream broke or made no sense after it had started."""

    def __init__(self, url: str, status: int | None, detail: str) -> None:
        self.url, self.status = url, status
        code = f"HTTP {status}" if status is not None else "the stream broke"
        super().__init__(f"the server at {url} failed ({code}): {detail}")


class TokenizerUnavailable(UnillmError, NotImplementedError):
    """The server has no tokenize/detokenize route (vLLM and ``unillm serve`` have ``/tokenize``,
    llama-cpp-python's server ``/extras/tokenize``)."""

    def __init__(self, url: str, kind: str) -> None:
        self.url, self.status = url, None
        super().__init__(
            f"the server at {url} ({kind}) has no tokenize/detokenize route; unillm cannot see its "
            "tokenizer. Servers with one: vLLM and `unillm serve` (/tokenize), llama-cpp-python "
            "(/extras/tokenize)"
        )


# OpenAI's (and unillm serve's) error code, and the words vLLM, llama.cpp and SGLang servers use
_CONTEXT_CODE = "context_length_exceeded"
_CONTEXT_WORDS = re.compile(r"context (length|window)|maximum context|exceeds? the (model's )?context", re.I)


class PromptTooLong(ServerRefused, ContextLengthExceeded):
    """The server refused the prompt as longer than its context window (HTTP 400): caught as
    ``ContextLengthExceeded`` like the in-process engines' error. The token counts are the
    server's, in its message; the fields are None here."""

    def __init__(self, url: str, status: int, detail: str) -> None:
        self.url, self.status = url, status
        Exception.__init__(
            self, f"the server refused the prompt as too long (HTTP {status} from {url}): {detail}"
        )
        self.prompt_tokens = None  # type: ignore[assignment]
        self.context_length = None  # type: ignore[assignment]
        self.max_tokens = None


def http_error(
    url: str, status: int, detail: str, model: str, attempts: int = 1, code: str | None = None
) -> UnillmError:
    """The unillm error for an HTTP error answer ``status`` from ``url``."""
    if status in (401, 403):
        return AuthenticationFailed(url, status, detail)
    if status == 404:
        return ServedModelNotFound(url, model, status=status)
    if status == 400 and (code == _CONTEXT_CODE or _CONTEXT_WORDS.search(detail)):
        return PromptTooLong(url, status, detail)
    if status in (400, 413, 422):
        return ServerRefused(url, status, detail)
    if status in (429, 503):
        return ServerBusy(url, status, detail, attempts)
    return ServerFailed(url, status, detail)
