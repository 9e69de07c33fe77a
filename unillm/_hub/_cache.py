"""What the Hugging Face cache holds, model by model, and taking a model out of it.

Read from the cache's layout directly (``models--org--name/{refs,snapshots,blobs}``): no network,
and no import of ``huggingface_hub``. Downloads cut off midway (``*.unillm-partial``) count in a
repo's size on disk but are never listed as files.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from unillm._errors import ModelNotFound
from unillm._hub._client import HubEnv, hub_env, repo_dir
from unillm._hub._files import gguf_files, pick_gguf
from unillm._names import ModelName

__all__ = ["CachedModel", "cached_models", "remove"]


@dataclass(frozen=True)
class CachedModel:
    """One revision of a repo in the cache: its files, their size, its format and quantization."""

    id: str
    revision: str  # the commit
    refs: tuple[str, ...]  # the branches and tags that name it
    files: tuple[str, ...]
    size: int
    format: str  # "gguf", "safetensors", "hf" or "unknown"
    quantization: str | None
    path: str  # the snapshot folder

    def as_dict(self) -> dict[str, object]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}


def cached_models(env: HubEnv | None = None) -> list[CachedModel]:
    """Every model revision in the cache (``HF_HUB_CACHE``), by repo id then commit."""
    env = env or hub_env()
    out: list[CachedModel] = []
    if not env.cache_dir.is_dir():
        return out
    for folder in sorted(env.cache_dir.glob("models--*")):
        repo = folder.name.removeprefix("models--").replace("--", "/", 1)
        refs: dict[str, list[str]] = {}
        for ref in sorted((folder / "refs").rglob("*")) if (folder / "refs").is_dir() else []:
            if ref.is_file():
                refs.setdefault(ref.read_text(encoding="utf-8").strip(), []).append(
                    ref.relative_to(folder / "refs").as_posix()
                )
        for snapshot in sorted((folder / "snapshots").glob("*")) if (folder / "snapshots").is_dir() else []:
            files = {
                p.relative_to(snapshot).as_posix(): p.stat().st_size
                for p in sorted(snapshot.rglob("*"))
                if p.is_file() and not p.name.endswith(".unillm-partial")
            }
            if not files:
                continue
            fmt, quant = _format(snapshot, files)
            out.append(
                CachedModel(
                    repo,
                    snapshot.name,
                    tuple(refs.get(snapshot.name, ())),
                    tuple(files),
                    sum(files.values()),
                    fmt,
                    quant,
                    str(snapshot),
                )
            )
    return out


def _format(snapshot: Path, files: dict[str, int]) -> tuple[str, str | None]:
    ggufs = gguf_files(files)
    if ggufs:
        quants = list(dict.fromkeys(g.quant or "?" for g in ggufs))
        return "gguf", ",".join(quants)
    if any(f.endswith(".safetensors") for f in files):
        quant = None
        try:
            config = json.loads((snapshot / "config.json").read_text(encoding="utf-8"))
            q = config.get("quantization_config") or {}
            quant = q.get("quant_method") or config.get("torch_dtype") or config.get("dtype")
        except (OSError, ValueError, AttributeError):
            pass
        return "safetensors", str(quant) if quant else None
    if "config.json" in files:
        return "hf (no weights)", None
    return "unknown", None


def remove(name: ModelName, env: HubEnv | None = None) -> list[str]:
    """Take ``name`` out of the cache: the whole repo, or with a tag that GGUF's files (and
    their blobs, when no other snapshot links to them). Returns the paths removed; raises
    ``ModelNotFound`` when nothing of it is cached."""
    env = env or hub_env()
    folder = repo_dir(env, name.repo)
    if not folder.is_dir():
        raise ModelNotFound(str(name))
    if name.tag is None and name.revision is None:
        shutil.rmtree(folder)
        return [str(folder)]
    removed: list[str] = []
    for snapshot in sorted((folder / "snapshots").glob("*")):
        if name.revision and snapshot.name != name.revision and _ref(folder, name.revision) != snapshot.name:
            continue
        files = {p.relative_to(snapshot).as_posix(): 0 for p in snapshot.rglob("*") if not p.is_dir()}
        doomed = list(files)
        if name.tag is not None:
            doomed = list(pick_gguf(name.repo, gguf_files(files), name.tag).parts)
        for rel in doomed:
            link = snapshot / rel
            target = link.resolve() if link.is_symlink() else None
            link.unlink(missing_ok=True)
            removed.append(str(link))
            if target is not None and target.is_file() and not _linked(folder, target):
                target.unlink()
                removed.append(str(target))
        if not any(p.is_file() for p in snapshot.rglob("*")):
            shutil.rmtree(snapshot)
            for ref in (folder / "refs").rglob("*") if (folder / "refs").is_dir() else ():
                if ref.is_file() and ref.read_text(encoding="utf-8").strip() == snapshot.name:
                    ref.unlink()  # a branch or tag naming what is gone
    if not removed:
        raise ModelNotFound(str(name))
    for partial in (folder / "blobs").glob("*.unillm-partial") if name.tag is None else ():
        partial.unlink()
    return removed


def _ref(folder: Path, revision: str) -> str | None:
    ref = folder / "refs" / revision
    return ref.read_text(encoding="utf-8").strip() if ref.is_file() else None


def _linked(folder: Path, blob: Path) -> bool:
    """Whether any snapshot still links to ``blob``."""
    for link in (folder / "snapshots").rglob("*"):
        if link.is_symlink() and os.path.realpath(link) == str(blob):
            return True
    return False
