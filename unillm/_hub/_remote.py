"""What a model on the hub is, read before its weights are fetched: the file list and sizes (the
listing), ``config.json`` (a few kB, kept in the cache), and each GGUF part's or safetensors
file's header through HTTP range requests, parsed by inspection's own readers with their caps
and checks.
"""

from __future__ import annotations

from typing import Any, BinaryIO, cast

from unillm._errors import ModelFormatError
from unillm._hub._client import HubEnv, Listing, _hf, mapped_errors
from unillm._hub._files import GgufFile
from unillm._inspect import (
    ModelInfo,
    gguf_info,
    hf_info,
    lazy_enough,
    read_gguf_stream,
    read_safetensors_stream,
)

__all__ = ["RangeFile", "remote_gguf_info", "remote_hf_info"]

_MAX_CONFIG = 16 << 20
_MAX_SHARDS = 256  # a few hundred range requests at most; past that, the listed sizes


class RangeFile:
    """A file on the hub as a read-only binary stream: each ``read`` is one range request at the
    current position (inspection reads headers in growing blocks, so a header costs a few)."""

    def __init__(self, url: str, size: int, headers: dict[str, str]) -> None:
        self.url, self.size, self.headers = url, size, headers
        self.pos = 0
        self.requests = 0

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        from huggingface_hub.utils import get_session, hf_raise_for_status

        end = self.size if n < 0 else min(self.pos + n, self.size)
        if end <= self.pos:
            return b""
        r = get_session().get(
            self.url, headers={**self.headers, "Range": f"bytes={self.pos}-{end - 1}"}, follow_redirects=True
        )
        hf_raise_for_status(r)
        self.requests += 1
        data = r.content if r.status_code == 206 else r.content[self.pos : end]
        self.pos += len(data)
        return data


def _headers(env: HubEnv) -> dict[str, str]:
    from huggingface_hub.utils import build_hf_headers

    return {**build_hf_headers(token=env.token or None), "Accept-Encoding": "identity"}


def remote_gguf_info(listing: Listing, gguf: GgufFile, env: HubEnv) -> ModelInfo:
    """The ``ModelInfo`` of ``gguf`` on the hub, from its parts' headers read by range; its path
    is ``org/name/file.gguf`` (nothing is on disk yet)."""
    hf = _hf()
    headers = []
    with mapped_errors(listing.name, env):
        for part in gguf.parts:
            url = hf.hf_hub_url(listing.name.repo, part, revision=listing.commit, endpoint=env.endpoint)
            meta = hf.get_hf_file_metadata(url, token=env.token or None)
            f = RangeFile(meta.location, meta.size or listing.files[part].size, _headers(env))
            shown = f"{listing.name.repo}/{part}"
            stream = cast(BinaryIO, f)  # what the reader uses of a file: read, seek
            h = read_gguf_stream(stream, shown, f.size, lazy=True)
            if not lazy_enough(h):  # the shape keys come after the vocabulary: read it all
                f.seek(0)
                h = read_gguf_stream(stream, shown, f.size)
            headers.append(h)
    parts = [f"{listing.name.repo}/{p}" for p in gguf.parts]
    return gguf_info(parts[0], parts, headers)


def remote_hf_info(listing: Listing, env: HubEnv, weights: list[str]) -> ModelInfo:
    """The ``ModelInfo`` of an HF-format repo from its ``config.json`` (fetched into the cache:
    a few kB) and the listed sizes of its ``weights``."""
    import json

    hf = _hf()
    with mapped_errors(listing.name, env):
        path = hf.hf_hub_download(
            listing.name.repo,
            "config.json",
            revision=listing.commit,
            cache_dir=env.cache_dir,
            endpoint=env.endpoint,
            token=env.token or None,
        )
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_CONFIG + 1)
        config: Any = json.loads(raw) if len(raw) <= _MAX_CONFIG else None
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{listing.name.repo}'s config.json cannot be read: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelFormatError(f"{listing.name.repo}'s config.json is not a JSON object of at most 16 MiB")
    size = sum(listing.files[w].size for w in weights) or None
    return hf_info(str(listing.name), config, size, _safetensors_headers(listing, env, weights))


def _safetensors_headers(listing: Listing, env: HubEnv, weights: list[str]) -> dict[str, list[Any]] | None:
    """Each safetensors file's header, by two range requests (its length, then the JSON); None
    past ``_MAX_SHARDS`` files, where the listed sizes do."""
    if len(weights) > 1:  # Mistral repos ship the same weights twice
        weights = [w for w in weights if not w.rsplit("/", 1)[-1].startswith("consolidated")] or weights
    if not weights or len(weights) > _MAX_SHARDS:
        return None
    hf = _hf()
    out = {}
    with mapped_errors(listing.name, env):
        for w in weights:
            url = hf.hf_hub_url(listing.name.repo, w, revision=listing.commit, endpoint=env.endpoint)
            meta = hf.get_hf_file_metadata(url, token=env.token or None)
            f = RangeFile(meta.location, meta.size or listing.files[w].size, _headers(env))
            out[w] = read_safetensors_stream(cast(BinaryIO, f), f"{listing.name.repo}/{w}", f.size)
    return out
