"""The sandboxed, bounded jinja environment chat templates compile in, and the bounds it enforces.

The limits (deadline, value size, work budget, call depth, nesting) and the per-render budget;
jinja2's ``ImmutableSandboxedEnvironment`` with a code generator that puts a deadline check in
every loop and a size check on every literal container and ``~`` join, bounded calls and
operators, and every filter wrapped to check time and result (those that amplify, before they
run). Why each bound exists: ``unillm._chat._template``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import lru_cache, wraps
from string import Formatter
from time import monotonic
from typing import TYPE_CHECKING, Any

from unillm._errors import ConfigError

if TYPE_CHECKING:
    from jinja2 import Environment

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


# ---- filters: each checked for time and result; those that amplify, before they run ----


def _est_center(a: dict[str, Any]) -> int:
    width = a["width"]
    return max(_text_size(a["value"]), width if isinstance(width, int) else 0)


def _est_indent(a: dict[str, Any]) -> int:
    width = a["width"]
    w = width if isinstance(width, int) else len(str(width))
    text = str(a["s"])
    return max(w, len(text) + (text.count("\n") + 1) * w)  # " " * width is made even for ""


def _est_format(a: dict[str, Any]) -> int:
    _check_printf(str(a["value"]), a["args"])
    return 0


def _est_join(a: dict[str, Any]) -> int:
    items = a["value"] = list(a["value"])
    return sum(_text_size(x) + (64 if a["attribute"] is not None else 0) for x in items) + len(items) * len(
        str(a["d"])
    )


def _est_replace(a: dict[str, Any]) -> int:
    text, old, new, count = str(a["s"]), str(a["old"]), str(a["new"]), a["count"]
    hits = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * len(new)


def _est_wordwrap(a: dict[str, Any]) -> int:
    text, width = str(a["s"]), a["width"]
    width = max(width if isinstance(width, int) else 1, 1)
    if a["break_long_words"] and text:
        # textwrap copies the rest of a long word for each line it cuts from it: quadratic
        longest = max(map(len, text.split()), default=0)
        if len(text) * (longest // width + 1) > MAX_WORK_CHARS:
            raise _Limit(f"it wraps a {longest}-character word into {width}-character lines")
    lines = len(text) // width + 1 + text.count(" ") + text.count("-") + text.count("\n")
    return len(text) + lines * len(str(a["wrapstring"] or "\n"))


def _est_urlize(a: dict[str, Any]) -> int:
    n = _text_size(a["value"])
    extra = 64 + len(str(a["target"] or "")) + len(str(a["rel"] or ""))
    return 3 * n + (n // 4 + 1) * extra  # each link repeats its url and attributes


def _est_batch(a: dict[str, Any]) -> int:
    count = a["linecount"]
    return count if isinstance(count, int) and a["fill_with"] is not None else 0


def _est_slice(a: dict[str, Any]) -> int:
    slices = a["slices"]
    if isinstance(slices, int) and slices > _MAX_SLICES:
        raise _Limit(f"it slices into {slices} parts")
    return 0


def _est_tojson(a: dict[str, Any]) -> int:
    size, nesting = _measure(a["value"], _BUDGET.get())
    indent = a["indent"]
    w = indent if isinstance(indent, int) else len(str(indent)) if indent else 0
    return 6 * size + size * nesting * w  # \uXXXX escapes; each line indented by its depth


def _est_pprint(a: dict[str, Any]) -> int:
    size, nesting = _measure(a["value"], _BUDGET.get())
    return size * (8 + nesting)  # pprint is pure Python and slow: a megabyte takes a second


def _est_sum(a: dict[str, Any]) -> int:
    if isinstance(a["start"], (int, float)):
        return 0
    items = a["iterable"] = list(a["iterable"])  # adding lists or strings copies: quadratic
    return len(items) * (sum(map(_text_size, items)) + _text_size(a["start"]))


_ESTIMATES: dict[str, Callable[[dict[str, Any]], int]] = {
    "center": _est_center,
    "indent": _est_indent,
    "format": _est_format,
    "join": _est_join,
    "replace": _est_replace,
    "wordwrap": _est_wordwrap,
    "urlize": _est_urlize,
    "batch": _est_batch,
    "slice": _est_slice,
    "tojson": _est_tojson,
    "pprint": _est_pprint,
    "sum": _est_sum,
}


def _sync(func: Callable[..., Any]) -> Callable[..., Any]:
    """The sync function behind one of jinja's async-variant filters: that wrapper takes an extra
    eval context its own signature does not show, which would misalign the estimates' arguments,
    and this environment is never async."""
    inner = getattr(func, "__wrapped__", None) if getattr(func, "jinja_async_variant", False) else None
    return inner if callable(inner) else func


def _bounded_filter(func: Callable[..., Any], estimate: Callable[[dict[str, Any]], int] | None) -> Any:
    import inspect

    signature = inspect.signature(func) if estimate is not None else None

    @wraps(func)  # keeps jinja's pass_context/pass_eval_context marker
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get()
        if budget is not None and monotonic() > budget.deadline:
            raise _late()
        if signature is not None and estimate is not None:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            _refuse_size(estimate(bound.arguments))
            args, kwargs = bound.args, bound.kwargs
        return _made(func(*args, **kwargs), budget)

    return bounded


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    """jinja's ``lipsum`` global, refusing to write a book."""
    from jinja2.utils import generate_lorem_ipsum

    if isinstance(n, int) and isinstance(max, int):
        _refuse_size(n * max * 12)  # words of up to 12 characters
    return generate_lorem_ipsum(n=n, html=html, min=min, max=max)


