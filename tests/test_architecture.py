"""The shape of the code, as tests so it stays true: no import cycles, dependencies point down,
small files, and a core that names no engine (what is specific to one lives with it)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PKG = Path(__file__).parent.parent / "unillm"
MAX_LINES = 500

#: The contract every backend and user builds on: it depends on nothing above it.
CONTRACT = {
    "unillm._errors",
    "unillm._types",
    "unillm._config",
    "unillm._engine",
    "unillm._lifetime",
    "unillm._run",
    "unillm._checks",
    "unillm._stop",
    "unillm.hookspecs",
}
#: What sits above the contract and the facts: selection, discovery, the CLI, the backends.
ABOVE = ("unillm._select", "unillm._auto", "unillm._plugins", "unillm._guide", "unillm.cli", "unillm._cli")
#: The core's code paths name no engine: the guide's data (unillm/_guide.py) may.
ENGINE_FREE = ("_select.py", "_auto.py", "_plan.py")


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def imports(path: Path) -> Iterator[str]:
    """The unillm modules ``path`` imports at run time (module or function level; imports under
    ``if TYPE_CHECKING:`` are type-only and do not count)."""
    tree = ast.parse(path.read_text())
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]

    def visit(node: ast.AST) -> Iterator[str]:
        for child in ast.iter_child_nodes(node):
            if _type_checking_block(child):
                continue
            if isinstance(child, ast.Import):
                yield from (a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    base = ".".join([*parts[: len(parts) - child.level + 1], base]).rstrip(".")
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    yield sub if sub in MODULES else base
            yield from visit(child)

    for found in visit(tree):
        if found.split(".")[0] == "unillm":
            # a name inside a module counts as that module
            name = found
            while name not in MODULES and "." in name:
                name = name.rpartition(".")[0]
            if name in MODULES and name != me:
                yield name


GRAPH = {m: set(imports(p)) for m, p in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    return out


def test_the_import_graph_was_read() -> None:
    assert "unillm._lifetime" in GRAPH["unillm._engine"]
    assert "unillm._errors" in GRAPH["unillm._types"]


def test_no_import_cycles() -> None:
    # a package's __init__ importing its own submodules is how packages work, not a cycle
    found = [c for c in cycles(GRAPH) if not _package_and_its_parts(c)]
    assert found == []


def _package_and_its_parts(comp: list[str]) -> bool:
    heads = [m for m in comp if all(o == m or o.startswith(m + ".") for o in comp)]
    return bool(heads)


def test_the_cycle_finder_finds_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", sorted(CONTRACT))
def test_the_contract_depends_on_nothing_above_it(module: str) -> None:
    up = sorted(m for m in GRAPH[module] if m.startswith(ABOVE) or m.startswith("unillm.engines"))
    assert up == [], f"{module} imports {up}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("unillm.engines.")))
def test_backends_take_their_facts_rather_than_inspect_or_probe(module: str) -> None:
    probing = sorted(m for m in GRAPH[module] if m.startswith(("unillm._inspect", "unillm._hardware")))
    assert probing == [], f"{module} imports {probing}: read self.facts instead"


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_no_file_over_500_lines(path: Path) -> None:
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(PKG.parent)} has {n} lines: split it by layer"


def _code_words(path: Path) -> Iterator[tuple[int, str]]:
    """Every identifier and string constant of ``path``'s code, docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg


def _names_an_engine(word: str) -> bool:
    w = word.lower()
    return any(k in w for k in ("llama", "vllm", "exllama")) or w == "mlx" or "mlx" in w.split("_")


@pytest.mark.parametrize("name", ENGINE_FREE)
def test_the_core_names_no_engine(name: str) -> None:
    found = [(line, w) for line, w in _code_words(PKG / name) if _names_an_engine(w)]
    assert found == [], f"unillm/{name} names engines at {found}: that knowledge belongs to the backend"


def test_the_engine_name_check_can_fail() -> None:
    assert _names_an_engine("llama.cpp") and _names_an_engine("n_gpu_layers_for_vllm")
    assert _names_an_engine("mlx") and not _names_an_engine("mlx-(\\d+)bit") and not _names_an_engine("plan")
