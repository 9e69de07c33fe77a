"""The shape of the code, as tests so it stays true (docs/architecture.md draws it).

The folders are the layers: each package under ``unillm/`` is a room, and the rooms stand on
floors. A module imports from its own room and from rooms on lower floors only; no import circle;
no private name crosses from one room to another; an engine reaches the core through the kit
(``unillm.backend``) and the public namespace only, as a plugin must. Everything here is derived
from the files on disk: a new module lands in its folder's room without editing this test.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PKG = Path(__file__).parent.parent / "unillm"

#: The floors, lowest first. A room is a top-level module of ``unillm`` (the vocabulary) or a
#: package; an engine's package is a room of its own on the engines' floor.
FLOORS: tuple[tuple[str, ...], ...] = (
    (
        "unillm",
    ),  # the vocabulary: _errors _types _params _config _structured hookspecs, and the lazy namespace
    ("unillm._chat", "unillm._inspect", "unillm._hardware"),
    ("unillm._plan",),
    ("unillm._hub",),  # models by name: resolved, the quantization that fits chosen, downloaded
    ("unillm._contract",),
    ("unillm._choose",),
    ("unillm.backend",),
    ("unillm.engines.*", "unillm.testing"),  # each engine a room: unillm/engines/<name>/
    ("unillm.engines", "unillm.server", "unillm.bench"),  # unillm.engines: the built-ins' hook module
    ("unillm.cli",),
    ("unillm.__main__",),  # python -m unillm
)
#: Modules past 600 lines, each with the reason it is one module (1,000 is the ceiling).
LONG = {
    "unillm/_contract/_engine.py": "the Engine class: one template method, its sync and async, plain and "
    "chat halves, and the chat helpers the server shares",
}
SOFT_LIMIT, HARD_LIMIT = 600, 1000
MAX_TOP_LEVEL_MODULES = 12
#: What a module under unillm/engines/ may import from unillm besides its own package.
KIT = ("unillm", "unillm.backend", "unillm.hookspecs")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def room(module: str) -> str:
    """The package a module lives in: ``unillm`` for the top-level modules, an engine's package
    for the modules under it, else the first package under ``unillm``."""
    parts = module.split(".")
    if module == "unillm.__main__":
        return module
    if len(parts) >= 3 and parts[1] == "engines":
        return ".".join(parts[:3])
    if len(parts) >= 2 and (PKG / parts[1]).is_dir():
        return ".".join(parts[:2])
    return "unillm"


def floor(module: str) -> int:
    r = room(module)
    top = "unillm.engines.*" if r.startswith("unillm.engines.") else r
    for i, rooms in enumerate(FLOORS):
        if top in rooms:
            return i
    raise AssertionError(
        f"{module} is in {r!r}, a room on no floor: add it to FLOORS and docs/architecture.md"
    )


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # the unillm module imported (a name inside a module counts as that module)
    names: tuple[str, ...]  # what ``from ... import`` took from it
    type_only: bool
    line: int


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _owner(name: str) -> str | None:
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name if name in MODULES else None


def imports(path: Path) -> Iterator[Import]:
    """Every import of a unillm module in ``path``, at module or function level, marked type-only
    when it sits under ``if TYPE_CHECKING:``."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]

    def visit(node: ast.AST, type_only: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            t = type_only or _type_checking_block(child)
            if isinstance(child, ast.Import):
                for a in child.names:
                    owner = _owner(a.name) if a.name.split(".")[0] == "unillm" else None
                    if owner and owner != me:
                        yield Import(me, owner, (), t, child.lineno)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    base = ".".join([*parts[: len(parts) - child.level + 1], base]).rstrip(".")
                if base.split(".")[0] != "unillm":
                    continue
                by_target: dict[str, list[str]] = {}
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    target = sub if sub in MODULES else _owner(base)
                    if target and target != me:
                        by_target.setdefault(target, []).append(alias.name)
                for target, names in by_target.items():
                    yield Import(me, target, tuple(names), t, child.lineno)
            yield from visit(child, t)

    yield from visit(ast.parse(path.read_text(encoding="utf-8")), False)


IMPORTS = [i for p in MODULES.values() for i in imports(p)]
GRAPH = {m: {i.target for i in IMPORTS if i.importer == m and not i.type_only} for m in MODULES}


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


def upward(imports: list[Import]) -> list[str]:
    """Run-time imports that point to a higher floor, or sideways into another room on the same
    floor."""
    return [
        f"{i.importer}:{i.line} imports {i.target}"
        for i in imports
        if not i.type_only and room(i.importer) != room(i.target) and floor(i.target) >= floor(i.importer)
    ]


def private_crossings(imports: list[Import]) -> list[str]:
    """A private name (module, function, constant) taken from another room."""
    return [
        f"{i.importer}:{i.line} takes {', '.join(n for n in i.names if _private(n))} from {i.target}"
        for i in imports
        if room(i.importer) != room(i.target) and any(_private(n) for n in i.names)
    ]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def past_the_kit(imports: list[Import]) -> list[str]:
    """What a module under unillm/engines/<name>/ imports from unillm other than the kit, the
    public namespace and its own package."""
    return [
        f"{i.importer}:{i.line} imports {i.target}"
        for i in imports
        if room(i.importer).startswith("unillm.engines.")
        and room(i.target) != room(i.importer)
        and not (i.target in KIT or i.target.startswith("unillm.backend."))
    ]


# ---- the checks ----


def test_the_import_graph_was_read() -> None:
    assert "unillm._contract._lifetime" in GRAPH["unillm._contract._engine"]
    assert "unillm._errors" in GRAPH["unillm._types"]
    assert room("unillm.engines.vllm._args") == "unillm.engines.vllm" and room("unillm._errors") == "unillm"
    assert room("unillm._inspect._gguf") == "unillm._inspect" and floor("unillm.cli._run") == len(FLOORS) - 2


def test_every_room_stands_on_a_floor() -> None:
    for m in MODULES:
        floor(m)  # raises for a package on no floor


def test_no_import_cycles() -> None:
    # a package's __init__ importing its own submodules is how packages work, not a cycle
    found = [c for c in cycles(GRAPH) if not _package_and_its_parts(c)]
    assert found == []


def _package_and_its_parts(comp: list[str]) -> bool:
    heads = [m for m in comp if all(o == m or o.startswith(m + ".") for o in comp)]
    return bool(heads)


def test_imports_point_down() -> None:
    assert upward(IMPORTS) == []


def test_no_private_name_crosses_a_room() -> None:
    assert private_crossings(IMPORTS) == []


def test_engines_reach_the_core_through_the_kit_only() -> None:
    assert past_the_kit(IMPORTS) == []


def test_engines_take_their_facts_rather_than_inspect_or_probe() -> None:
    probing = {"inspect_model", "detect_hardware", "load_hardware", "detect_format", "read_gguf_header"}
    found = [
        f"{i.importer}:{i.line}"
        for i in IMPORTS
        if room(i.importer).startswith("unillm.engines.") and probing & set(i.names)
    ]
    assert found == [], "read self.facts instead"


def test_the_checks_can_fail() -> None:
    """Each rule above, shown failing on an import made up to break it."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    up = Import("unillm._plan._estimate", "unillm._choose._select", ("select",), False, 1)
    sideways = Import("unillm._chat._template", "unillm._inspect._files", ("read",), False, 1)
    assert len(upward([up, sideways])) == 2
    assert upward([Import("unillm._plan._estimate", "unillm._choose._select", (), True, 1)]) == []
    private = Import("unillm.server._app", "unillm._contract._run", ("_helper",), False, 1)
    assert private_crossings([private]) and not private_crossings(
        [Import("unillm._inspect", "unillm._inspect._files", ("_open",), False, 1)]
    )
    reach = Import("unillm.engines.mlx._model", "unillm._inspect._paths", ("hf_dir_in",), False, 1)
    assert past_the_kit([reach]) and not past_the_kit(
        [Import("unillm.engines.mlx._model", "unillm.backend", ("hf_dir_in",), False, 1)]
    )


def test_the_top_level_holds_few_modules() -> None:
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_every_built_in_engine_is_a_package() -> None:
    loose = sorted(p.name for p in (PKG / "engines").glob("*.py") if p.name != "__init__.py")
    assert loose == [], "an engine's modules live in its package, unillm/engines/<name>/"


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_module_size(path: Path) -> None:
    rel = str(path.relative_to(PKG.parent))
    n = len(path.read_text(encoding="utf-8").splitlines())
    assert n <= HARD_LIMIT, f"{rel} has {n} lines: split it by concept"
    if rel in LONG:
        assert n > SOFT_LIMIT, f"{rel} has {n} lines now: take it out of LONG"
    else:
        assert n <= SOFT_LIMIT, f"{rel} has {n} lines: split it by concept, or say in LONG why it is one"


# ---- the core names no engine ----

#: The core's code paths name no engine: the guide's data (_guide.py) may, and the registry's
#: refusal of Ollama by name (_registry.py) says which built-in to use instead.
ENGINE_FREE = sorted(
    str(p.relative_to(PKG))
    for folder in ("_contract", "_plan", "_choose")
    for p in (PKG / folder).glob("*.py")
    if p.name not in ("_guide.py", "_registry.py")
)


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


#: How the drawing names the rooms that are not a folder of their own.
DRAWN = {"unillm": "_errors", "unillm.engines": "engines/__init__.py", "unillm.__main__": "__main__"}


def test_the_drawing_in_the_docs_is_the_floors() -> None:
    """docs/architecture.md draws each floor on a line ``floor N  rooms...``: the same rooms as
    ``FLOORS``, every engine package named on the engines' floor."""
    doc = (PKG.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    lines = {int(line.split()[1]): line for line in doc.splitlines() if line.startswith("floor ")}
    assert sorted(lines) == list(range(len(FLOORS)))
    engines = sorted(p.name for p in (PKG / "engines").iterdir() if (p / "__init__.py").is_file())
    for i, rooms in enumerate(FLOORS):
        for r in rooms:
            if r == "unillm.engines.*":
                names = [f"engines/{e}/" for e in engines]
            else:
                special = {
                    "unillm": "_errors",
                    "unillm.engines": "engines/__init__.py",
                    "unillm.__main__": "__main__",
                }
                names = [special.get(r, r.removeprefix("unillm.") + "/")]
            for name in names:
                assert name in lines[i], f"docs/architecture.md's floor {i} does not name {name}"
