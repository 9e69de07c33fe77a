"""Chat templates, rendered in a sandbox.

Chat templates come from model files, which are untrusted input: a GGUF can carry a template that
tries to reach Python internals (CVE-2024-34359 in llama-cpp-python ran such templates unsandboxed).
Templates here render in jinja2's ``ImmutableSandboxedEnvironment``; anything it refuses becomes a
``ModelFormatError`` and nothing from the template runs outside the sandbox.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from unillm._errors import ConfigError, ModelFormatError
from unillm._types import ChatMessage

if TYPE_CHECKING:
    from jinja2 import Template

__all__ = ["render_chat_template"]


@lru_cache(maxsize=16)
def _compile(template: str) -> Template:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ConfigError(f"the chat template refused the messages: {message}")

    # Same settings as transformers' apply_chat_template, so templates render identically.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ModelFormatError(f"the chat template does not compile: {exc}") from exc


def render_chat_template(
    template: str,
    messages: Sequence[ChatMessage],
    *,
    add_generation_prompt: bool = True,
    **special_tokens: Any,
) -> str:
    """Render ``messages`` with a Jinja chat template in a sandbox."""
    import jinja2
    from jinja2.exceptions import SecurityError

    compiled = _compile(template)
    try:
        return compiled.render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
        )
    except SecurityError as exc:
        raise ModelFormatError(
            f"the chat template tried an unsafe operation and was stopped ({exc}); the model file "
            "may be malicious. Pass a trusted chat_template in the engine config."
        ) from exc
    except jinja2.UndefinedError as exc:
        raise ModelFormatError(
            f"the chat template uses an undefined variable ({exc}); pass a chat_template that fits "
            "this model in the engine config"
        ) from exc
    except jinja2.TemplateError as exc:
        raise ModelFormatError(f"the chat template failed: {exc}") from exc
