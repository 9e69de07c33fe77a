"""unillm-openai-http: a unillm backend, ``openai-http``, over any OpenAI-compatible server.

Installed, the entry point in pyproject.toml points unillm at this module; the hook registers
``OpenAIHTTPEngine``, whose module (and httpx) is imported inside the hook only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unillm import hookimpl

__all__ = ["unillm_register_backends"]


@hookimpl
def unillm_register_backends(register: Callable[[Any], None]) -> None:
    from unillm_openai_http.engine import OpenAIHTTPEngine

    register(OpenAIHTTPEngine)
