"""The hub as unillm talks to it: the environment read at each call, a repo's file list at a
revision (from the hub, or from the cache alone when offline), and the hub's errors as unillm's.

``huggingface_hub`` reads ``HF_ENDPOINT``, ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` once, when it is
imported; unillm reads them when a name is resolved and passes them on, so a process that changes
them (a test, a server reloading its config) is honoured. It is imported here only on use.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unillm._errors import (
    DownloadError,
    GatedModel,
    ModelNotFound,
    NotCached,
    RepoNotFound,
    RevisionNotFound,
)
from unillm._names import ModelName

__all__ = ["HubEnv", "Listing", "RemoteFile", "hub_env", "listing", "mapped_errors", "repo_dir"]

_DEFAULT_ENDPOINT = "https://huggingface.co"
COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class HubEnv:
    """Where the hub and the cache are, read from the environment when a name is resolved."""

    endpoint: str
    cache_dir: Path
    offline: bool
    token: str | None


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def hub_env() -> HubEnv:
    """``HF_ENDPOINT``, ``HF_HUB_CACHE`` (else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``),
    ``HF_HUB_OFFLINE`` and ``HF_TOKEN``, as ``huggingface_hub`` reads them, but now."""
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    cache = (
        os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    )
    return HubEnv(
        endpoint=(os.environ.get("HF_ENDPOINT") or _DEFAULT_ENDPOINT).rstrip("/"),
        cache_dir=Path(os.path.expandvars(os.path.expanduser(cache))),
        offline=_truthy(os.environ.get("HF_HUB_OFFLINE")),
        token=os.environ.get("HF_TOKEN") or None,
    )


def repo_dir(env: HubEnv, repo: str) -> Path:
    """The repo's folder in the cache (``models--org--name``), ``huggingface_hub``'s layout."""
    return env.cache_dir / ("models--" + repo.replace("/", "--"))


@dataclass(frozen=True)
class RemoteFile:
    """A file of a repo: its size and, for an LFS file, the sha256 the hub states."""

    size: int
    sha256: str | None = None


@dataclass
class Listing:
    """A repo at one commit: its files, and whether the list came from the cache alone."""

    name: ModelName
    commit: str
    files: dict[str, RemoteFile] = field(default_factory=dict)
    cached_only: bool = False

    @property
    def sizes(self) -> dict[str, int]:
        return {p: f.size for p, f in self.files.items()}


def _hf() -> Any:
    """``huggingface_hub``, imported on first use, told the offline mode the environment says now."""
    try:
        import huggingface_hub
        from huggingface_hub import constants
    except ImportError:
        raise DownloadError(
            "models by name need huggingface_hub: pip install 'unillm[hub]' (or pass a local path)"
        ) from None
    major = huggingface_hub.__version__.split(".")[0]
    if not major.isdigit() or int(major) < 2:
        raise DownloadError(
            f"models by name need huggingface_hub 2.4 or later, not {huggingface_hub.__version__}: "
            "pip install -U 'unillm[hub]'"
        )
    constants.HF_HUB_OFFLINE = _truthy(os.environ.get("HF_HUB_OFFLINE"))
    return huggingface_hub


@contextlib.contextmanager
def mapped_errors(name: ModelName, env: HubEnv) -> Iterator[None]:
    """The hub's errors as unillm's, branching on ``huggingface_hub``'s exception types (the hub
    answers a missing repo with 401 to an anonymous caller, 404 with a token)."""
    from huggingface_hub import errors

    try:
        yield
    except errors.GatedRepoError as exc:
        raise GatedModel(name.repo, env.endpoint) from exc
    except errors.RepositoryNotFoundError as exc:
        raise RepoNotFound(name.repo, env.endpoint) from exc
    except errors.RevisionNotFoundError as exc:
        raise RevisionNotFound(name.repo, name.revision or "main") from exc
    except errors.RemoteEntryNotFoundError as exc:
        raise ModelNotFound(f"{name}: {exc}") from exc
    except errors.OfflineModeIsEnabled as exc:
        raise NotCached(str(name), str(env.cache_dir)) from exc
    except errors.HfHubHTTPError as exc:
        raise DownloadError(f"the hub at {env.endpoint} refused {str(name)!r}: {_first_line(exc)}") from exc
    except Exception as exc:
        if not _unreachable(exc):
            raise
        raise DownloadError(
            f"cannot reach the hub at {env.endpoint} ({_first_line(exc)}): check the network, or HF_ENDPOINT"
        ) from exc


def _timeout() -> float:
    """Seconds to wait for the hub's API (``HF_HUB_ETAG_TIMEOUT``, as ``huggingface_hub``'s HEADs)."""
    try:
        return float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or 10)
    except ValueError:
        return 10.0


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _unreachable(exc: BaseException) -> bool:
    import httpx2

    return isinstance(exc, (httpx2.TransportError, ConnectionError, TimeoutError))


def listing(name: ModelName, env: HubEnv) -> Listing:
    """The files of ``name``'s repo at its revision. Online: the hub's list (one API call; sizes
    and LFS checksums). Offline, or with the hub unreachable: what the cache holds of that
    revision, without a network call; ``NotCached`` when it holds nothing."""
    if not env.offline:
        hf = _hf()
        api = hf.HfApi(endpoint=env.endpoint, token=env.token or None)
        try:
            with mapped_errors(name, env):
                info = api.model_info(
                    name.repo, revision=name.revision, files_metadata=True, timeout=_timeout()
                )
        except DownloadError as exc:  # the hub cannot be reached: what the cache holds will do
            cause = exc.__cause__
            if cause is None or not _unreachable(cause):
                raise
            cached = cached_listing(name, env)
            if cached is None:
                why = f"the hub at {env.endpoint} cannot be reached ({_first_line(cause)}: check the network)"
                raise NotCached(str(name), str(env.cache_dir), why) from cause
            return cached
        files = {}
        for s in info.siblings or []:
            lfs = getattr(s, "lfs", None)
            files[_safe(s.rfilename, env)] = RemoteFile(
                int(s.size or 0), getattr(lfs, "sha256", None) if lfs else None
            )
        commit = str(info.sha)
        if not COMMIT.fullmatch(commit):
            raise DownloadError(
                f"the hub at {env.endpoint} named {name.repo}'s commit {commit[:80]!r}: not a commit id"
            )
        return Listing(name, commit, files)
    cached = cached_listing(name, env)
    if cached is None:
        raise NotCached(str(name), str(env.cache_dir))
    return cached


def _safe(path: str, env: HubEnv) -> str:
    """A repo path as the hub listed it, refused when it would land outside the snapshot folder
    (the listing is the endpoint's word, and ``HF_ENDPOINT`` may name any server)."""
    parts = path.split("/")
    if (
        not path
        or path.startswith("/")
        or "\\" in path
        or any(p in ("", ".", "..") for p in parts)
        or "\0" in path
    ):
        raise DownloadError(
            f"the hub at {env.endpoint} listed a file path unillm will not write: {path[:200]!r}"
        )
    return path


def cached_listing(name: ModelName, env: HubEnv) -> Listing | None:
    """What the cache holds of ``name``'s revision (its ``refs/`` or a commit named outright), or
    None; no network call."""
    folder = repo_dir(env, name.repo)
    revision = name.revision or "main"
    commit: str | None = None
    ref = folder / "refs" / revision
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
    elif COMMIT.fullmatch(revision):
        commit = revision
    if commit is None:
        return None
    snapshot = folder / "snapshots" / commit
    if not snapshot.is_dir():
        return None
    files = {}
    for p in sorted(snapshot.rglob("*")):
        if p.is_file():  # a link to a blob that is there
            files[p.relative_to(snapshot).as_posix()] = RemoteFile(p.stat().st_size)
    return Listing(name, commit, files, cached_only=True) if files else None
