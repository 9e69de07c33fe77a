"""Format detection and the GGUF header reader, on good and hostile files."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from unillm import ModelFormatError, ModelNotFound, detect_format
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
    huge_string = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 60)
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
