"""Models by name: the loopback hub (``unillm.testing.tiny_hub``) and real ``huggingface_hub``
against it, no mocks. One hub serves the whole module; each test gets its own HF cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from unillm.testing import HubServer, tiny_hub

pytest.importorskip("huggingface_hub")


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    server = tiny_hub(tmp_path_factory.mktemp("tiny-for-hub")).start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            for key, value in server.environ(tmp_path_factory.mktemp("hf-unused")).items():
                mp.setenv(key, value)
            mp.delenv("HF_HUB_OFFLINE", raising=False)
            mp.delenv("HF_TOKEN", raising=False)
            mp.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf-home")))
            yield server
    finally:
        server.stop()


@pytest.fixture
def cache(hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty HF cache for one test (``HF_HUB_CACHE``), and the hub's counts reset."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    hub.reset_counts()
    return tmp_path / "hf"


# ---- the hub itself, as huggingface_hub sees it ----


def test_the_hub_answers_huggingface_hub(hub: HubServer, cache: Path) -> None:
    import huggingface_hub as hf
    from huggingface_hub.errors import (
        GatedRepoError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    api = hf.HfApi(endpoint=hub.url, token=False)
    info = api.model_info("unillm/tiny-gguf", files_metadata=True)
    sizes = {s.rfilename: s.size for s in info.siblings or []}
    assert sizes["tiny-small-f32.gguf"] > sizes["tiny-small-f16.gguf"] > sizes["tiny-small-Q8_0.gguf"]
    tree = [e.path for e in api.list_repo_tree("unillm/tiny-gguf", recursive=True)]
    assert "tiny-small-Q4_0.gguf" in tree
    path = hf.hf_hub_download(
        "unillm/tiny-gguf", "tiny-small-Q8_0.gguf", cache_dir=cache, endpoint=hub.url, token=False
    )
    assert Path(path).stat().st_size == sizes["tiny-small-Q8_0.gguf"]
    assert hub.served["unillm/tiny-gguf/tiny-small-Q8_0.gguf"] == sizes["tiny-small-Q8_0.gguf"]
    meta = hf.get_hf_file_metadata(
        hf.hf_hub_url("unillm/tiny-gguf", "tiny-small-f16.gguf", endpoint=hub.url), token=False
    )
    assert meta.location.startswith(hub.cdn_url) and meta.size == sizes["tiny-small-f16.gguf"]
    assert meta.etag == next(
        s.lfs.sha256 for s in info.siblings or [] if s.rfilename == "tiny-small-f16.gguf"
    )
    v1 = hf.hf_hub_download(
        "unillm/tiny-gguf", "README.md", revision="v1", cache_dir=cache, endpoint=hub.url, token=False
    )
    assert info.sha not in v1
    for repo, error in [("unillm/nope", RepositoryNotFoundError), ("unillm/private", RepositoryNotFoundError),
                        ("unillm/gated", GatedRepoError)]:  # fmt: skip
        with pytest.raises(error):
            hf.hf_hub_download(repo, "tiny-small-f32.gguf", cache_dir=cache, endpoint=hub.url, token=False)
    with pytest.raises(RemoteEntryNotFoundError):
        hf.hf_hub_download("unillm/tiny-gguf", "nope.gguf", cache_dir=cache, endpoint=hub.url, token=False)
    with pytest.raises(RevisionNotFoundError):
        api.model_info("unillm/tiny-gguf", revision="nope")
    assert not any("xet" in k.lower() for k in hub.served)


def test_a_range_read_is_served_as_206(hub: HubServer, cache: Path) -> None:
    import httpx

    url = f"{hub.url}/unillm/tiny/resolve/main/config.json"
    r = httpx.get(url, headers={"Range": "bytes=0-9"})
    assert r.status_code == 206 and len(r.content) == 10 and r.headers["X-Repo-Commit"]
    r = httpx.get(
        f"{hub.url}/unillm/tiny-gguf/resolve/main/tiny-small-f32.gguf", headers={"Range": "bytes=0-3"}
    )
    assert r.status_code == 302 and r.headers["X-Linked-Size"]
    r = httpx.get(r.headers["Location"], headers={"Range": "bytes=0-3"})
    assert r.status_code == 206 and r.content == b"GGUF"
    assert hub.served["unillm/tiny-gguf/tiny-small-f32.gguf"] == 4