def _raise_exception(message: str) -> None:
    raise ConfigError(f"the chat template refused the messages: {message}")


# ---- the environment ----


@lru_cache(maxsize=1)
def _environment() -> Environment:
    """The one sandboxed environment every template compiles in (built on first use, so that
    ``import unillm`` does not import jinja2)."""
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator, Frame
    from jinja2.ext import Extension, loopcontrols
    from jinja2.parser import Parser
    from jinja2.runtime import Context
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    _NAMESPACE[0] = Namespace

    # jinja forbids new node types, so the deadline check is an ImportedName with a name no
    # template can produce, which this generator writes as a call.
    tick = "unillm._chat._sandbox._tick"

    class _Generator(CodeGenerator):
        """jinja's code generator, plus a deadline check in every loop and a size check on every
        literal container and ``~`` join."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.chained: set[int] = set()  # ids of the Add nodes inside a longer + chain

        def visit_For(self, node: nodes.For, frame: Frame) -> None:
            check = nodes.ImportedName(tick, lineno=node.lineno)
            node.body.insert(0, nodes.ExprStmt(check, lineno=node.lineno))
            if node.test is not None:  # the loop's ``if`` runs even when the body does not
                node.test = nodes.And(check, node.test, lineno=node.lineno)
                node.test.set_environment(self.environment)
            super().visit_For(node, frame)

        def visit_ImportedName(self, node: nodes.ImportedName, frame: Frame) -> None:
            if node.importname == tick:
                self.write("environment.unillm_tick()")
            else:
                super().visit_ImportedName(node, frame)

        def _checked(self, visit: Callable[[Any, Frame], None], node: nodes.Expr, frame: Frame) -> None:
            self.write("environment.unillm_made(")
            visit(node, frame)
            self.write(")")

        def visit_Add(self, node: nodes.BinExpr, frame: Frame) -> None:
            # ``+`` is not intercepted (real templates chain it: ``'<|im_start|>' + role + ...``):
            # only a chain's outermost result is checked, as no part of a chain is longer than it.
            for side in (node.left, node.right):
                if isinstance(side, nodes.Add):
                    self.chained.add(id(side))
            if id(node) in self.chained:
                super().visit_Add(node, frame)
            else:
                self._checked(super().visit_Add, node, frame)

        def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
            self._checked(super().visit_Concat, node, frame)

        def visit_List(self, node: nodes.List, frame: Frame) -> None:
            self._checked(super().visit_List, node, frame)

        def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
            self._checked(super().visit_Dict, node, frame)

        def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
            if node.ctx == "load":  # not an assignment target (``{% for a, b in ... %}``)
                self._checked(super().visit_Tuple, node, frame)
            else:
                super().visit_Tuple(node, frame)

    class _Generation(Extension):
        """Transformers' ``{% generation %}`` tag (marks assistant text for training): rendered as
        its body, as transformers and llama-cpp-python do."""

        tags = {"generation"}  # noqa: RUF012 (jinja's own annotation)

        def parse(self, parser: Parser) -> list[nodes.Node]:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    class _Bounded(ImmutableSandboxedEnvironment):
        code_generator_class = _Generator
        intercepted_binops = frozenset({"*", "**", "%"})
        unillm_tick = staticmethod(_tick)
        unillm_made = staticmethod(_made_here)

        def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
            if operator == "*":
                _check_repeat(left, right)
            elif operator == "**":
                _check_power(left, right)
            elif operator == "%":
                _check_printf(left, right)
            return _made(self.binop_table[operator](left, right), _BUDGET.get())

        def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
            budget = _BUDGET.get()
            if budget is not None:
                if monotonic() > budget.deadline:
                    raise _late()
                if budget.depth >= MAX_CALL_DEPTH:
                    raise _Limit(f"its calls nest more than {MAX_CALL_DEPTH} deep (a runaway recursion)")
                budget.depth += 1
            try:
                args = _check_method(obj, args, kwargs)
                result = super().call(context, obj, *args, **kwargs)
            finally:
                if budget is not None:
                    budget.depth -= 1
            return _made(result, budget)

        def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
            wrapped = super().wrap_str_format(value)
            if wrapped is not None:
                _check_format_specs(value.__self__)
            return wrapped

    # The same settings and extensions as transformers' apply_chat_template, so templates render
    # identically (and a template that uses {% break %} compiles here as it does there).
    env = _Bounded(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _Generation], finalize=_finalize
    )
    env.concat = _concat  # type: ignore[method-assign,assignment]
    env.filters = {name: _bounded_filter(_sync(f), _ESTIMATES.get(name)) for name, f in env.filters.items()}
    env.globals["lipsum"] = _lipsum
    env.globals["raise_exception"] = _raise_exception
    return env
