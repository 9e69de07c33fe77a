"""A small Hugging Face Hub on loopback, for testing model names without a network.

    from unillm.testing import HubServer, tiny_hub

    with tiny_hub() as hub:                # the tiny model's repos (see ``tiny_hub``)
        env = hub.environ(cache_dir)       # HF_ENDPOINT, HF_HUB_CACHE, NO_PROXY, ...
        ...
        hub.served["unillm/tiny-gguf/tiny-small-Q8_0.gguf"]   # bytes sent of that file

It answers what ``huggingface_hub`` calls, the way the real hub does:

- ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}``: the repo's ``sha`` and its
  ``siblings``, each with its ``size`` (and ``lfs`` for large files);
- ``GET /api/models/{repo}/tree/{rev}[/{path}]`` (``?recursive=1``): the file entries;
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``: ``X-Repo-Commit``, ``ETag``, ``Content-Length``
  and ``Range`` (206); an LFS file (``.gguf``, ``.safetensors``) is a 302 to ``/lfs/{sha256}``
  on a second port (another origin, as the real hub redirects to its CDN, so ``huggingface_hub``
  reads the metadata from the redirect) with ``X-Linked-Etag`` (its sha256) and ``X-Linked-Size``;
- errors with ``X-Error-Code``: ``RepoNotFound`` (401 to an anonymous caller, 404 with a token,
  as the real hub hides private repos), ``RevisionNotFound``, ``EntryNotFound``, ``GatedRepo``.

It never sends ``xetHash`` nor ``X-Xet-*`` headers, so ``huggingface_hub`` downloads over plain
HTTP even with ``hf_xet`` installed. ``served`` counts the bytes of each file sent (keyed
``repo/path``); ``cut_after`` drops the connection after that many bytes of a whole-file GET of a file, once,
to simulate an interrupted download.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import socket
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

__all__ = ["HubRepo", "HubServer", "tiny_hub"]

_LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")


@dataclass
class _File:
    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def git_sha(self) -> str:  # what git names a blob: the etag of a small file
        return hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_sha


@dataclass
class HubRepo:
    """A model repo: its commits (each a ``{path: bytes}`` tree) and the branches and tags naming
    them. ``gated`` answers every file with ``GatedRepo``; ``private`` hides it as a missing repo."""

    commits: dict[str, dict[str, _File]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated: bool = False
    private: bool = False

    def add_commit(self, files: Mapping[str, bytes | Path], *, refs: tuple[str, ...] = ("main",)) -> str:
        """Add a commit holding ``files`` (bytes, or a file's path to read), named by ``refs``;
        returns its sha."""
        tree = {
            path: _File(
                data if isinstance(data, bytes) else Path(data).read_bytes(), path.endswith(_LFS_SUFFIXES)
            )
            for path, data in files.items()
        }
        digest = hashlib.sha1(repr(sorted((p, f.etag) for p, f in tree.items())).encode())
        sha = digest.hexdigest()
        self.commits[sha] = tree
        for ref in refs:
            self.refs[ref] = sha
        return sha

    def commit(self, rev: str) -> str | None:
        if rev in self.refs:
            return self.refs[rev]
        return rev if rev in self.commits else None


class HubServer:
    """The hub on ``127.0.0.1`` (a free port), serving ``repos`` from a thread; a context manager."""

    def __init__(self, repos: Mapping[str, HubRepo] | None = None) -> None:
        self.repos: dict[str, HubRepo] = dict(repos or {})
        self.served: Counter[str] = Counter()
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request
        self.cut_after: dict[str, int] = {}
        self._servers: list[ThreadingHTTPServer] = []  # the hub, then its "CDN"
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()  # open, kept alive: closed by stop()

    @property
    def url(self) -> str:
        assert self._servers, "start() the server first"
        return f"http://127.0.0.1:{self._servers[0].server_address[1]}"

    @property
    def cdn_url(self) -> str:
        return f"http://127.0.0.1:{self._servers[1].server_address[1]}"

    def environ(self, cache_dir: str | Path) -> dict[str, str]:
        """The environment that points ``huggingface_hub`` (and unillm) at this server and a cache."""
        return {
            "HF_ENDPOINT": self.url,
            "HF_HUB_CACHE": str(cache_dir),
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
            "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "HF_HUB_ETAG_TIMEOUT": "5",
            "HF_HUB_DOWNLOAD_TIMEOUT": "5",
        }

    def add(
        self, repo_id: str, files: Mapping[str, bytes | Path], *, gated: bool = False, private: bool = False
    ) -> HubRepo:
        """A repo ``repo_id`` with one commit of ``files`` on ``main``."""
        repo = self.repos.setdefault(repo_id, HubRepo(gated=gated, private=private))
        repo.add_commit(files)
        return repo

    def reset_counts(self) -> None:
        with self._lock:
            self.served.clear()
            self.requests.clear()

    def start(self) -> HubServer:
        hub = self

        class Handler(_Handler):
            server_hub = hub

        try:
            for name in ("unillm-hub", "unillm-hub-cdn"):
                server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
                server.daemon_threads = True
                self._servers.append(server)
                thread = threading.Thread(target=server.serve_forever, args=(0.05,), name=name, daemon=True)
                thread.start()
                self._threads.append(thread)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        with self._lock:  # a client's kept-alive connection would go on being served
            for conn in list(self._connections):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=10)
        self._servers, self._threads = [], []

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


_RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)")
_API = re.compile(
    r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+)|/tree/(?P<tree>[^/]+)(?:/(?P<sub>.*))?)?"
)


class _Error(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class _Handler(BaseHTTPRequestHandler):
    server_hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read ``requests``
        pass

    def setup(self) -> None:
        super().setup()
        with self.server_hub._lock:
            self.server_hub._connections.add(self.connection)

    def finish(self) -> None:
        with self.server_hub._lock:
            self.server_hub._connections.discard(self.connection)
        super().finish()

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _answer(self, head: bool) -> None:
        hub = self.server_hub
        path = unquote(urlsplit(self.path).path)
        with hub._lock:
            hub.requests.append((self.command, path))
        try:
            if path.startswith("/lfs/"):
                self._lfs(path.removeprefix("/lfs/"), head)
            elif m := _RESOLVE.fullmatch(path):
                self._resolve(m["repo"], m["rev"], m["path"], head)
            elif m := _API.fullmatch(path):
                self._api(m["repo"], m["rev"] or m["tree"] or "main", m["tree"] is not None, m["sub"] or "")
            else:
                raise _Error(404, "", f"no route for {path}")
        except _Error as exc:
            body = json.dumps({"error": exc.message}).encode()
            self.send_response(exc.status)
            if exc.code:
                self.send_header("X-Error-Code", exc.code)
            self.send_header("X-Error-Message", exc.message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

    def _repo(self, repo_id: str) -> HubRepo:
        repo = self.server_hub.repos.get(repo_id)
        if repo is None or repo.private:
            anonymous = "authorization" not in {k.lower() for k in self.headers}
            raise _Error(401 if anonymous else 404, "RepoNotFound", "Repository not found")
        return repo

    def _tree(self, repo: HubRepo, rev: str) -> tuple[str, dict[str, _File]]:
        sha = repo.commit(rev)
        if sha is None:
            raise _Error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return sha, repo.commits[sha]

    def _json(self, data: Any) -> None:
        body = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _api(self, repo_id: str, rev: str, tree: bool, sub: str) -> None:
        repo = self._repo(repo_id)
        sha, files = self._tree(repo, rev)
        entries = []
        for path, f in sorted(files.items()):
            entry: dict[str, Any] = {"type": "file", "oid": f.git_sha, "size": len(f.data), "path": path}
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": len(f.data), "pointerSize": 134}
            entries.append(entry)
        if tree:
            self._json([e for e in entries if e["path"].startswith(sub)])
            return
        siblings = [
            {"rfilename": e["path"], "size": e["size"], "blobId": e["oid"]}
            | (
                {"lfs": {"sha256": e["lfs"]["oid"], "size": e["size"], "pointerSize": 134}}
                if "lfs" in e
                else {}
            )
            for e in entries
        ]
        self._json(
            {
                "_id": sha[:24],
                "id": repo_id,
                "modelId": repo_id,
                "sha": sha,
                "private": repo.private,
                "gated": "manual" if repo.gated else False,
                "disabled": False,
                "tags": ["gguf"] if any(p.endswith(".gguf") for p in files) else [],
                "siblings": siblings,
            }
        )

    def _resolve(self, repo_id: str, rev: str, path: str, head: bool) -> None:
        repo = self._repo(repo_id)
        if repo.gated:
            raise _Error(401, "GatedRepo", f"Access to model {repo_id} is restricted")
        sha, files = self._tree(repo, rev)
        f = files.get(path)
        if f is None:
            raise _Error(404, "EntryNotFound", f"{path} does not exist on {rev}")
        if f.lfs:
            self.send_response(302)
            self.send_header("Location", f"{self.server_hub.cdn_url}/lfs/{f.sha256}?name={repo_id}/{path}")
            self.send_header("X-Repo-Commit", sha)
            self.send_header("ETag", f'"{f.git_sha}"')
            self.send_header("X-Linked-Etag", f'"{f.sha256}"')
            self.send_header("X-Linked-Size", str(len(f.data)))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._bytes(f, f"{repo_id}/{path}", head, {"X-Repo-Commit": sha, "ETag": f'"{f.git_sha}"'})

    def _lfs(self, rest: str, head: bool) -> None:
        digest = rest.split("?", maxsplit=1)[0]
        name = urlsplit(self.path).query.removeprefix("name=")
        for repo in self.server_hub.repos.values():
            for files in repo.commits.values():
                for f in files.values():
                    if f.lfs and f.sha256 == digest:
                        self._bytes(f, unquote(name), head, {"ETag": f'"{f.sha256}"'})
                        return
        raise _Error(404, "", "no such object")

    def _bytes(self, f: _File, key: str, head: bool, headers: dict[str, str]) -> None:
        hub = self.server_hub
        size = len(f.data)
        start, end = 0, size - 1
        ranged = self.headers.get("Range")
        if ranged and (m := re.fullmatch(r"bytes=(\d*)-(\d*)", ranged.strip())):
            if m[1]:
                start, end = int(m[1]), min(int(m[2]) if m[2] else size - 1, size - 1)
            else:  # the last N bytes
                start = max(size - int(m[2]), 0)
            if start >= size:
                raise _Error(416, "", "range not satisfiable")
        body = f.data[start : end + 1]
        self.send_response(206 if ranged else 200)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Accept-Ranges", "bytes")
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if head:
            return
        with hub._lock:  # a whole-file GET is cut, not a range read (a header, a resume)
            cut = None if ranged else hub.cut_after.pop(key, None)
        # counted before it is sent: a client may read the count as soon as it has the bytes
        if cut is not None:  # send part of it, then drop the connection
            with hub._lock:
                hub.served[key] += min(cut, len(body))
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        with hub._lock:
            hub.served[key] += len(body)
        self.wfile.write(body)


def tiny_hub(cache_dir: str | Path | None = None) -> HubServer:
    """A ``HubServer`` (not started) holding the tiny model's repos:

    - ``unillm/tiny-gguf``: its GGUF in f32, f16, Q8_0 and Q4_0 (``tiny-small-<quant>.gguf``),
      ``README.md``; a second commit on the ``v1`` tag holds the f32 file only;
    - ``unillm/tiny-gguf-split``: a Q8_0 split in three parts and an f16 file;
    - ``unillm/tiny``: the HF directory (config.json, model.safetensors, tokenizer files);
    - ``unillm/gated``: a gated copy of ``unillm/tiny-gguf``'s f32 file; ``unillm/private``: hidden.
    """
    from unillm.testing._tiny import tiny_gguf, tiny_model

    model = tiny_model("small", cache_dir)
    quants = {
        f"tiny-small-{q}.gguf": tiny_gguf(q, cache_dir=cache_dir)[0] for q in ("f32", "f16", "Q8_0", "Q4_0")
    }
    readme = b"# tiny\nA tiny random-weight Llama for tests.\n"
    hub = HubServer()
    gguf_repo = HubRepo()
    gguf_repo.add_commit(
        {"README.md": readme, "tiny-small-f32.gguf": quants["tiny-small-f32.gguf"]}, refs=("v1",)
    )
    gguf_repo.add_commit({"README.md": readme, **quants})
    hub.repos["unillm/tiny-gguf"] = gguf_repo
    split = {p.name: p for p in tiny_gguf("Q8_0", split=8, cache_dir=cache_dir)}
    hub.add("unillm/tiny-gguf-split", {**split, "tiny-small-f16.gguf": quants["tiny-small-f16.gguf"]})
    hub.add("unillm/tiny", {p.name: p for p in sorted(model.hf_dir.iterdir()) if p.is_file()})
    hub.add("unillm/gated", {"tiny-small-f32.gguf": quants["tiny-small-f32.gguf"]}, gated=True)
    hub.add("unillm/private", {"tiny-small-f32.gguf": quants["tiny-small-f32.gguf"]}, private=True)
    return hub
