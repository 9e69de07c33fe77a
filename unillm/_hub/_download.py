"""Files of a repo brought into the Hugging Face cache, checked, and resumable across processes.

The cache's layout is ``huggingface_hub``'s (``blobs/<etag>``, ``snapshots/<commit>/<path>``
linking to the blob, ``refs/<revision>``), so its tools and every engine's loader see the same
files. The transfer is unillm's own, for what ``huggingface_hub`` 2.4 does not do: the bytes go to
``blobs/<etag>.unillm-partial``, which outlives the process, so a later run resumes with a Range
request where the last one stopped; a finished file is checked against its size and, for an LFS
file, the sha256 the hub states (a small file: its git blob id) before it is moved into place. A
snapshot's link to a blob exists only once the blob is whole: nothing half-downloaded is loaded.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from unillm._errors import DiskFull, DownloadError, NotCached
from unillm._hub._client import COMMIT, HubEnv, Listing, _hf, mapped_errors, repo_dir
from unillm._hub._fit import human

__all__ = ["PARTIAL", "Progress", "fetch", "log_progress"]

PARTIAL = ".unillm-partial"
_CHUNK = 1 << 20
_log = logging.getLogger("unillm.hub")

#: Told of each file's progress: (path in the repo, bytes so far, total bytes)
Progress = Callable[[str, int, int], None]


def fetch(listing: Listing, paths: list[str], env: HubEnv, progress: Progress | None = None) -> Path:
    """Bring ``paths`` of the listing's commit into the cache; return the snapshot folder.

    What is already there is not fetched again; an earlier, cut-off download of a file resumes.
    Raises ``NotCached`` offline when a file is missing, ``DiskFull`` before a byte is written when
    the cache's disk has no room for what is missing, ``DownloadError`` for a transfer cut off
    (what arrived is kept) or a file that does not match its checksum (it is deleted).
    """
    folder = repo_dir(env, listing.name.repo)
    snapshot = folder / "snapshots" / listing.commit
    missing = [p for p in paths if not (snapshot / p).is_file()]
    if missing and (env.offline or listing.cached_only):
        raise NotCached(str(listing.name), str(env.cache_dir))
    if missing:
        hf = _hf()
        report = progress or default_progress()
        metas = {}
        with mapped_errors(listing.name, env):
            for p in missing:
                url = hf.hf_hub_url(listing.name.repo, p, revision=listing.commit, endpoint=env.endpoint)
                metas[p] = hf.get_hf_file_metadata(url, token=env.token or None)
        blobs = folder / "blobs"
        blobs.mkdir(parents=True, exist_ok=True)
        need = 0
        for meta in metas.values():
            blob = blobs / _etag(meta.etag)
            if not blob.is_file():
                partial = blob.with_name(blob.name + PARTIAL)
                need += (meta.size or 0) - (partial.stat().st_size if partial.is_file() else 0)
        free = shutil.disk_usage(blobs).free
        if need > free:
            raise DiskFull(str(listing.name), need, free, str(blobs))
        from huggingface_hub.utils import WeakFileLock

        for p in missing:
            meta = metas[p]
            blob = blobs / _etag(meta.etag)
            # huggingface_hub's own lock for this blob: another process (unillm's or the hub
            # library's) downloading it waits here, then finds it whole
            lock = env.cache_dir / ".locks" / folder.name / f"{blob.name}.lock"
            lock.parent.mkdir(parents=True, exist_ok=True)
            with WeakFileLock(lock):
                if not blob.is_file():
                    _transfer(listing, p, meta, blob, env, report)
            _link(blob, snapshot / p)
    revision = listing.name.revision or "main"
    if not listing.cached_only and not COMMIT.fullmatch(revision):
        refs = folder / "refs" / revision
        refs.parent.mkdir(parents=True, exist_ok=True)
        if not refs.is_file() or refs.read_text(encoding="utf-8").strip() != listing.commit:
            refs.write_text(listing.commit, encoding="utf-8")
    return snapshot


def _etag(etag: str | None) -> str:
    if not etag or "/" in etag or etag.startswith("."):
        raise DownloadError(f"the hub gave no usable ETag ({etag!r}) for a file: is HF_ENDPOINT a hub?")
    return etag


def _transfer(listing: Listing, path: str, meta: object, blob: Path, env: HubEnv, report: Progress) -> None:
    """One file into ``blob``, through its partial file, resumed where an earlier try stopped."""
    import httpx2
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    size: int = getattr(meta, "size", None) or listing.files.get(path, _NO_FILE).size
    location: str = getattr(meta, "location", "")
    partial = blob.with_name(blob.name + PARTIAL)
    have = partial.stat().st_size if partial.is_file() else 0
    if have > size:
        have = 0
    headers = build_hf_headers(token=env.token or None)
    headers["Accept-Encoding"] = "identity"
    if have:
        headers["Range"] = f"bytes={have}-"
        _log.info("resuming %s at %d of %d bytes", path, have, size)
    done = have
    if have == size:  # all of it arrived before: only the check is left
        _check(listing, path, partial, size, blob.name)
        os.replace(partial, blob)
        return
    try:
        with get_session().stream(
            "GET",
            location,
            headers=headers,
            follow_redirects=True,
            timeout=httpx2.Timeout(60.0, connect=10.0),
        ) as r:
            with mapped_errors(listing.name, env):
                hf_raise_for_status(r)
            if have and r.status_code != 206:  # the server sends it whole: start over
                done = 0
            with open(partial, "r+b" if partial.exists() else "wb") as f:
                f.seek(done)
                f.truncate()
                report(path, done, size)
                for chunk in r.iter_bytes():  # as it arrives: a cut keeps what came
                    f.write(chunk)
                    done += len(chunk)
                    report(path, done, size)
    except (httpx2.TransportError, ConnectionError, TimeoutError) as exc:
        raise DownloadError(
            f"the download of {path} from {listing.name.repo} was cut off after {done} of {size} bytes "
            f"({exc or type(exc).__name__}); what arrived is kept: run the same command again to resume"
        ) from exc
    except OSError as exc:
        if exc.errno == 28:  # ENOSPC: what arrived is kept for when there is room
            raise DiskFull(path, size - done, shutil.disk_usage(blob.parent).free, str(blob.parent)) from exc
        raise
    _check(listing, path, partial, size, blob.name)
    os.replace(partial, blob)


class _NoFile:
    size = 0


_NO_FILE = _NoFile()


def _check(listing: Listing, path: str, partial: Path, size: int, etag: str) -> None:
    """The finished file's size, and its sha256 (an LFS file) or git blob id (a small one)."""
    got = partial.stat().st_size
    if got != size:
        if got > size:
            partial.unlink()
        raise DownloadError(
            f"{path} from {listing.name.repo}: {got} bytes arrived of {size}; run the same command again"
        )
    stated = listing.files[path].sha256 if path in listing.files else None
    if stated is None and len(etag) == 64:
        stated = etag  # an LFS file's ETag is its sha256
    if stated is not None:
        digest, kind = hashlib.sha256(), "sha256"
    elif len(etag) == 40:
        digest, kind = hashlib.sha1(b"blob %d\0" % size), "git blob id"
        stated = etag
    else:
        return
    with open(partial, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    if digest.hexdigest() != stated:
        partial.unlink()
        raise DownloadError(
            f"{path} from {listing.name.repo} does not match its {kind} ({digest.hexdigest()}, the hub "
            f"states {stated}): it was deleted; run the same command again to download it afresh"
        )


def _link(blob: Path, link: Path) -> None:
    """``link`` pointing at ``blob`` (relative, as ``huggingface_hub`` links), or a copy where
    the filesystem has no links."""
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(link.name + PARTIAL)
    tmp.unlink(missing_ok=True)
    try:
        os.symlink(os.path.relpath(blob, link.parent), tmp)
    except OSError:
        shutil.copyfile(blob, tmp)
    os.replace(tmp, link)


def log_progress(path: str, done: int, total: int, _last: dict[str, int] = {}) -> None:  # noqa: B006
    """Progress as log lines (``unillm.hub``, INFO): the start, each tenth, the end."""
    tenth = 10 * done // total if total else 10
    if done == 0 or _last.get(path, -1) < tenth:
        _last[path] = tenth
        _log.info("%s: %s of %s (%d%%)", path, human(done), human(total), 10 * tenth)
    if done >= total:
        _last.pop(path, None)


def default_progress() -> Progress:
    """A bar per file on a terminal (stderr), else log lines."""
    isatty = getattr(sys.stderr, "isatty", None)
    if not (isatty and isatty()):
        return log_progress
    from huggingface_hub.utils import tqdm

    bars: dict[str, object] = {}

    def bar(path: str, done: int, total: int) -> None:
        b = bars.get(path)
        if b is None:
            b = bars[path] = tqdm(total=total, initial=done, unit="B", unit_scale=True, desc=path, leave=True)
        b.update(done - b.n)  # type: ignore[attr-defined]
        if done >= total:
            b.close()  # type: ignore[attr-defined]
            bars.pop(path, None)

    return bar
