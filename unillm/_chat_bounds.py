"""The bounds a chat template renders under, and the checks that enforce them.

The limits (deadline, value size, work budget, call depth, nesting), the per-render budget, and
the checks the sandboxed environment (``unillm._chat_sandbox``) runs on every loop iteration,
call, operator and value the template makes. Why each bound exists: ``unillm._chat``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from string import Formatter
from time import monotonic
from typing import Any

__all__ = [
    "MAX_CALL_DEPTH",
    "MAX_INT_BITS",
    "MAX_NESTING",
    "MAX_OUTPUT_CHARS",
    "MAX_TEMPLATE_CHARS",
    "MAX_WORK_CHARS",
    "RENDER_DEADLINE_S",
]

RENDER_DEADLINE_S = 3.0
"""Seconds one render may take. A real template renders in well under a millisecond."""
MAX_OUTPUT_CHARS = 8 << 20
"""Largest prompt, and largest single value, a template may make: twice a 1M-token context."""
MAX_WORK_CHARS = 8 * MAX_OUTPUT_CHARS
"""Characters a render may produce in all, copies included (real templates copy each message a
few times: ``'<|im_start|>' + role + '\\n' + content``)."""
MAX_TEMPLATE_CHARS = 64 << 10
"""Longest template compiled: the longest real ones are about 20 kB. Compiling is not under the
render deadline, and a hostile template this long takes seconds and ~150 MB to compile (once:
compiled templates, and refusals, are cached)."""
MAX_CALL_DEPTH = 64
"""Nested calls (macros calling macros); far below Python's recursion limit."""
MAX_NESTING = 100
"""Deepest nesting of lists and dicts a template may build."""
MAX_INT_BITS = 1 << 16
"""Largest integer ``*`` and ``**`` may make (Python cannot print one over 4300 digits anyway)."""

_SMALL = 4096  # results shorter than this are not charged: too small to pile up before the deadline
_MAX_SLICES = 100_000  # jinja's own cap on range()
_CONTAINERS: tuple[type, ...] = (
    list,
    tuple,
    dict,
    set,
    frozenset,
    type({}.keys()),
    type({}.values()),
    type({}.items()),
)
_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")


class _NoNamespace:
    """Stands for jinja2's Namespace class until jinja2 is imported."""


_NAMESPACE: list[type] = [_NoNamespace]


class _Limit(Exception):
    """A bound was hit; the message says which. Deliberately not a ValueError, TypeError or
    LookupError: jinja's filters and lookups swallow those, and this must reach the top."""


@dataclass(slots=True)
class _Budget:
    """One render's bookkeeping (a render runs in one thread, so this is never shared)."""

    deadline: float
    work: int = MAX_WORK_CHARS
    depth: int = 0
    # id -> (size, nesting, the object): holding the object keeps its id from being reused
    sizes: dict[int, tuple[int, int, object]] = field(default_factory=dict)


# The render in progress on this thread or task; None outside a render (e.g. while jinja folds
# constants at compile time, where only the absolute size bounds apply).
_BUDGET: ContextVar[_Budget | None] = ContextVar("unillm_chat_template_budget", default=None)


# ---- the checks ----


def _late() -> _Limit:
    return _Limit(f"it ran past the {RENDER_DEADLINE_S:g} s render deadline")


def _tick() -> bool:
    """Stop the render if it has run past its deadline (True so it can sit in a loop's test)."""
    budget = _BUDGET.get()
    if budget is not None and monotonic() > budget.deadline:
        raise _late()
    return True


def _charge(budget: _Budget | None, n: int) -> None:
    if budget is not None:
        budget.work -= n
        if budget.work < 0:
            raise _Limit(f"it produced more than {MAX_WORK_CHARS} characters in all")


def _refuse_size(n: int, what: str = "a value") -> None:
    if n > MAX_OUTPUT_CHARS:
        raise _Limit(f"{what} would be {n} characters, over the limit of {MAX_OUTPUT_CHARS}")


