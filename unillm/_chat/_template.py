"""Chat templates, rendered in a sandbox with bounds on time and memory.

Chat templates come from model files, which are untrusted input. Two kinds of harm, two defences:

- **Escape.** A GGUF can carry a template that reaches Python internals (CVE-2024-34359 in
  llama-cpp-python ran such templates unsandboxed). Templates here render in jinja2's
  ``ImmutableSandboxedEnvironment``, which refuses private attributes (``__class__``,
  ``__globals__``) and mutation of lists and dicts; a refusal is a ``ModelFormatError``.
- **Exhaustion.** The sandbox bounds neither time nor memory: nested loops, ``10 ** (10 ** 10)``
  or ``'a' * 10**10`` hang a server or eat its memory. Every render here is bounded:

  * a deadline (``RENDER_DEADLINE_S``), checked at every loop iteration (the code generator puts
    a check at the top of each ``for`` body and in loop filters), every call (macro, method,
    global) and every filter. No template loop or recursion runs unchecked; what is left is one
    builtin operation at a time, and those are kept small by the next bound;
  * a size bound on every value the template makes (``MAX_OUTPUT_CHARS``: a string by its length,
    a list or dict by the text it holds, counted through shared references so that
    ``[a, a]`` nested 40 times is as big as it prints), checked *before* the operations that
    grow a small input into a huge one (``*``, ``**``, ``%``, format widths, padding, ``replace``,
    ``join``, ``indent``, ...) and right after the others. So one builtin step, and what printing,
    hashing or comparing any value costs, stays bounded too;
  * a work budget (``MAX_WORK_CHARS``) charged with what the template produces and keeps, so a
    loop cannot pile up bounded values without end;
  * an output cap, a call depth cap (recursive macros) and a nesting cap.

  Compiling is bounded by the template's length (``MAX_TEMPLATE_CHARS``); whatever it raises
  (jinja's errors, Python's ``SyntaxError`` for too many nested blocks, ``RecursionError`` for
  too deep an expression) is a ``ModelFormatError`` too.

Each violation is a ``ModelFormatError`` that names the template's source when known and says
what to do. ``raise_exception(...)`` in a template is a ``ConfigError``: the template refused the
messages, which is the caller's to fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from time import monotonic
from typing import TYPE_CHECKING, Any

from unillm._chat._sandbox import (
    _BUDGET,
    MAX_OUTPUT_CHARS,
    MAX_TEMPLATE_CHARS,
    RENDER_DEADLINE_S,
    _Budget,
    _environment,
    _Limit,
)
from unillm._chat._tools import InvalidTools
from unillm._errors import ConfigError, ModelFormatError, UnillmError
from unillm._types import ChatMessage

if TYPE_CHECKING:
    from jinja2 import Template

__all__ = [
    "MAX_OUTPUT_CHARS",
    "RENDER_DEADLINE_S",
    "check_chat_template",
    "compile_error",
    "compile_error_types",
    "no_chat_template",
    "render_chat_template",
    "template_message",
    "template_takes_tools",
    "tools_not_rendered",
]


def compile_error_types() -> tuple[type[BaseException], ...]:
    """The exceptions compiling a template raises when the template is broken or hostile: a jinja
    error, a ``SyntaxError`` from Python compiling jinja's output (too many nested blocks), a
    ``RecursionError`` (too deeply nested expressions). llama-cpp-python lets these escape from
    ``Llama()``, which compiles a GGUF's templates while it loads."""
    import jinja2

    return (jinja2.TemplateError, SyntaxError, RecursionError)


def compile_error(
    exc: BaseException, source: str | None = None, *, loader: str | None = None
) -> ModelFormatError:
    """The ``ModelFormatError`` for a template that does not compile (``exc`` says why).

    ``loader`` names a library that compiles the file's template itself while loading it
    (llama-cpp-python): then a chat_template in the engine config does not help, so the advice
    is to fix the file.
    """
    where = f" in {source!r}" if source else ""
    why = str(exc) if isinstance(exc, _Limit) else f"{type(exc).__name__}: {exc}"
    fix = (
        f"{loader} compiles it while loading, so the file cannot load as it is: put a working "
        "template in it (gguf-new-metadata --chat-template '...') or convert the model again"
        if loader
        else "Pass a trusted chat_template in the engine config"
    )
    return ModelFormatError(
        f"the chat template{where} does not compile ({why}); the model file is broken or malicious. {fix}."
    )


@lru_cache(maxsize=16)
def _compile(template: str) -> Template | BaseException:
    """The compiled template, or why it does not compile (remembered too, so a broken template
    costs one compile, not one per request)."""
    if len(template) > MAX_TEMPLATE_CHARS:
        return _Limit(f"it is {len(template)} characters long, over the limit of {MAX_TEMPLATE_CHARS}")
    try:
        return _environment().from_string(template)
    except Exception as exc:  # a hostile template can make jinja or Python's compiler raise anything
        return exc.with_traceback(None)  # not the compiler's frames, kept alive in the cache


