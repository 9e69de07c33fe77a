"""The docs say what the code does: tables that mirror code are checked against it, so neither can
change without the other."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

import unillm
import unillm._errors
import unillm.testing
from unillm._config import ENV_VARS
from unillm.engines.exllamav2 import ExLlamaV2Options
from unillm.engines.llamacpp import LlamaCppOptions
from unillm.engines.mlx import MLXOptions
from unillm.engines.vllm import VLLMOptions
from unillm.testing import MockEngine, check_engine

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def read(page: str) -> str:
    return (DOCS / page).read_text(encoding="utf-8")


def table(text: str, heading: str) -> list[list[str]]:
    """The rows (cells stripped, header and rule dropped) of the first table under ``heading``."""
    section = text.split(f"\n{heading}\n", 1)
    assert len(section) == 2, f"no {heading!r} section"
    rows: list[list[str]] = []
    for line in section[1].splitlines():
        if rows and not line.startswith("|"):
            break
        if line.startswith("|"):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    assert len(rows) > 2, f"no table under {heading!r}"
    return rows[2:]


def code(cell: str) -> str:
    match = re.fullmatch(r"`([^`]+)`", cell)
    assert match, f"{cell!r} is not one code span"
    return match.group(1)


BACKEND_PAGES = [
    ("backends/llamacpp.md", LlamaCppOptions),
    ("backends/mlx.md", MLXOptions),
    ("backends/exllamav2.md", ExLlamaV2Options),
    ("backends/vllm.md", VLLMOptions),
]


@pytest.mark.parametrize(("page", "options"), BACKEND_PAGES, ids=["llamacpp", "mlx", "exllamav2", "vllm"])
def test_every_backend_option_is_documented(page: str, options: type[BaseModel]) -> None:
    text = read(page)
    for name in options.model_fields:
        assert f"`{name}`" in text, f"option {name} is missing from docs/{page}"


@pytest.mark.parametrize(("page", "options"), BACKEND_PAGES, ids=["llamacpp", "mlx", "exllamav2", "vllm"])
def test_backend_options_table_matches_the_model(page: str, options: type[BaseModel]) -> None:
    rows = table(read(page), "## Options")
    documented = {code(row[0]): row for row in rows}
    assert list(documented) == list(options.model_fields)  # same names, same order
    for name, field in options.model_fields.items():
        default = field.get_default(call_default_factory=True)
        assert ast.literal_eval(code(documented[name][2])) == default, f"default of {name}"


def test_every_env_var_is_documented() -> None:
    text = read("configuration.md")
    for var in ENV_VARS:
        assert f"`{var}`" in text, f"{var} is missing from docs/configuration.md"


def test_env_var_table_matches_the_code() -> None:
    rows = table(read("configuration.md"), "## Environment variables")
    assert {code(r[0]): code(r[1]) for r in rows} == ENV_VARS


def test_engine_config_table_matches_the_model() -> None:
    rows = table(read("configuration.md"), "## EngineConfig")
    assert [code(r[0]) for r in rows] == list(unillm.EngineConfig.model_fields)


def test_server_config_table_matches_the_model() -> None:
    from unillm.server import ServerConfig

    rows = table(read("server.md"), "## ServerConfig")
    assert [code(r[0]) for r in rows] == list(ServerConfig.model_fields)


def test_api_reference_covers_every_public_name() -> None:
    text = read("api.md")
    documented = set(re.findall(r"^::: (\S+)$", text, re.MULTILINE))
    for name in unillm.__all__:
        assert f"unillm.{name}" in documented, f"unillm.{name} is missing from docs/api.md"
    tails = {d.rsplit(".", 1)[1] for d in documented if d.startswith("unillm.testing.")}
    assert set(unillm.testing.__all__) - {"SIZES"} <= tails


def test_concepts_draws_the_error_tree_from_the_code() -> None:
    doc = unillm._errors.__doc__
    assert doc is not None
    start = doc.index("    UnillmError")
    tree = "\n".join(line.removeprefix("    ") for line in doc[start : doc.index("\n\n", start)].splitlines())
    assert tree in read("concepts.md")


def test_conformance_table_lists_every_check() -> None:
    rows = table(read("testing.md"), "## The conformance checks")
    passed = check_engine(MockEngine(lambda prompt, params: "alpha beta gamma delta").load())
    assert [code(r[0]) for r in rows] == passed


def test_nav_lists_every_page_and_only_pages_that_exist() -> None:
    nav = re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(encoding="utf-8"), re.MULTILINE)
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages


@pytest.mark.parametrize("page", sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")))
def test_relative_links_resolve(page: str) -> None:
    # mkdocs checks links between pages; links out of docs/ (to plugins/, examples/) are checked here.
    source = DOCS / page
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", source.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue
        assert (source.parent / target).exists(), f"{page} links to {target}, which does not exist"


def test_the_hook_reference_in_plugins_md_is_generated_from_the_hookspecs() -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, str(root / "scripts" / "gen_hookspecs_doc.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    text = (root / "docs" / "plugins.md").read_text()
    from unillm import hookspecs

    for name in ("unillm_register_backends", "unillm_guide_entries", "unillm_inspect_model"):
        assert callable(getattr(hookspecs, name))
        assert f"### `{name}(" in text


def test_every_plugin_here_has_a_page_linked_from_plugins_md() -> None:
    root = Path(__file__).resolve().parent.parent
    text = (root / "docs" / "plugins.md").read_text()
    for plugin in sorted((root / "plugins").iterdir()):
        if not (plugin / "pyproject.toml").is_file() or plugin.name == "unillm-reverse":
            continue
        page = f"plugins/{plugin.name.removeprefix('unillm-')}.md"
        assert (root / "docs" / page).is_file(), f"{plugin.name} has no docs/{page}"
        assert f"]({page})" in text, f"docs/plugins.md does not link {page}"
