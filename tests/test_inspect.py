"""Format detection and the GGUF header reader, on good and hostile files."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from unillm import ModelFormatError, ModelNotFound, _inspect, detect_format, inspect_model
from unillm._inspect import read_gguf_header
from unillm.testing import TinyModel


def test_formats(tiny: TinyModel, tmp_path: Path) -> None:
    assert detect_format(tiny.gguf_path) == "gguf"
    assert detect_format(tiny.hf_dir) == "safetensors"
    for method, fmt in [("awq", "awq"), ("gptq", "gptq"), ("fp8", "fp8"), ("exl2", "exl2")]:
        d = tmp_path / method
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": method}}))
        assert detect_format(d) == fmt
    mlx = tmp_path / "mlx"
    mlx.mkdir()
    (mlx / "config.json").write_text(json.dumps({"quantization": {"group_size": 64, "bits": 4}}))
    assert detect_format(mlx) == "mlx"


def test_missing_and_unknown(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound):
        detect_format(tmp_path / "absent.gguf")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelFormatError, match=r"not a model format"):
        detect_format(tmp_path / "notes.txt")
    with pytest.raises(ModelFormatError, match=r"without config\.json"):
        detect_format(tmp_path)


def test_bad_magic(tmp_path: Path) -> None:
    bad = tmp_path / "fake.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ModelFormatError, match="GGUF magic"):
        detect_format(bad)
    with pytest.raises(ModelFormatError, match="not a GGUF"):
        read_gguf_header(bad)


def test_header_of_the_tiny_model(tiny: TinyModel) -> None:
    h = read_gguf_header(tiny.gguf_path)
    assert h.architecture == "llama"
    assert h.arch_value("block_count") == 2
    assert h.data_end == h.file_size and not h.truncated
    assert h.array_lengths["tokenizer.ggml.tokens"] == 512


def test_truncated_file_is_detected(tiny: TinyModel, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    data = tiny.gguf_path.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    assert read_gguf_header(cut).truncated
    cut.write_bytes(data[:200])  # inside the metadata
    with pytest.raises(ModelFormatError, match="truncated"):
        read_gguf_header(cut)


def test_lying_lengths_allocate_nothing(tmp_path: Path) -> None:
    huge_string = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 60) + bytes(64)
    (tmp_path / "a.gguf").write_bytes(huge_string)
    with pytest.raises(ModelFormatError, match="implausible"):
        read_gguf_header(tmp_path / "a.gguf")
    huge_counts = b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 1 << 40)
    (tmp_path / "b.gguf").write_bytes(huge_counts)
    with pytest.raises(ModelFormatError, match="corrupt"):
        read_gguf_header(tmp_path / "b.gguf")
    key = struct.pack("<Q", 1) + b"k"
    huge_array = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + key + struct.pack("<IIQ", 9, 4, 1 << 50)
    (tmp_path / "c.gguf").write_bytes(huge_array)
    with pytest.raises(ModelFormatError, match="implausible"):
        read_gguf_header(tmp_path / "c.gguf")
    nested = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + key + struct.pack("<IIQ", 9, 9, 2)
    (tmp_path / "d.gguf").write_bytes(nested)
    with pytest.raises(ModelFormatError, match="nested"):
        read_gguf_header(tmp_path / "d.gguf")


def test_bad_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="not valid JSON"):
        detect_format(tmp_path)


# ---- paths that are not model files ----------------------------------------------------------


def _readers(path: Path) -> list[tuple[str, Callable[[], object]]]:
    return [
        ("detect_format", lambda: detect_format(path)),
        ("inspect_model", lambda: inspect_model(path)),
        ("read_gguf_header", lambda: read_gguf_header(path)),
    ]


def test_a_path_too_long_is_a_format_error_not_an_oserror(tmp_path: Path) -> None:
    for path in (tmp_path / ("m" * 300 + ".gguf"), tmp_path / "/".join(["d" * 250] * 20)):
        for _, read in _readers(path):
            with pytest.raises(ModelFormatError, match="too long"):
                read()


def test_an_unreadable_file_says_permission_denied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the tests run as root, who may read any file: the kernel's refusal is simulated
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    real_open = os.open

    def refuse(p: Any, flags: int, *args: Any) -> int:
        if Path(p) == path:
            raise PermissionError(errno.EACCES, "Permission denied", str(p))
        return real_open(p, flags, *args)

    monkeypatch.setattr(os, "open", refuse)
    for _, read in _readers(path):
        with pytest.raises(ModelFormatError, match="permission denied: make it readable"):
            read()


@pytest.mark.skipif(not Path("/proc/1/mem").exists(), reason="needs Linux's /proc")
def test_a_file_the_kernel_refuses_to_read_is_a_format_error() -> None:
    # /proc/1/mem: refused even to root (EACCES) unless it may trace pid 1, and then unreadable (EIO)
    with pytest.raises(ModelFormatError, match="cannot be read"):
        read_gguf_header("/proc/1/mem")
    with pytest.raises(ModelFormatError, match="cannot be read"):
        detect_format("/proc/self/mem")  # readable only where this process maps memory: EIO at 0


def _fifo(path: Path) -> Path:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    os.mkfifo(path)
    return path


def _without_blocking(read: Callable[[], object], fifo: Path | None = None) -> BaseException | None:
    """Run ``read`` in a thread; fail (and unblock it) if it waits on the FIFO."""
    caught: list[BaseException] = []

    def run() -> None:
        try:
            read()
        except BaseException as exc:
            caught.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(5)
    if worker.is_alive():
        if fifo is not None:  # open the write end so the blocked open returns
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"{read} blocked on a FIFO")
    return caught[0] if caught else None


def test_a_fifo_or_device_named_gguf_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = _fifo(tmp_path / "x.gguf")
    device = tmp_path / "y.gguf"
    device.symlink_to("/dev/null")
    for path, what in ((fifo, "a FIFO (named pipe)"), (device, "a character device")):
        for label, read in _readers(path):
            exc = _without_blocking(read, fifo)
            assert isinstance(exc, ModelFormatError), (label, exc)
            assert f"is {what}, not a model file" in str(exc), (label, exc)


def test_a_path_swapped_for_a_fifo_after_the_check_is_still_refused(tmp_path: Path) -> None:
    fifo = _fifo(tmp_path / "x.gguf")
    exc = _without_blocking(lambda: _inspect._open(fifo), fifo)  # the open itself, past _kind
    assert isinstance(exc, ModelFormatError) and "FIFO" in str(exc), exc


def test_a_fifo_inside_a_model_directory_is_refused_without_blocking(tiny: TinyModel, tmp_path: Path) -> None:
    d = tmp_path / "hf"
    shutil.copytree(tiny.hf_dir, d)
    (d / "config.json").unlink()
    fifo = _fifo(d / "config.json")
    for read in (lambda: detect_format(d), lambda: inspect_model(d)):
        exc = _without_blocking(read, fifo)
        assert isinstance(exc, ModelFormatError) and "FIFO" in str(exc), exc
    (d / "config.json").unlink()
    shutil.copy(tiny.hf_dir / "config.json", d / "config.json")
    (d / "model.safetensors").unlink()
    fifo = _fifo(d / "model.safetensors")
    exc = _without_blocking(lambda: inspect_model(d), fifo)
    assert isinstance(exc, ModelFormatError) and "FIFO" in str(exc), exc


def test_a_directory_where_a_gguf_is_expected_says_what_it_holds(tiny: TinyModel, tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match="Hugging Face model") as hf:
        read_gguf_header(tiny.hf_dir)
    assert "llama.cpp reads only .gguf files" in str(hf.value)
    assert not isinstance(hf.value, ModelNotFound)
    d = tmp_path / "ggufs"
    d.mkdir()
    with pytest.raises(ModelFormatError, match=r"pass the path of a \.gguf file"):
        read_gguf_header(d)
    shutil.copy(tiny.gguf_path, d / "a.gguf")
    with pytest.raises(ModelFormatError, match=r"pass one of its \.gguf files \(a\.gguf\)"):
        read_gguf_header(d)
    with pytest.raises(ModelNotFound):
        read_gguf_header(tmp_path / "absent.gguf")


def test_an_unlistable_directory_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_scandir = os.scandir

    def refuse(p: Any = ".") -> Any:
        if Path(p) == tmp_path:
            raise PermissionError(errno.EACCES, "Permission denied", str(p))
        return real_scandir(p)

    monkeypatch.setattr(os, "scandir", refuse)
    with pytest.raises(ModelFormatError, match="permission denied"):
        detect_format(tmp_path)
    with pytest.raises(ModelFormatError, match="permission denied"):
        inspect_model(tmp_path)


@pytest.mark.parametrize("path", ["m\x00.gguf", "\udcff\ud800.gguf"])
def test_a_path_the_os_cannot_take_is_a_format_error(path: str) -> None:
    for _, read in _readers(Path(path)):
        with pytest.raises((ModelFormatError, ModelNotFound)):
            read()


# ---- GGUF: bounded work on hostile headers ----------------------------------------------------


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + payload


def _gguf(kvs: list[bytes], n_tensors: int = 0, tail: bytes = b"") -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(kvs)) + b"".join(kvs) + tail


def _strings(items: list[bytes]) -> bytes:
    return struct.pack("<IQ", 8, len(items)) + b"".join(struct.pack("<Q", len(s)) + s for s in items)


def test_many_small_arrays_cost_little_per_byte(tmp_path: Path) -> None:
    """8,192 keys of 4,096-item arrays (32 MiB of header): once ~1 us a byte (half a minute)."""
    array = struct.pack("<IQ", 0, 4096) + bytes(4096)  # uint8 items, each kept if small
    path = tmp_path / "arrays.gguf"
    path.write_bytes(_gguf([_kv(f"k.{i}", 9, array) for i in range(8192)]))
    t0 = time.perf_counter()
    h = read_gguf_header(path)
    assert time.perf_counter() - t0 < 1.0
    assert len(h.array_lengths) == 8192
    kept = [v for v in h.metadata.values() if v is not None]
    assert len(kept) == 16 and kept[0] == [0] * 4096  # 65,536 items kept in all, then lengths only


def test_implausible_counts_are_refused_before_any_work(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    cases: dict[str, tuple[bytes, str]] = {
        "keys over the cap": (
            b"GGUF" + struct.pack("<IQQ", 3, 0, 10_000) + bytes(1 << 20),
            "claims 0 tensors and 10000 keys",
        ),
        "keys beyond the file": (
            b"GGUF" + struct.pack("<IQQ", 3, 0, 5000) + bytes(60_000),
            "keys in 60024 bytes",
        ),
        "strings beyond the file": (
            _gguf([_kv("t", 9, struct.pack("<IQ", 8, 100_000) + bytes(1000))]),
            "array of 100000 strings is implausible",
        ),
        "a vocabulary over the cap": (
            _gguf([_kv("t", 9, struct.pack("<IQ", 8, 1 << 21))], tail=bytes(1 << 24)),
            "array of 2097152 strings is implausible",
        ),
        "a numeric array beyond the file": (
            _gguf([_kv("t", 9, struct.pack("<IQ", 10, 1000) + bytes(100))]),
            "array of 1000 items is implausible",
        ),
        "a key of 1 MiB": (
            _gguf([struct.pack("<Q", 1 << 20) + b"k" * (1 << 20) + struct.pack("<IB", 0, 1)]),
            "key of 1048576 bytes is implausible",
        ),
        "a duplicate key": (_gguf([_kv("k", 0, b"\x01"), _kv("k", 0, b"\x02")]), "appears twice"),
        "alignment not a power of two": (
            _gguf([_kv("general.alignment", 4, struct.pack("<I", 24))]),
            "not a power of two",
        ),
        "a huge tensor name": (
            _gguf([], 1, struct.pack("<Q", 1 << 40) + bytes(64)),
            "tensor name of 1099511627776 bytes",
        ),
    }
    for label, (data, why) in cases.items():
        path.write_bytes(data)
        t0 = time.perf_counter()
        with pytest.raises(ModelFormatError, match=f"{why}.*corrupt or hostile"):
            read_gguf_header(path)
        assert time.perf_counter() - t0 < 0.5, label


def test_every_string_of_every_array_counts_against_one_cap(tmp_path: Path) -> None:
    # 3 arrays of 1M empty strings: each under the per-array cap, together over the total
    run = struct.pack("<IQ", 8, 1 << 20) + bytes(8 << 20)
    path = tmp_path / "m.gguf"
    path.write_bytes(_gguf([_kv(f"t{i}", 9, run) for i in range(3)]))
    t0 = time.perf_counter()
    with pytest.raises(ModelFormatError, match="more than 2097152 strings"):
        read_gguf_header(path)
    assert time.perf_counter() - t0 < 2.0


@pytest.mark.parametrize("block", [8, 13, 64, 1 << 10])
def test_the_answer_does_not_depend_on_the_read_block(
    tiny: TinyModel, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    """Every length prefix and value straddles a block boundary somewhere at these sizes."""
    want = read_gguf_header(tiny.gguf_path, keep_arrays=True)
    monkeypatch.setattr(_inspect, "_FIRST_BLOCK", block)
    monkeypatch.setattr(_inspect, "_MAX_BLOCK", block)
    for keep in (True, False):
        got = read_gguf_header(tiny.gguf_path, keep_arrays=keep)
        assert (got.data_offset, got.data_end, got.parameters) == (
            want.data_offset,
            want.data_end,
            want.parameters,
        )
        assert got.array_lengths == want.array_lengths
        if keep:
            assert got.metadata == want.metadata


def test_a_vocabulary_is_walked_once_per_version_of_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def write(words: list[bytes], value: int) -> None:
        path.write_bytes(_gguf([_kv("t", 9, _strings(words)), _kv("v", 4, struct.pack("<I", value))]))

    path = tmp_path / "vocab.gguf"
    write([b"ab"] * 5000, 1)
    read_gguf_header(path)
    assert not _inspect._STRING_RUNS or all(k[1] != path.stat().st_ino for k in _inspect._STRING_RUNS)
    monkeypatch.setattr(_inspect, "_SETTLED_S", 0.0)  # as if the file had been written a while ago
    assert read_gguf_header(path).metadata["v"] == 1
    key = next(k for k in _inspect._STRING_RUNS if k[1] == path.stat().st_ino)
    assert read_gguf_header(path).metadata["v"] == 1  # the remembered end
    write([b"a"] * 2500 + [b"abc"] * 2500, 2)  # the same size and inode: a new version
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # even within one timestamp tick
    assert read_gguf_header(path).metadata["v"] == 2
    assert key in _inspect._STRING_RUNS and len({k for k in _inspect._STRING_RUNS if k[1] == st.st_ino}) == 2
