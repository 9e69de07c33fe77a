"""Models by name: ``org/name[@revision][:QUANT]`` on the Hugging Face Hub, resolved, chosen,
downloaded and cached.

``resolve`` is the one place a name becomes files: it lists the repo at the revision (one API
call; offline, the cache alone), decides which files the name means (a GGUF by its tag, the one
that fits when there is none, or the HF-format files) and reads what selection and the planner
need from headers (GGUF by range requests, ``config.json``) before any weights move.
``Resolved.fetch`` then downloads what is missing (``_download``: resumable, checked). The cache
is ``huggingface_hub``'s, at ``HF_HUB_CACHE``; ``cached_models`` and ``remove`` read and prune it.

One module a concept: ``_client`` (the environment, the listing, the hub's errors as unillm's),
``_files`` (GGUF files, quantization tags, the default rule), ``_remote`` (header-first reads),
``_fit`` (the quantization that fits), ``_download`` and ``_cache``. ``huggingface_hub`` is
imported only when a name is used.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from unillm._errors import NotCached, QuantNotFound, warn
from unillm._hub._cache import CachedModel, cached_models, remove
from unillm._hub._client import HubEnv, Listing, hub_env, listing
from unillm._hub._download import Progress, fetch, log_progress
from unillm._hub._files import GgufFile, gguf_files, hf_files, pick_gguf, quant_of
from unillm._hub._fit import QuantChoice, choose_gguf
from unillm._hub._remote import remote_gguf_info, remote_hf_info
from unillm._inspect import ModelInfo, inspect_model
from unillm._names import ModelName, parse_model_name
from unillm._plan._estimate import Workload

if TYPE_CHECKING:
    from unillm._hardware import Hardware

__all__ = [
    "CachedModel",
    "ModelName",
    "Progress",
    "Resolved",
    "cached_models",
    "hub_env",
    "log_progress",
    "parse_model_name",
    "quant_of",
    "remove",
    "resolve",
]


@dataclass
class Resolved:
    """What a name means: the repo's ``listing`` at a commit, the ``files`` of the model, the
    ``model_path`` a loader opens (a GGUF's first part, or ``""``: the snapshot folder), the
    ``info`` read from headers, and for a GGUF the ``choice`` among its quantizations."""

    name: ModelName
    listing: Listing
    format: str
    files: list[str]
    model_path: str
    info: ModelInfo
    choice: QuantChoice | None
    env: HubEnv

    @property
    def snapshot(self) -> Path:
        return (
            self.env.cache_dir
            / ("models--" + self.name.repo.replace("/", "--"))
            / "snapshots"
            / self.listing.commit
        )

    @property
    def local(self) -> Path | None:
        """The local path to load, when every file is already in the cache."""
        if all((self.snapshot / f).is_file() for f in self.files):
            return self.snapshot / self.model_path if self.model_path else self.snapshot
        return None

    @property
    def size(self) -> int:
        return sum(self.listing.files[f].size for f in self.files if f in self.listing.files)

    def fetch(self, progress: Progress | None = None) -> Path:
        """Download what is missing (resumable, checked) and return the local path to load."""
        snapshot = fetch(self.listing, self.files, self.env, progress)
        return snapshot / self.model_path if self.model_path else snapshot

    def lines(self) -> list[str]:
        """How the name was resolved, for ``explain()``."""
        out = [f"{self.name} -> {self.name.repo}@{self.listing.commit[:12]}: {', '.join(self.files[:4])}"
               + (f" (+{len(self.files) - 4} more)" if len(self.files) > 4 else "")
               + ("" if self.local is None else " (cached)")]  # fmt: skip
        if self.choice is not None:
            out.append("quantizations (highest precision first, * chosen):")
            out.extend(f"  {line}" for line in self.choice.lines())
        return out


def resolve(
    name: ModelName | str,
    *,
    hardware: Hardware | None = None,
    workload: Callable[[ModelInfo], Workload] | None = None,
    reads: Collection[str] | None = None,
) -> Resolved:
    """Resolve ``name`` to its files and what they are, reading headers only.

    ``hardware`` and ``workload`` (the workload asked of a model, given its info) drive the choice
    of quantization when a repo holds several GGUF files and no tag names one. ``reads`` are the
    formats the installed backends read: a repo holding both an HF-format model and GGUF files
    gives, with no tag, the one of them an installed backend reads (the HF format when both or
    neither are, or ``reads`` is not known). Raises
    ``RepoNotFound``, ``RevisionNotFound``, ``QuantNotFound``, ``GatedModel``, ``NotCached``
    (offline, not cached) or ``DownloadError``.
    """
    parsed = parse_model_name(name) if isinstance(name, str) else name
    if parsed is None:
        raise ValueError(f"{name!r} is not a model name (org/name[@revision][:QUANT])")
    env = hub_env()
    lst = listing(parsed, env)
    ggufs = gguf_files(lst.sizes)
    hf_format = "config.json" in lst.files and any(p.endswith(".safetensors") for p in lst.files)
    if ggufs and (parsed.tag or not hf_format):
        return _resolve_gguf(parsed, lst, ggufs, env, hardware, workload)
    if parsed.tag:  # no GGUF file here to bear it
        if lst.cached_only:
            raise NotCached(str(parsed), str(env.cache_dir))
        raise QuantNotFound(parsed.repo, parsed.tag, [])
    hf = _resolve_hf(parsed, lst, env)
    if ggufs and reads is not None and hf.info.format not in reads and "gguf" in reads:
        return _resolve_gguf(parsed, lst, ggufs, env, hardware, workload)  # what runs here
    return hf


def _resolve_hf(parsed: ModelName, lst: Listing, env: HubEnv) -> Resolved:
    files = hf_files(sorted(lst.files))
    resolved = Resolved(parsed, lst, "hf", files, "", ModelInfo(str(parsed), "unknown"), None, env)
    local = resolved.local
    if local is not None:
        resolved.info = inspect_model(local)
    elif "config.json" in lst.files:
        resolved.info = remote_hf_info(lst, env, [f for f in files if f.endswith(".safetensors")])
    return resolved


def _resolve_gguf(
    name: ModelName,
    lst: Listing,
    ggufs: list[GgufFile],
    env: HubEnv,
    hardware: Hardware | None,
    workload: Callable[[ModelInfo], Workload] | None,
) -> Resolved:
    try:
        first = pick_gguf(name.repo, ggufs, name.tag)  # raises QuantNotFound for a tag it lacks
    except QuantNotFound:
        if lst.cached_only:  # the cache lacks it, the hub may not
            raise NotCached(str(name), str(env.cache_dir)) from None
        raise
    base = _info(name, lst, first, env)
    wl = workload(base) if workload else Workload()
    choice = choose_gguf(name.repo, ggufs, base, hardware, wl, name.tag)
    chosen = choice.chosen
    if name.tag and any(o.file == chosen and o.fits is False for o in choice.options):
        hint = f"a smaller quantization or context may fit: `unillm select {name} --explain`"
        warn(f"{name}: {choice.why}; {hint}")
    info = base if chosen == first else _info(name, lst, chosen, env)
    return Resolved(name, lst, "gguf", list(chosen.parts), chosen.path, info, choice, env)


def _info(name: ModelName, lst: Listing, gguf: GgufFile, env: HubEnv) -> ModelInfo:
    """A GGUF's info: from the cache when its parts are there, else by range requests."""
    snapshot = env.cache_dir / ("models--" + name.repo.replace("/", "--")) / "snapshots" / lst.commit
    if all((snapshot / p).is_file() for p in gguf.parts):
        return inspect_model(snapshot / gguf.path)
    return remote_gguf_info(lst, gguf, env)
