"""What the tests of the plugins under plugins/ share: a clean environment for a subprocess, a
run of this interpreter in it, and the ``.dist-info`` that ``pip install`` would leave behind, so
that a plugin is found through a real entry point without installing it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = ["ROOT", "clean_env", "fake_install", "pip_install", "run", "unillm_imports"]

ROOT = Path(__file__).resolve().parent.parent


def clean_env(cache: Path) -> dict[str, str]:
    """This environment less every ``UNILLM_*`` variable and PYTHONPATH, with its own cache."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UNILLM_")}
    clean["UNILLM_CACHE"] = str(cache)
    clean.pop("PYTHONPATH", None)
    return clean


def run(args: list[str], env: dict[str, str], cwd: Path = ROOT, timeout: float = 300) -> str:
    """``python ARGS`` in ``env``; its stdout, once it has exited 0 (else the test fails with both
    streams' tails)."""
    cmd = [sys.executable, *args]
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    tails = f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{args} exited {proc.returncode}\n{tails}"
    return proc.stdout


def fake_install(where: Path, dist: str, entry: str, module: str) -> Path:
    """A ``<dist>-0.1.0.dist-info`` in ``where`` naming ``entry = module`` in the ``unillm`` group:
    with ``where`` on PYTHONPATH, importlib.metadata finds the plugin as if pip had installed it."""
    info = where / f"{dist.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[unillm]\n{entry} = {module}\n")
    return info


def pip_install(plugin: Path, where: Path) -> Path:
    """``pip install`` the plugin's directory into ``where`` (its code and real ``.dist-info``, no
    dependencies, no network: the build backend comes from this environment); ``where`` then goes
    on PYTHONPATH."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    cmd += ["--no-index", "--target", str(where), str(plugin)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"pip install {plugin} failed:\n{proc.stderr[-3000:]}"
    return where


def unillm_imports(paths: Iterable[Path]) -> tuple[list[str], list[str]]:
    """The unillm modules the Python files at ``paths`` import, and the private ones among them
    (a part starting with ``_``): a plugin must use only the public kit."""
    imported: list[str] = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.append(node.module)
    ours = [m for m in imported if m.split(".")[0] == "unillm"]
    return ours, [m for m in ours if any(part.startswith("_") for part in m.split("."))]