def _namespace_attrs(value: object) -> dict[str, Any] | None:
    # A Namespace prints its attributes, so it is as big as they are; it is mutable
    # (``{% set ns.x = ... %}``), so its size is never remembered.
    if type(value) is not _NAMESPACE[0]:
        return None
    attrs: dict[str, Any] = object.__getattribute__(value, "_Namespace__attrs")
    return attrs


def _measure(value: object, budget: _Budget | None, depth: int = 0) -> tuple[int, int]:
    """``(size, nesting)``: about how many characters ``str(value)`` takes and how deep its
    containers nest. A container seen before in this render costs one lookup, so sizing a
    structure built from shared parts costs its distinct parts, not what it prints."""
    if isinstance(value, str):
        return len(value), 0
    if isinstance(value, int):  # bool too
        return value.bit_length() // 3 + 1, 0
    if isinstance(value, float):
        return 24, 0
    if isinstance(value, bytes):
        return 4 * len(value), 0  # b'\x00' prints 4 characters a byte
    attrs = _namespace_attrs(value)
    if attrs is None and not isinstance(value, _CONTAINERS):
        return 16, 0  # other objects (Undefined, macros, loops, ranges) print a short repr
    if depth > MAX_NESTING:
        raise _Limit(f"it built values nested more than {MAX_NESTING} deep")
    key = id(value)
    if attrs is None and budget is not None:
        known = budget.sizes.get(key)
        if known is not None:
            return known[0], known[1]
        if monotonic() > budget.deadline:
            raise _late()
    items: Iterable[Any]
    if attrs is not None:
        items = attrs.values()
    elif isinstance(value, dict):
        items = (x for kv in value.items() for x in kv)
    else:
        items = value  # type: ignore[assignment]
    size, nesting = 2, 1
    for item in items:
        s, n = _measure(item, budget, depth + 1)
        size += s + 2
        if n >= nesting:
            nesting = n + 1
        if size > MAX_OUTPUT_CHARS:
            raise _Limit(f"it built a value of more than {MAX_OUTPUT_CHARS} characters")
    if nesting > MAX_NESTING:
        raise _Limit(f"it built values nested more than {MAX_NESTING} deep")
    if attrs is None and budget is not None:
        budget.sizes[key] = (size, nesting, value)
        _charge(budget, len(value))  # type: ignore[arg-type]
    return size, nesting


def _made(value: Any, budget: _Budget | None) -> Any:
    """Check a value the template just made (a call's, a filter's or an operator's result)."""
    if isinstance(value, str):
        n = len(value)
        if n > _SMALL:
            _refuse_size(n)
            _charge(budget, n)
    elif isinstance(value, int):
        if value.bit_length() > MAX_INT_BITS:
            raise _Limit(f"it made an integer of more than {MAX_INT_BITS} bits")
    elif not isinstance(value, float):
        size = _measure(value, budget)[0]
        if size > _SMALL:
            _charge(budget, size)
    return value


def _made_here(value: Any) -> Any:
    """``_made`` for generated code: literals (``[a, a]``) and ``~`` joins."""
    return _made(value, _BUDGET.get())


def _finalize(value: Any) -> Any:
    """Charge what ``{{ ... }}`` prints (jinja calls this on every expression it outputs)."""
    budget = _BUDGET.get()
    if budget is not None:  # inlined _refuse_size and _charge: this runs for every {{ ... }}
        n = len(value) if type(value) is str else _measure(value, budget)[0]
        budget.work -= n
        if n > MAX_OUTPUT_CHARS:
            _refuse_size(n, "one output")
        if budget.work < 0:
            raise _Limit(f"it produced more than {MAX_WORK_CHARS} characters in all")
    return value


def _concat(parts: Iterable[str]) -> str:
    """``environment.concat``: joins the output of macros, ``{% set %}`` blocks and call blocks."""
    pieces = parts if isinstance(parts, list) else list(parts)
    n = sum(map(len, pieces))
    _refuse_size(n, "a block's output")
    _charge(_BUDGET.get(), n)
    return "".join(pieces)


