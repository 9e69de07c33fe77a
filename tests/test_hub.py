"""Models by name: the loopback hub (``unillm.testing.tiny_hub``) and real ``huggingface_hub``
against it, no mocks. One hub serves the whole module; each test gets its own HF cache."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import unillm
from unillm import (
    Availability,
    DiskFull,
    DownloadError,
    EngineConfig,
    GatedModel,
    ModelNotFound,
    NotCached,
    QuantNotFound,
    RepoNotFound,
    RevisionNotFound,
    SamplingParams,
)
from unillm.testing import SIZES, HubServer, tiny_hub

from .conftest import HAS_LLAMA_CPP, needs_llama_cpp

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


# ---- names, tags and the default rule: pure functions ----


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("Qwen/Qwen2.5-0.5B-Instruct-GGUF", ("Qwen/Qwen2.5-0.5B-Instruct-GGUF", None, None)),
        ("org/name@v1.0", ("org/name", "v1.0", None)),
        ("org/name:q4_k_m", ("org/name", None, "q4_k_m")),
        ("org/name@main:Q8_0", ("org/name", "main", "Q8_0")),
        ("models/llama.gguf", None),  # a missing path, not a repo
        ("./org/name", None),
        ("/abs/path", None),
        ("just-a-name", None),
        ("a--b/c", None),
    ],
)
def test_a_name_is_parsed(text: str, want: tuple[str, str | None, str | None] | None) -> None:
    from unillm._names import ModelName, parse_model_name

    assert parse_model_name(text) == (ModelName(*want) if want else None)


def test_an_existing_path_is_never_a_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from unillm._names import parse_model_name

    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert parse_model_name("org/name") is None and parse_model_name("org/other") is not None


@pytest.mark.parametrize(
    ("names", "tag", "want"),
    [
        (["m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-F16.gguf"], None, "m-Q4_K_M.gguf"),  # llama.cpp's default
        (["m-F16.gguf", "m-Q8_0.gguf", "m-Q2_K.gguf"], None, "m-Q8_0.gguf"),  # else Q8_0
        (["m-F16.gguf", "m-Q2_K.gguf"], None, "m-F16.gguf"),  # else the first
        (["m-Q8_0.gguf", "m-Q4_K_M.gguf"], "q8_0", "m-Q8_0.gguf"),  # a tag, any case
        (["m.Q4_K_S.gguf", "m.Q4_K_M.gguf"], "Q4_K_S", "m.Q4_K_S.gguf"),
        (["m-IQ4_XS.gguf", "m-UD-Q4_K_XL.gguf"], "ud-q4_k_xl", "m-UD-Q4_K_XL.gguf"),
        (["a/m-Q8_0-00001-of-00002.gguf", "a/m-Q8_0-00002-of-00002.gguf", "m-F16.gguf"], "Q8_0",
         "a/m-Q8_0-00001-of-00002.gguf"),
        (["mmproj-F16.gguf", "m-F16.gguf"], None, "m-F16.gguf"),  # a vision projector is no model
    ],
)  # fmt: skip
def test_the_tag_and_the_default_rule(names: list[str], tag: str | None, want: str) -> None:
    from unillm._hub._files import gguf_files, pick_gguf

    assert pick_gguf("o/m", gguf_files(dict.fromkeys(names, 1)), tag).path == want


def test_split_parts_count_as_one_file_and_an_incomplete_set_as_none() -> None:
    from unillm._hub._files import gguf_files

    parts = {f"m-Q8_0-0000{i}-of-00003.gguf": 10 for i in (1, 2, 3)}
    (one,) = gguf_files(parts)
    assert one.parts == tuple(sorted(parts)) and one.size == 30 and one.quant == "Q8_0"
    assert gguf_files({"m-Q8_0-00001-of-00003.gguf": 10, "m-Q8_0-00003-of-00003.gguf": 10}) == []


def test_a_missing_tag_lists_the_tags_the_repo_has() -> None:
    from unillm import ModelNotFound, QuantNotFound
    from unillm._hub._files import gguf_files, pick_gguf

    with pytest.raises(QuantNotFound) as info:
        pick_gguf("o/m", gguf_files(dict.fromkeys(["m-Q8_0.gguf", "m-F16.gguf"], 1)), "Q5_K_M")
    assert info.value.tags == ["F16", "Q8_0"] and "o/m:F16" in str(info.value)
    assert isinstance(info.value, ModelNotFound)


# ---- the quantization that fits: three machines, as profiles ----

PROFILES = Path(__file__).parent / "profiles"


@pytest.mark.parametrize(
    ("profile", "want"),
    [("laptop-8gb-cpu", "Q4_K_M"), ("rtx4090-1x", "F16"), ("m3-ultra-192gb", "F32")],
)
def test_the_fit_choice_takes_the_highest_precision_that_fits(profile: str, want: str) -> None:
    from unillm._hardware import load_hardware
    from unillm._hub._files import GgufFile
    from unillm._hub._fit import choose_gguf
    from unillm._inspect import ModelInfo
    from unillm._plan._estimate import Workload

    base = ModelInfo(
        path="o/m", format="gguf", architecture="llama", quantization="Q4_K_M", parameters=8_030_000_000,
        layers=32, hidden_size=4096, heads=32, kv_heads=8, head_dim=128, context_length=131072,
        vocab_size=128256,
    )  # fmt: skip
    files = [
        GgufFile(("m-Q4_K_M.gguf",), 4_920_000_000, "Q4_K_M"),
        GgufFile(("m-Q8_0.gguf",), 8_540_000_000, "Q8_0"),
        GgufFile(("m-F16.gguf",), 16_070_000_000, "F16"),
        GgufFile(("m-F32.gguf",), 32_100_000_000, "F32"),
    ]
    hw = load_hardware(PROFILES / f"{profile}.json")
    choice = choose_gguf("o/m", files, base, hw, Workload(context_length=8192))
    assert choice.chosen.quant == want
    lines = choice.lines()
    assert [line[2:].split()[0] for line in lines[:4]] == ["F32", "F16", "Q8_0", "Q4_K_M"]  # each weighed
    assert sum(line.startswith("*") for line in lines) == 1 and "GiB" in lines[0]
    tagged = choose_gguf("o/m", files, base, hw, Workload(context_length=8192), tag="f32")
    assert tagged.chosen.quant == "F32" and ("NOT fit" in tagged.why) == (want != "F32")


# ---- against the hub: download, load, generate ----


def _data(hub: HubServer, repo: str, path: str) -> bytes:
    r = hub.repos[repo]
    return r.commits[r.refs["main"]][path].data


@needs_llama_cpp
def test_a_name_is_downloaded_loaded_and_run(hub: HubServer, cache: Path) -> None:
    from unillm import auto_engine

    key = "unillm/tiny-gguf/tiny-small-Q8_0.gguf"
    size = len(_data(hub, "unillm/tiny-gguf", "tiny-small-Q8_0.gguf"))
    with auto_engine("unillm/tiny-gguf:Q8_0", context_length=256) as engine:
        first = engine.generate("Hello", SamplingParams(max_tokens=4, temperature=0)).token_ids
        explained = engine.selection.explain()
        local = Path(engine.config.model)
    assert (
        local.is_relative_to(cache)
        and local.name == "tiny-small-Q8_0.gguf"
        and engine.facts.model.quantization == "Q8_0"
    )
    assert size <= hub.served[key] <= size + (1 << 17)  # the file, and its header read before
    assert [k for k in hub.served if k != key] == []  # no other quantization moved
    assert "Q8_0 was asked for" in explained and "unillm/tiny-gguf:Q8_0" in explained
    hub.reset_counts()
    with auto_engine("unillm/tiny-gguf:q8_0", context_length=256) as engine:  # cached: nothing moves
        assert engine.generate("Hello", SamplingParams(max_tokens=4, temperature=0)).token_ids == first
    assert hub.served == {}


@needs_llama_cpp
def test_a_split_gguf_is_fetched_and_loaded_together(hub: HubServer, cache: Path) -> None:
    from unillm import auto_engine

    with auto_engine("unillm/tiny-gguf-split:q8_0", context_length=256) as engine:
        assert engine.generate("Hi", SamplingParams(max_tokens=2, temperature=0)).token_ids
        assert len(engine.facts.model.files) == 3
    parts = [k for k in hub.served if "-of-00003" in k]
    assert len(parts) == 3 and not any(k.endswith("f16.gguf") for k in hub.served)
    for k in parts:
        assert hub.served[k] >= len(_data(hub, "unillm/tiny-gguf-split", k.rsplit("/", 1)[1]))


def test_a_revision_names_a_branch_tag_or_commit(hub: HubServer, cache: Path) -> None:
    from unillm._hub import resolve

    v1 = hub.repos["unillm/tiny-gguf"].refs["v1"]
    r = resolve("unillm/tiny-gguf@v1")
    assert r.listing.commit == v1 and r.files == ["tiny-small-f32.gguf"]
    path = r.fetch()
    assert v1 in str(path) and (cache / "models--unillm--tiny-gguf" / "refs" / "v1").read_text() == v1
    assert resolve(f"unillm/tiny-gguf@{v1}").local == path
    with pytest.raises(RevisionNotFound, match="has no revision 'nope'"):
        resolve("unillm/tiny-gguf@nope")
    assert resolve("unillm/tiny-gguf@v1:F32").files == ["tiny-small-f32.gguf"]
    with pytest.raises(QuantNotFound, match="Its quantizations: F32"):
        resolve("unillm/tiny-gguf@v1:Q8_0")  # on main, not at v1


def test_offline_the_cache_serves_with_no_network_call(
    hub: HubServer, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from unillm._choose._auto import model_info
    from unillm._hub import resolve

    own = HubServer({"unillm/tiny-gguf": hub.repos["unillm/tiny-gguf"]}).start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", own.url)
        path = resolve("unillm/tiny-gguf:Q4_0").fetch()
    finally:
        own.stop()  # the hub is gone from here on
    asked = len(own.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = resolve("unillm/tiny-gguf")  # no tag: chosen among what is cached
    assert r.local == path and r.files == ["tiny-small-Q4_0.gguf"]
    assert model_info(EngineConfig(model="unillm/tiny-gguf:q4_0")).quantization == "Q4_0"
    with pytest.raises(NotCached, match="unillm pull unillm/tiny-gguf:F16"):
        resolve("unillm/tiny-gguf:F16")
    with pytest.raises(NotCached, match="unillm pull unillm/tiny"):
        resolve("unillm/tiny")
    monkeypatch.delenv("HF_HUB_OFFLINE")  # online, but the hub cannot be reached: the cache again
    assert resolve("unillm/tiny-gguf:Q4_0").local == path
    assert len(own.requests) == asked


def test_select_and_inspect_read_headers_only(hub: HubServer, cache: Path) -> None:
    from unillm._choose._auto import choose, model_info
    from unillm._hardware import load_hardware

    hw = load_hardware(PROFILES / "laptop-8gb-cpu.json")
    selection = choose(EngineConfig(model="unillm/tiny-gguf", context_length=512), hardware=hw).selection
    text = selection.explain()
    assert "quantizations" in text and "* F32" in text and "the highest precision that fits" in text
    for key, sent in hub.served.items():  # a header or two, never a whole file
        assert sent < len(_data(hub, "unillm/tiny-gguf", key.rsplit("/", 1)[1])) / 2, key
    # unillm.inspect_model takes a name from Python as `unillm inspect` does (model_info)
    assert unillm.inspect_model("unillm/tiny-gguf:F16").quantization == "F16"
    info = unillm.inspect_model("unillm/tiny")  # config.json, then the safetensors header
    assert info == model_info(EngineConfig(model="unillm/tiny"))
    weights = len(_data(hub, "unillm/tiny", "model.safetensors"))
    assert info.layers == 2 and info.weights_bytes < weights and info.parameters == SIZES["small"].n_params
    assert info.quantization == "f32" and not info.estimated
    assert (
        8 < hub.served["unillm/tiny/model.safetensors"] < weights / 100
        and "unillm/tiny/config.json" in hub.served
    )
    assert not list(cache.rglob("*.gguf")) and not list(cache.rglob("*.safetensors"))


def test_an_hf_format_repo_is_fetched_whole(hub: HubServer, cache: Path) -> None:
    from unillm._hub import resolve

    path = resolve("unillm/tiny").fetch()
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in path.iterdir()}
    assert (path / "model.safetensors").read_bytes() == _data(hub, "unillm/tiny", "model.safetensors")


@pytest.mark.parametrize(
    ("name", "error", "says"),
    [
        ("unillm/nope", RepoNotFound, "HF_TOKEN"),
        ("unillm/private", RepoNotFound, "private repo needs a token"),
        ("unillm/gated", GatedModel, "accept its terms"),
        ("unillm/tiny-gguf@nope", RevisionNotFound, "@main"),
        ("unillm/tiny-gguf:Q5_K_M", QuantNotFound, "Its quantizations: Q4_0, Q8_0, F16, F32"),
    ],
)
def test_hub_errors_are_typed_and_say_what_to_do(
    hub: HubServer, cache: Path, name: str, error: type, says: str
) -> None:
    from unillm._hub import resolve

    with pytest.raises(error, match=says) as info:
        resolve(name)
    assert isinstance(info.value, (ModelNotFound, GatedModel))


def test_a_private_repo_is_not_found_with_a_token_too(
    hub: HubServer, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from unillm._hub import resolve

    monkeypatch.setenv("HF_TOKEN", "hf_test")
    with pytest.raises(RepoNotFound):
        resolve("unillm/private")  # the hub answers 404 with a token, 401 without


# ---- integrity, resume, a full disk ----


def test_an_interrupted_download_resumes_in_a_later_process(hub: HubServer, cache: Path) -> None:
    from unillm._hub import resolve

    key, data = "unillm/tiny-gguf/tiny-small-f16.gguf", _data(hub, "unillm/tiny-gguf", "tiny-small-f16.gguf")
    r = resolve("unillm/tiny-gguf:f16")
    hub.cut_after[key] = 300_000
    before = hub.served[key]
    with pytest.raises(DownloadError, match="run the same command again to resume"):
        r.fetch()
    (partial,) = cache.rglob("*.unillm-partial")
    assert partial.stat().st_size == 300_000 and r.local is None  # nothing half-downloaded is loadable
    before = hub.served[key]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    proc = subprocess.run(
        [sys.executable, "-m", "unillm", "pull", "unillm/tiny-gguf:f16"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "resuming tiny-small-f16.gguf at 300000" in proc.stderr
    path = Path(proc.stdout.strip().splitlines()[-1])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest()
    header_read = 1 << 16
    assert hub.served[key] - before <= len(data) - 300_000 + header_read
    assert not list(cache.rglob("*.unillm-partial"))


def test_a_file_that_does_not_match_its_sha256_is_deleted(hub: HubServer, cache: Path) -> None:
    from unillm._hub import resolve

    data = _data(hub, "unillm/tiny-gguf", "tiny-small-Q4_0.gguf")
    sha = hashlib.sha256(data).hexdigest()
    r = resolve("unillm/tiny-gguf:Q4_0")
    blobs = cache / "models--unillm--tiny-gguf" / "blobs"
    blobs.mkdir(parents=True)
    bad = blobs / f"{sha}.unillm-partial"
    bad.write_bytes(bytes(len(data)))  # all of it, and wrong: a disk error, a bad proxy
    with pytest.raises(DownloadError, match="does not match its sha256"):
        r.fetch()
    assert not bad.exists() and r.local is None
    assert r.fetch().read_bytes() == data


def test_a_full_disk_is_said_before_a_byte_is_written(
    hub: HubServer, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from unillm._hub import resolve

    r = resolve("unillm/tiny-gguf:f32")
    hub.reset_counts()
    usage = type(shutil.disk_usage("/"))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 40, (1 << 40) - 1000, 1000))
    with pytest.raises(DiskFull, match="unillm rm") as info:
        r.fetch()
    assert isinstance(info.value, OSError) and hub.served == {}


# ---- the command line, configs, imports ----


def test_pull_models_rm(hub: HubServer, cache: Path) -> None:
    from typer.testing import CliRunner

    from unillm.cli import app

    runner = CliRunner()
    out = runner.invoke(app, ["pull", "unillm/tiny-gguf:Q4_0"])
    assert out.exit_code == 0, out.output
    path = Path(out.stdout.strip().splitlines()[-1])
    assert path.is_file() and path.is_relative_to(cache)
    out = runner.invoke(app, ["pull", "unillm/tiny"])
    assert out.exit_code == 0, out.output
    out = runner.invoke(app, ["models", "--json"])
    listed = {m["id"]: m for m in json.loads(out.stdout)}
    gguf, hf = listed["unillm/tiny-gguf"], listed["unillm/tiny"]
    assert (
        gguf["files"] == ["tiny-small-Q4_0.gguf"]
        and gguf["format"] == "gguf"
        and gguf["quantization"] == "Q4_0"
    )
    assert gguf["refs"] == ["main"] and len(gguf["revision"]) == 40 and gguf["size"] == path.stat().st_size
    assert (
        hf["format"] == "safetensors"
        and hf["quantization"] == "float32"
        and "model.safetensors" in hf["files"]
    )
    assert gguf["backend"] == "llama.cpp" or not HAS_LLAMA_CPP
    table = runner.invoke(app, ["models"]).stdout
    assert "unillm/tiny-gguf" in table and "Q4_0" in table and table.startswith("id")
    out = runner.invoke(app, ["inspect", "unillm/tiny-gguf:F16"])  # headers only
    assert out.exit_code == 0 and "F16" in out.stdout and not list(cache.rglob("*f16.gguf"))
    import huggingface_hub as hf  # its own tools see what unillm fetched: the same layout

    assert hf.hf_hub_download(
        "unillm/tiny-gguf", "tiny-small-Q4_0.gguf", cache_dir=cache, local_files_only=True
    ) == str(path)
    assert {r.repo_id for r in hf.scan_cache_dir(cache).repos} == {"unillm/tiny-gguf", "unillm/tiny"}
    out = runner.invoke(app, ["pull", "unillm/tiny-gguf@v1"])
    assert out.exit_code == 0, out.output
    assert runner.invoke(app, ["rm", "unillm/tiny-gguf@v1"]).exit_code == 0  # that revision only
    assert path.is_file() and not any(
        hub.repos["unillm/tiny-gguf"].refs["v1"] in str(p) for p in cache.rglob("*.gguf")
    )
    assert not (cache / "models--unillm--tiny-gguf" / "refs" / "v1").exists()
    out = runner.invoke(app, ["rm", "unillm/tiny-gguf"])
    assert out.exit_code == 0, out.output
    assert [m["id"] for m in json.loads(runner.invoke(app, ["models", "--json"]).stdout)] == ["unillm/tiny"]
    out = runner.invoke(app, ["rm", "unillm/tiny-gguf"])
    assert out.exit_code == 2 and "ModelNotFound" in out.output
    out = runner.invoke(app, ["pull", "unillm/tiny-gguf:Q5_K_M"])
    assert out.exit_code == 2 and "QuantNotFound" in out.output and "Q8_0" in out.output
    out = runner.invoke(app, ["pull", "./not/a-name"])
    assert out.exit_code == 2 and "not a model name" in out.output


def _pull(name: str, *, terminal: bool) -> tuple[str, str]:
    """``unillm pull NAME`` in a process of its own, its stderr a terminal (a pseudo-terminal)
    or a pipe; its stdout and stderr. huggingface_hub's own switch for bars is left as a user's
    environment has it (unset): the hub fixture turns it off for every other test."""
    import fcntl
    import pty
    import struct
    import subprocess
    import termios

    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    argv = [sys.executable, "-m", "unillm", "pull", name]
    if not terminal:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, check=False)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout, proc.stderr
    main, sub = pty.openpty()
    # a terminal of 24 x 100 (a fresh pseudo-terminal is 0 x 0, and a bar fits no columns)
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=sub, stdin=subprocess.DEVNULL, env=env
    ) as child:
        os.close(sub)
        seen = b""
        try:
            while True:
                try:
                    got = os.read(main, 65536)
                except OSError:  # EIO: the child closed its end
                    break
                if not got:
                    break
                seen += got
            assert child.stdout is not None
            out = child.stdout.read().decode()
            assert child.wait(timeout=300) == 0, seen.decode(errors="replace")
        finally:
            child.kill()
            os.close(main)
    return out, seen.decode(errors="replace")


def test_pull_draws_bars_on_a_terminal_and_writes_lines_elsewhere(hub: HubServer, cache: Path) -> None:
    """A terminal gets huggingface_hub's bar (redrawn in place with carriage returns, the file
    named, 100% at the end); a pipe gets log lines at each tenth; stdout is the path either way."""
    out, err = _pull("unillm/tiny-gguf:Q8_0", terminal=True)
    size = len(_data(hub, "unillm/tiny-gguf", "tiny-small-Q8_0.gguf"))
    assert Path(out.strip().splitlines()[-1]).stat().st_size == size
    assert "tiny-small-Q8_0.gguf" in err and "100%" in err and "\r" in err, err
    assert "(100%)" not in err  # the bar, not the log lines
    out, err = _pull("unillm/tiny-gguf:F16", terminal=False)
    assert Path(out.strip().splitlines()[-1]).is_file()
    assert "tiny-small-f16.gguf" in err and "(100%)" in err and "\r" not in err, err


def test_a_config_file_keeps_a_name_and_joins_a_path(tmp_path: Path) -> None:
    from unillm import read_config

    (tmp_path / "a.toml").write_text(
        'model = "unillm/tiny-gguf:Q8_0"\nvariants = ["unillm/tiny", "m/x.gguf"]\n'
    )
    (tmp_path / "b.toml").write_text('model = "models/x.gguf"\n')
    assert read_config(tmp_path / "a.toml").model == "unillm/tiny-gguf:Q8_0"
    assert read_config(tmp_path / "a.toml").variants == ("unillm/tiny", str(tmp_path / "m" / "x.gguf"))
    assert read_config(tmp_path / "b.toml").model == str(tmp_path / "models" / "x.gguf")


def test_import_unillm_imports_no_hub_library() -> None:
    code = (
        "import sys, unillm; unillm.auto_engine; import unillm._hub; "
        "assert not [m for m in sys.modules if m.startswith(('huggingface_hub', 'httpx'))], 'imported'"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr


def test_a_forced_backend_takes_a_name_the_hub_does_not_have(hub: HubServer, cache: Path) -> None:
    from unillm._choose._auto import choose

    # a plugin's backend may name a model on a server: unillm says what it saw and steps aside
    selection = choose(EngineConfig(model="unillm/nope", backend="llama.cpp")).selection
    assert any("not resolved on the hub" in step for step in selection.steps)
    with pytest.raises(RepoNotFound):
        choose(EngineConfig(model="unillm/nope"))


@needs_llama_cpp
def test_generate_downloads_a_name_then_runs_it(hub: HubServer, cache: Path) -> None:
    from typer.testing import CliRunner

    from unillm.cli import app

    out = CliRunner().invoke(
        app, ["generate", "unillm/tiny-gguf:Q4_0", "Hello", "--max-tokens", "3", "--context", "256"]
    )
    assert out.exit_code == 0, out.output
    assert "tiny-small-Q4_0.gguf" in out.stderr and "(100%)" in out.stderr  # progress as log lines
    assert list(cache.rglob("tiny-small-Q4_0.gguf"))


def test_the_hub_variables_are_read_when_a_name_is_resolved(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from unillm._hub import hub_env

    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    env = hub_env()
    assert env.cache_dir == tmp_path / "home" / "hub" and not env.offline and env.token is None
    assert env.endpoint == "https://huggingface.co"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.example/")
    env = hub_env()
    assert (env.cache_dir, env.offline, env.token, env.endpoint) == (
        tmp_path / "cache",
        True,
        "hf_x",
        "http://mirror.example",
    )


@needs_llama_cpp
def test_serve_takes_a_name(hub: HubServer, cache: Path) -> None:
    import httpx

    from ._server_util import start_server

    server = start_server(
        ["unillm/tiny-gguf:Q8_0", "--context", "256"], env={"PYTHONPATH": str(Path(__file__).parent.parent)}
    )
    try:
        served = [m["id"] for m in httpx.get(f"{server.v1}/models").json()["data"]]
        assert served == ["tiny-gguf:Q8_0"]
        r = httpx.post(
            f"{server.v1}/completions", json={"model": served[0], "prompt": "Hi", "max_tokens": 2}, timeout=60
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        server.stop()
    assert list(cache.rglob("tiny-small-Q8_0.gguf"))
    assert any("tiny-small-Q8_0.gguf" in line and "(100%)" in line for line in server.lines)  # progress


def test_an_unreachable_hub_and_an_empty_cache_say_not_cached(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from unillm._hub import resolve

    own = HubServer().start()
    url = own.url
    own.stop()  # nothing listens there now
    monkeypatch.setenv("HF_ENDPOINT", url)
    with pytest.raises(NotCached, match="cannot be reached") as info:
        resolve("unillm/tiny-gguf:Q8_0")
    assert "unillm pull unillm/tiny-gguf:Q8_0" in str(info.value)


def test_a_path_the_hub_lists_outside_the_snapshot_is_refused(hub: HubServer, cache: Path) -> None:
    from unillm._hub import resolve

    evil = HubServer()
    evil.add("evil/repo", {"../../escape.gguf": b"GGUF", "ok.gguf": b"GGUF"})
    with evil, pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_ENDPOINT", evil.url)
        with pytest.raises(DownloadError, match="will not write"):
            resolve("evil/repo")
    assert not list(cache.parent.rglob("escape.gguf"))


def test_a_repo_of_two_formats_gives_the_one_an_installed_backend_reads(hub: HubServer, cache: Path) -> None:
    from unillm._hub import resolve

    repo = hub.repos["unillm/tiny"]
    files = {p: f.data for p, f in repo.commits[repo.refs["main"]].items()}
    hub.add(
        "unillm/both",
        {**files, "tiny-small-Q8_0.gguf": _data(hub, "unillm/tiny-gguf", "tiny-small-Q8_0.gguf")},
    )
    assert resolve("unillm/both").format == "hf"  # installed backends unknown: the HF format
    assert resolve("unillm/both", reads={"safetensors", "gguf"}).format == "hf"
    gguf = resolve("unillm/both", reads={"gguf"})  # only a GGUF reader here
    assert gguf.format == "gguf" and gguf.files == ["tiny-small-Q8_0.gguf"]
    assert resolve("unillm/both:q8_0").format == "gguf"  # a tag names a GGUF


def test_the_fit_choice_through_the_hub_for_three_memory_sizes(hub: HubServer, cache: Path) -> None:
    from unillm import Hardware
    from unillm._choose._auto import choose

    def machine(ram: float) -> Hardware:
        return Hardware(
            os="Linux", arch="x86_64", cpu_cores=4, ram_total_bytes=int(ram), ram_available_bytes=int(ram)
        )

    cfg = EngineConfig(model="unillm/tiny-gguf", context_length=4096, concurrency=4)
    roomy = choose(cfg, hardware=machine(1 << 40)).source
    assert roomy is not None and roomy.choice is not None and roomy.files == ["tiny-small-f32.gguf"]
    need = {o.file.quant: o.total_bytes for o in roomy.choice.options}  # the planner's totals, margin aside
    budget = 0.95  # the planner keeps 5% of a device in reserve
    for quant, between in [("F16", ("F16", "F32")), ("Q8_0", ("Q8_0", "F16")), ("Q4_0", ("Q4_0", "Q8_0"))]:
        low, high = (need[q] for q in between)
        assert low is not None and high is not None and low < high
        source = choose(cfg, hardware=machine((low + high) / 2 / budget)).source
        assert source is not None and source.choice is not None
        assert source.choice.chosen.quant == quant, "\n".join(source.lines())
    assert not list(cache.rglob("*.gguf"))  # chosen from headers: nothing downloaded


def test_a_hub_gone_between_the_listing_and_the_download(
    hub: HubServer, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from unillm._hub import resolve

    own = HubServer({"unillm/tiny-gguf": hub.repos["unillm/tiny-gguf"]}).start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", own.url)
        r = resolve("unillm/tiny-gguf:Q4_0")
    finally:
        own.stop()
    with pytest.raises(DownloadError, match="cannot reach the hub"):
        r.fetch()
    assert r.local is None


# ---- variants: the same model in several copies ----


def _mlx_4bit(hub: HubServer, tmp_path: Path) -> str:
    """A real MLX 4-bit conversion of the tiny model (mlx-lm's own converter), on the hub."""
    from unillm.engines.mlx._model import import_mlx_lm

    convert = import_mlx_lm().convert

    from unillm.testing import build_tiny_model

    out = tmp_path / "mlx-4bit"
    convert(
        str(build_tiny_model(tmp_path / "tiny").hf_dir),
        mlx_path=str(out),
        quantize=True,
        q_bits=4,
        q_group_size=32,
    )
    hub.add("unillm/tiny-mlx-4bit", {p.name: p for p in sorted(out.iterdir()) if p.is_file()})
    return "unillm/tiny-mlx-4bit"


@pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="mlx-lm is not installed")
def test_variants_give_the_highest_precision_that_runs_and_fits(
    hub: HubServer, cache: Path, tmp_path: Path
) -> None:
    """Of an HF-format f32 repo, a GGUF Q8_0 and an MLX 4-bit conversion of the same model: the f32
    on a roomy machine, the Q8_0 where only it and the MLX copy fit, the MLX copy where only it
    does; a copy no installed backend reads is passed over; every copy listed in explain(), and
    nothing downloaded to weigh them."""
    from unillm import Hardware
    from unillm._choose._auto import choose

    def machine(ram: float) -> Hardware:
        return Hardware(
            os="Linux", arch="x86_64", cpu_cores=4, ram_total_bytes=int(ram), ram_available_bytes=int(ram)
        )

    mlx = _mlx_4bit(hub, tmp_path)
    hub.reset_counts()
    cfg = EngineConfig(model="unillm/tiny", variants=("unillm/tiny-gguf:Q8_0", mlx), context_length=4096,
                       concurrency=4)  # fmt: skip
    # as if llama.cpp, MLX and vLLM were installed and nothing else (this machine's own set
    # varies): the choice is the chooser's, not the machine's
    installed = {"llama.cpp", "mlx", "vllm"}
    available = {
        n: Availability(n in installed, "" if n in installed else "not installed here")
        for n in unillm.backends()
    }
    roomy = choose(cfg, hardware=machine(1 << 40), available=available)
    assert roomy.variant == "unillm/tiny", roomy.selection.explain()
    need = {w.name: w.total_bytes for w in roomy.weighed}
    assert [w.backend is not None for w in roomy.weighed] == [True, True, True]
    text = roomy.selection.explain()
    assert "variants (highest precision first, * chosen):" in text and "* unillm/tiny (" in text
    assert text.index("unillm/tiny (") < text.index("unillm/tiny-gguf:Q8_0") < text.index(mlx)
    budget = 0.95  # the planner keeps 5% of a device in reserve
    for want, low, high in [
        ("unillm/tiny-gguf:Q8_0", "unillm/tiny-gguf:Q8_0", "unillm/tiny"),
        (mlx, mlx, "unillm/tiny-gguf:Q8_0"),
    ]:
        assert need[low] < need[high], need
        got = choose(cfg, hardware=machine((need[low] + need[high]) / 2 / budget), available=available)
        assert got.variant == want, got.selection.explain()
        assert "that fits at 4096 tokens x 4" in got.selection.explain()
    # no backend that reads safetensors or MLX installed: the GGUF, whatever its precision
    gguf_only = {n: Availability(n == "llama.cpp", "not installed here") for n in available}
    only = choose(cfg, hardware=machine(1 << 40), available=gguf_only)
    assert (
        only.variant == "unillm/tiny-gguf:Q8_0" and "no installed backend runs it" in only.selection.explain()
    )
    assert not list(cache.rglob("*.gguf")) and not list(cache.rglob("*.safetensors"))
    assert all("safetensors" not in key or sent < 1 << 17 for key, sent in hub.served.items())  # headers only


@needs_llama_cpp
def test_auto_engine_loads_the_variant_chosen_and_downloads_only_it(hub: HubServer, cache: Path) -> None:
    """A Q4_0 model with its Q8_0 and F16 copies as variants (one missing from the hub): the F16 is
    downloaded alone and runs; explain() lists each variant and the one not weighed."""
    variants = ["unillm/tiny-gguf:Q8_0", "unillm/tiny-gguf:F16", "unillm/nowhere"]
    engine = unillm.auto_engine("unillm/tiny-gguf:Q4_0", variants=variants)
    with engine:
        assert engine.generate("Once upon a time", max_tokens=4, temperature=0).usage.completion_tokens == 4
        text = engine.selection.explain()
    assert "* unillm/tiny-gguf:F16" in text and "not weighed: unillm/nowhere" in text, text
    assert sorted(p.name for p in cache.rglob("*.gguf")) == ["tiny-small-f16.gguf"]
