"""Format detection and the GGUF header reader, on good and hostile files."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from unillm import ModelFormatError, ModelNotFound, _inspect, detect_format, inspect_model
from unillm._inspect import read_gguf_header
from unillm.testing import TinyModel

from ._reads import Reads, count_reads


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


@dataclass
class Work:
    """What header reads did, counted rather than timed: read calls on the file and the bytes they
    returned (``io``), bytes parsed into values (``_Reader.take``, ``unpack``; a skip parses none)
    and strings walked over by their length prefixes (``_Reader.skip_strings``)."""

    io: Reads
    parsed: int = 0
    walked: int = 0

    def reset(self) -> None:
        self.io.calls = self.io.bytes = self.parsed = self.walked = 0


@pytest.fixture
def work(monkeypatch: pytest.MonkeyPatch) -> Work:
    """The ``Work`` of every header read in the test (counters wrapped around the real code)."""
    w = Work(io=count_reads(monkeypatch))

    reader = _inspect._gguf_reader._Reader
    take, unpack, skip_strings = reader.take, reader.unpack, reader.skip_strings

    def counted_take(self: Any, n: int) -> bytes:
        w.parsed += n
        return take(self, n)

    def counted_unpack(self: Any, s: struct.Struct) -> tuple[Any, ...]:
        w.parsed += s.size
        return unpack(self, s)

    def counted_skip_strings(self: Any, n: int) -> None:
        w.walked += n
        skip_strings(self, n)

    monkeypatch.setattr(reader, "take", counted_take)
    monkeypatch.setattr(reader, "unpack", counted_unpack)
    monkeypatch.setattr(reader, "skip_strings", counted_skip_strings)
    return w


def test_many_small_arrays_cost_little_per_byte(tmp_path: Path, work: Work) -> None:
    """8,192 keys of 4,096-item arrays (32 MiB of header): once ~1 us a byte (half a minute), each
    item parsed. Now the file is read once, in blocks, and only the 65,536 items kept and the keys
    are parsed: the rest is skipped, not read item by item."""
    array = struct.pack("<IQ", 0, 4096) + bytes(4096)  # uint8 items, each kept if small
    path = tmp_path / "arrays.gguf"
    path.write_bytes(_gguf([_kv(f"k.{i}", 9, array) for i in range(8192)]))
    size = path.stat().st_size
    h = read_gguf_header(path)
    # each byte read at most once, in blocks of 64 KiB or more (not a read per key or per array)
    assert work.io.bytes <= size and work.io.calls <= size // (1 << 16) + 1, work
    assert work.parsed < 512 << 10, work  # 64 KiB of items and the keys, of 32 MiB
    assert len(h.array_lengths) == 8192
    kept = [v for v in h.metadata.values() if v is not None]
    assert len(kept) == 16 and kept[0] == [0] * 4096  # 65,536 items kept in all, then lengths only


def test_implausible_counts_are_refused_before_any_work(tmp_path: Path, work: Work) -> None:
    """Each refused where the count or length is read: the first block read (64 KiB, of files of up
    to 16 MiB) and a few fields parsed, never the keys, strings or bytes the header claims."""
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
        work.reset()
        with pytest.raises(ModelFormatError, match=f"{why}.*corrupt or hostile"):
            read_gguf_header(path)
        assert work.io.bytes <= 1 << 16 and work.parsed <= 128 and work.walked == 0, (label, work)


def test_every_string_of_every_array_counts_against_one_cap(tmp_path: Path, work: Work) -> None:
    # 3 arrays of 1M empty strings: each under the per-array cap, together over the total
    run = struct.pack("<IQ", 8, 1 << 20) + bytes(8 << 20)
    path = tmp_path / "m.gguf"
    path.write_bytes(_gguf([_kv(f"t{i}", 9, run) for i in range(3)]))
    with pytest.raises(ModelFormatError, match="more than 2097152 strings"):
        read_gguf_header(path)
    # the first two arrays walked, the third refused at its count: of it at most the block read
    # ahead (up to 4 MiB) is read; the walk reads in blocks, not a read per string
    assert work.walked == 2 << 20, work
    third = path.stat().st_size - (8 << 20)  # where the third array's strings start
    assert work.io.bytes <= third + (4 << 20) and work.io.calls <= 16, work


@pytest.mark.parametrize("block", [8, 13, 64, 1 << 10])
def test_the_answer_does_not_depend_on_the_read_block(
    tiny: TinyModel, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    """Every length prefix and value straddles a block boundary somewhere at these sizes."""
    want = read_gguf_header(tiny.gguf_path, keep_arrays=True)
    monkeypatch.setattr(_inspect._gguf_reader, "_FIRST_BLOCK", block)
    monkeypatch.setattr(_inspect._gguf_reader, "_MAX_BLOCK", block)
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


# ---- GGUF: the lazy read inspection uses ----------------------------------------------------


def _u32(key: str, value: int) -> bytes:
    return _kv(key, 4, struct.pack("<I", value))


def _str(key: str, value: str) -> bytes:
    return _kv(key, 8, struct.pack("<Q", len(value)) + value.encode())


def _model(kvs: list[bytes], shapes: list[tuple[int, ...]], *, cut: int = 0) -> bytes:
    """A GGUF of ``kvs`` and F32 tensors of ``shapes``, laid out as llama.cpp writes one (offsets
    chained, each tensor padded to 32 bytes); ``cut`` bytes short of its end."""
    infos, offset = [], 0
    for i, shape in enumerate(shapes):
        name = f"blk.{i}.w".encode()
        dims = struct.pack(f"<{len(shape)}Q", *shape)
        infos.append(struct.pack("<Q", len(name)) + name + struct.pack("<I", len(shape)) + dims)
        infos.append(struct.pack("<IQ", 0, offset))
        offset += -(-4 * math.prod(shape) // 32) * 32
    head = _gguf(kvs, len(shapes), b"".join(infos))
    data = head + bytes(-len(head) % 32) + bytes(offset)
    return data[: len(data) - cut]


ARCH = [
    _str("general.architecture", "llama"),
    _u32("llama.block_count", 2),
    _u32("llama.embedding_length", 64),
    _u32("llama.attention.head_count", 4),
    _u32("llama.context_length", 4096),
]
SHAPES = [(64, 8), (64,)]


def _vocab(n: int = 5000, word: bytes = b"tok") -> bytes:
    return _kv("tokenizer.ggml.tokens", 9, _strings([word + str(i).encode() for i in range(n)]))


def _offset(data: bytes, key: str) -> int:
    return data.index(struct.pack("<Q", len(key)) + key.encode())


def test_a_lazy_read_stops_at_the_vocabulary(tmp_path: Path) -> None:
    """general.file_type before the vocabulary (convert_hf_to_gguf's layout): nothing after the
    vocabulary's length is read, the tensor infos included."""
    path = tmp_path / "m.gguf"
    data = _model(
        [*ARCH, _u32("general.file_type", 0), _vocab(), _u32("tokenizer.ggml.bos_token_id", 1)], SHAPES
    )
    path.write_bytes(data)
    full, lazy = read_gguf_header(path), read_gguf_header(path, lazy=True)
    assert full.unread is None and full.tensors_read and full.parameters == 64 * 8 + 64
    start = _offset(data, "tokenizer.ggml.tokens") + 8 + 21 + 4 + 12  # the key, its type, etype, count
    assert lazy.unread == (start, None) and lazy.unread_keys == 1 and not lazy.tensors_read
    assert lazy.array_lengths == full.array_lengths == {"tokenizer.ggml.tokens": 5000}
    assert lazy.metadata == {k: v for k, v in full.metadata.items() if k != "tokenizer.ggml.bos_token_id"}
    assert (lazy.data_end, lazy.tensor_bytes, lazy.parameters) == (None, None, 0)
    # the lowest offset the data can start at: every string, key and tensor info at its shortest
    assert lazy.data_offset == start + 8 * 5000 + 13 + 2 * 24 <= full.data_offset
    assert read_gguf_header(path, lazy=True, keep_arrays=True).unread is None  # keep_arrays reads all


def test_a_lazy_read_finds_general_file_type_past_the_vocabulary(tmp_path: Path) -> None:
    """llama-quantize's layout: general.file_type appended after the vocabulary, found by its bytes;
    the keys from it on and the tensor infos are read, the ones between are not."""
    path = tmp_path / "m.gguf"
    middle = [_u32("tokenizer.ggml.bos_token_id", 1), _str("tokenizer.chat_template", "{{ x }}")]
    tail = [_u32("general.file_type", 7), _str("quantize.imatrix.file", "i.dat")]
    data = _model([*ARCH, _vocab(), *middle, *tail], SHAPES)
    path.write_bytes(data)
    full, lazy = read_gguf_header(path), read_gguf_header(path, lazy=True)
    assert lazy.unread is not None and lazy.unread[1] == _offset(data, "general.file_type")
    assert lazy.tensors_read and lazy.unread_keys == 2
    assert lazy.metadata == {k: v for k, v in full.metadata.items() if not k.startswith("tokenizer.")} | {
        "tokenizer.ggml.tokens": None
    }
    for name in ("data_offset", "data_end", "parameters", "tensor_bytes", "type_elements", "file_size"):
        assert getattr(lazy, name) == getattr(full, name), name


def test_a_string_holding_the_keys_bytes_is_not_taken_for_it(tmp_path: Path) -> None:
    """A token "general.file_type" is the key's bytes, length and all: where it is, no tensor
    infos follow, so the search goes on to the real key."""
    path = tmp_path / "m.gguf"
    words = [b"general.file_type", b"abcd", b"general.file_type"] + [b"w%d" % i for i in range(5000)]
    vocab = _kv("tokenizer.ggml.tokens", 9, _strings(words))
    data = _model([*ARCH, vocab, _u32("general.file_type", 7)], SHAPES)
    path.write_bytes(data)
    lazy = read_gguf_header(path, lazy=True)
    assert lazy.unread is not None and lazy.unread[1] == data.rindex(
        b"\x11" + bytes(7) + b"general.file_type"
    )
    assert lazy.metadata["general.file_type"] == 7 and lazy.parameters == read_gguf_header(path).parameters


def test_a_lazy_read_gives_up_after_a_few_false_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A vocabulary of 5,000 copies of the key's bytes: eight are tried, then the read stops."""
    path = tmp_path / "m.gguf"
    vocab = _kv("tokenizer.ggml.tokens", 9, _strings([b"general.file_type"] * 5000))
    path.write_bytes(_model([*ARCH, vocab, _u32("general.file_type", 7)], SHAPES))
    tried: list[int] = []  # where the tail was looked for
    tail_at = _inspect._gguf_lazy._tail_at

    def counted(r: Any, at: int, *args: Any) -> Any:
        tried.append(at)
        return tail_at(r, at, *args)

    monkeypatch.setattr(_inspect._gguf_lazy, "_tail_at", counted)
    lazy = read_gguf_header(path, lazy=True)
    assert len(tried) == _inspect._gguf_lazy._TAIL_CANDIDATES == 8  # of the 5,001 places with the bytes
    assert lazy.unread is not None and lazy.unread[1] is None
    info = inspect_model(path)  # no file type seen: read whole
    assert info.quantization == "Q8_0" and info.estimated == () and info.parameters == 64 * 8 + 64


def test_a_truncated_file_is_not_mistaken_for_a_tail(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(_model([*ARCH, _vocab(), _u32("general.file_type", 0)], SHAPES, cut=100))
    lazy = read_gguf_header(path, lazy=True)
    assert lazy.unread is not None and lazy.unread[1] is None  # the tensors do not end with the file
    with pytest.raises(ModelFormatError, match="truncated"):
        inspect_model(path)  # from the full read


def test_a_vocabulary_only_file_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "vocab.gguf"
    path.write_bytes(_model([*ARCH, _vocab(), _u32("general.file_type", 0)], []))
    assert read_gguf_header(path, lazy=True).unread is None


@pytest.mark.parametrize("block", [25, 26, 31, 64, 1 << 10])
def test_every_occurrence_is_found_once_whatever_the_scan_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    needle = struct.pack("<Q", 17) + b"general.file_type"
    data = bytearray(os.urandom(5000).replace(b"\x11", b"\x12"))
    want = [0, 25, 100, 999, 1024, 4000, 5000 - len(needle)]
    for at in want:
        data[at : at + len(needle)] = needle
    path = tmp_path / "blob"
    path.write_bytes(bytes(data))
    monkeypatch.setattr(_inspect._gguf_lazy, "_SCAN_BLOCK", block)
    with _inspect._open(path) as f:
        r = _inspect._Reader(f, str(path), len(data))
        assert list(_inspect._positions(r, needle, 0, len(data))) == want
        assert list(_inspect._positions(r, needle, 26, 4000 + len(needle) - 1)) == [100, 999, 1024]


@pytest.mark.parametrize("block", [8, 13, 64, 1 << 10])
def test_a_lazy_read_does_not_depend_on_the_read_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(
        _model(
            [*ARCH, _vocab(), _u32("tokenizer.ggml.bos_token_id", 1), _u32("general.file_type", 7)], SHAPES
        )
    )
    want = read_gguf_header(path, lazy=True)
    monkeypatch.setattr(_inspect._gguf_reader, "_FIRST_BLOCK", block)
    monkeypatch.setattr(_inspect._gguf_reader, "_MAX_BLOCK", block)
    monkeypatch.setattr(_inspect._gguf_lazy, "_SCAN_BLOCK", max(block, 32))
    assert read_gguf_header(path, lazy=True) == want