def _text_size(value: Any) -> int:
    return len(value) if isinstance(value, str) else _measure(value, _BUDGET.get())[0]


def _check_printf(fmt: Any, args: Any) -> None:
    """``fmt % args`` with a width or precision in the millions makes a string that long."""
    if not isinstance(fmt, str):
        return
    star = False
    for match in _PRINTF.finditer(fmt):
        for num in match.groups():
            if num == "*":
                star = True
            elif num is not None and (len(num) > 9 or int(num) > MAX_OUTPUT_CHARS):
                raise _Limit(f"it formats with a width of {num[:12]}")
    if star:
        for arg in args if isinstance(args, tuple) else (args,):
            if isinstance(arg, int) and arg > MAX_OUTPUT_CHARS:
                raise _Limit(f"it formats with a width of {arg}")


def _check_format_specs(fmt: str) -> None:
    """The same for ``str.format``: ``'{:>1000000000}'`` is a gigabyte."""
    for _, _, spec, _ in Formatter().parse(fmt):
        if not spec:
            continue
        if "{" in spec:  # a width taken from an argument: no real template needs one
            raise _Limit(f"it formats with a computed width ({spec!r})")
        for num in _DIGITS.findall(spec):
            if len(num) > 9 or int(num) > MAX_OUTPUT_CHARS:
                raise _Limit(f"it formats with a width of {num[:12]}")


def _check_repeat(left: Any, right: Any) -> None:
    for seq, times in ((left, right), (right, left)):
        if isinstance(times, int) and isinstance(seq, (str, bytes, list, tuple)):
            if times > 0 and len(seq):
                _refuse_size(_text_size(seq) * times)
            return
    if (
        isinstance(left, int)
        and isinstance(right, int)
        and left.bit_length() + right.bit_length() > MAX_INT_BITS
    ):
        raise _Limit(f"it made an integer of more than {MAX_INT_BITS} bits")


def _check_power(base: Any, exp: Any) -> None:
    if not (isinstance(base, int) and isinstance(exp, int) and exp > 0 and abs(base) > 1):
        return
    if exp > MAX_INT_BITS or exp * math.log2(abs(base)) > MAX_INT_BITS:
        raise _Limit(f"it raised {base} to the power {exp} (over {MAX_INT_BITS} bits)")


def _check_method(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Refuse a str/bytes method call that would grow a small string into a huge one. Returns the
    arguments to call with (``join`` gets its iterable as a list, having counted it)."""
    owner = getattr(obj, "__self__", None)
    name = getattr(obj, "__name__", "")
    if isinstance(owner, int) and name == "to_bytes":
        length = args[0] if args else kwargs.get("length", 1)
        if isinstance(length, int):
            _refuse_size(length)
        return args
    if not isinstance(owner, (str, bytes)) or not (args or kwargs):
        return args
    n = len(owner)
    first = args[0] if args else next(iter(kwargs.values()))  # expandtabs(tabsize=...)
    est = n
    if name in ("center", "ljust", "rjust", "zfill") and isinstance(first, int):
        est = first
    elif name == "expandtabs" and isinstance(first, int):
        est = n + owner.count("\t" if isinstance(owner, str) else b"\t") * first  # type: ignore[arg-type]
    elif name == "replace" and len(args) >= 2:
        old, new = first, args[1]
        hits = owner.count(old) if len(old) else n + 1
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            hits = min(hits, args[2])
        est = n + hits * len(new)
    elif name == "join":
        items = list(first)
        est = sum(len(x) for x in items if isinstance(x, (str, bytes))) + n * len(items)
        args = (items, *args[1:])
    elif name == "translate" and isinstance(first, Mapping):
        longest = max((len(v) for v in first.values() if isinstance(v, (str, bytes))), default=1)
        est = n * max(longest, 1)
    _refuse_size(est)
    return args
