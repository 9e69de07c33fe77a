"""The sandboxed, bounded jinja environment chat templates compile in.

jinja2's ``ImmutableSandboxedEnvironment`` with a code generator that puts a deadline check in
every loop and a size check on every literal container and ``~`` join, bounded calls and
operators, and every filter wrapped to check time and result (those that amplify, before they
run). The checks themselves: ``unillm._chat_bounds``; why: ``unillm._chat``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, wraps
from time import monotonic
from typing import TYPE_CHECKING, Any

from unillm._chat_bounds import (
    _BUDGET,
    _MAX_SLICES,
    _NAMESPACE,
    MAX_CALL_DEPTH,
    MAX_WORK_CHARS,
    _check_format_specs,
    _check_method,
    _check_power,
    _check_printf,
    _check_repeat,
    _concat,
    _finalize,
    _late,
    _Limit,
    _made,
    _made_here,
    _measure,
    _refuse_size,
    _text_size,
    _tick,
)
from unillm._errors import ConfigError

if TYPE_CHECKING:
    from jinja2 import Environment

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
    tick = "unillm._chat_bounds._tick"

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