def check_chat_template(template: str, *, source: str | None = None) -> None:
    """Compile ``template`` and raise ``ModelFormatError`` if it does not compile; for an engine
    that wants a broken template reported at load rather than at the first chat."""
    compiled = _compile(template)
    if isinstance(compiled, BaseException):
        raise compile_error(compiled, source) from compiled


@lru_cache(maxsize=16)
def template_takes_tools(template: str) -> bool:
    """Whether ``template`` reads a ``tools`` variable (so it can render the tools a chat offers);
    False for one that does not compile (rendering says why)."""
    from jinja2 import meta

    if len(template) > MAX_TEMPLATE_CHARS:
        return False
    try:
        return "tools" in meta.find_undeclared_variables(_environment().parse(template))
    except Exception:  # broken or hostile: the render reports it
        return False


def template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as templates read it: OpenAI's shape, ``tool_calls`` and ``tool_call_id`` only
    where the turn has them (templates test ``message.tool_calls is defined``), a call's
    arguments as a dict (templates write them with ``tojson``)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def tools_not_rendered(source: str | None = None) -> InvalidTools:
    """The one refusal of tools a chat template would not show the model, on every backend (the
    template ``source`` names, when known)."""
    where = f" of {source!r}" if source else ""
    return InvalidTools(
        "tools",
        f"the chat template{where} does not render tools (it reads no 'tools' variable), so the "
        "model would never see them; pass a chat_template that does in the engine config "
        "(docs/structured.md, Tool calling)",
    )


def no_chat_template(model: str) -> ConfigError:
    """The one error of a chat asked of a model without a chat template, on every backend."""
    return ConfigError(
        f"{model!r} has no chat template; pass chat_template='...' (a Jinja template) in the engine "
        "config, or use generate() with a plain prompt"
    )


def render_chat_template(
    template: str,
    messages: Sequence[ChatMessage],
    *,
    add_generation_prompt: bool = True,
    source: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    **special_tokens: Any,
) -> str:
    """Render ``messages`` with a Jinja chat template in a bounded sandbox.

    ``source`` names where the template came from (the model file) in error messages. ``tools``
    (OpenAI's shape) are handed to the template as its ``tools`` variable; a template that does
    not read one cannot show the model its tools, which is ``InvalidTools``. Raises
    ``ModelFormatError`` when the template does not compile, tries an unsafe operation or exceeds
    a bound (time, size, recursion), and ``ConfigError`` when it calls ``raise_exception``.
    """
    import jinja2
    from jinja2.exceptions import SecurityError

    compiled = _compile(template)
    if isinstance(compiled, BaseException):
        raise compile_error(compiled, source) from compiled
    where = f" of {source!r}" if source else ""
    variables = {
        "messages": [template_message(m) for m in messages],
        "add_generation_prompt": add_generation_prompt,
        **special_tokens,
    }
    if tools:
        if not template_takes_tools(template):
            raise tools_not_rendered(source)
        variables["tools"] = [dict(t) for t in tools]
    token = _BUDGET.set(_Budget(deadline=monotonic() + RENDER_DEADLINE_S))
    try:
        pieces: list[str] = []
        total = 0
        for piece in compiled.generate(variables):
            total += len(piece)
            if total > MAX_OUTPUT_CHARS:
                raise _Limit(f"its output passed {MAX_OUTPUT_CHARS} characters")
            pieces.append(piece)
        return "".join(pieces)
    except UnillmError:  # raise_exception's ConfigError
        raise
    except _Limit as exc:
        raise ModelFormatError(
            f"the chat template{where} was stopped: {exc}. It comes from the model file and may be "
            "malicious: pass a trusted chat_template in the engine config."
        ) from exc
    except SecurityError as exc:
        raise ModelFormatError(
            f"the chat template{where} tried an unsafe operation and was stopped ({exc}); the model "
            "file may be malicious. Pass a trusted chat_template in the engine config."
        ) from exc
    except jinja2.UndefinedError as exc:
        raise ModelFormatError(
            f"the chat template{where} uses an undefined variable ({exc}); pass a chat_template "
            "that fits this model in the engine config"
        ) from exc
    except RecursionError as exc:
        raise ModelFormatError(
            f"the chat template{where} was stopped: it recursed too deeply. Pass a trusted "
            "chat_template in the engine config."
        ) from exc
    except Exception as exc:  # TypeError, ZeroDivisionError, OverflowError, ...: the template's bug
        raise ModelFormatError(
            f"the chat template{where} failed ({type(exc).__name__}: {exc}); pass a chat_template "
            "that fits this model in the engine config"
        ) from exc
    finally:
        _BUDGET.reset(token)
