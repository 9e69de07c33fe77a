"""inspect_model on every format unillm can build or write itself, and on hostile files."""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import struct
import sys
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from unillm import ModelFormatError, ModelNotFound, _inspect, detect_format
from unillm._inspect import GGML_BLOCKS, ModelInfo, inspect_model, read_gguf_header
from unillm._plan._estimate import bits_per_weight
from unillm.testing import SIZES, TinyModel

from ._reads import Reads, count_reads

gguf = pytest.importorskip("gguf")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

Tensor = tuple[str, Sequence[int], int]  # name, shape (elements), ggml type


# ---- work, counted rather than timed ---------------------------------------------------------


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Reads:
    """Every read of a model file in the test, counted."""
    return count_reads(monkeypatch)


class Calls:
    """The function calls made inside ``with Calls() as calls:``, Python and built-in (a ``struct``
    unpack, a ``read``), in ``calls.n``: work counted with ``sys.setprofile`` rather than timed."""

    def __init__(self) -> None:
        self.n = 0
        self._previous: Any = None

    def _count(self, _frame: object, event: str, _arg: object) -> None:
        if event in ("call", "c_call"):
            self.n += 1

    def __enter__(self) -> Calls:
        self._previous = sys.getprofile()
        sys.setprofile(self._count)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(self._previous)


def calls_made(fn: Callable[[], object]) -> int:
    with Calls() as calls:
        fn()
    return calls.n


def write_gguf(
    path: Path,
    tensors: Sequence[Tensor],
    *,
    arch: str = "llama",
    kv: dict[str, Any] | None = None,
    file_type: int | None = None,
    data: bool = True,
    split_max_tensors: int = 0,
) -> Path:
    """A GGUF written with gguf's own writer; ``data=False`` writes the header only."""
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    if file_type is not None:
        w.add_file_type(file_type)
    for template, value in (kv or {}).items():
        key = template.replace("{arch}", arch)
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_string(key, value)
    for name, shape, ttype in tensors:
        per_block, block_bytes = GGML_BLOCKS[ttype]
        elements = int(np.prod(shape))
        nbytes = elements // per_block * block_bytes
        if data:
            raw = np.zeros((*shape[:-1], shape[-1] // per_block * block_bytes), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType(ttype))
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, gguf.GGMLQuantizationType(ttype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    if data:
        w.write_tensors_to_file()
    else:
        w.write_ti_data_to_file()
    w.close()
    return path


LLAMA_KV = {
    "{arch}.block_count": 2,
    "{arch}.embedding_length": 256,
    "{arch}.attention.head_count": 4,
    "{arch}.attention.head_count_kv": 2,
    "{arch}.context_length": 8192,
}


def llama_tensors(ttype: int, layers: int = 2, hidden: int = 256) -> list[Tensor]:
    out: list[Tensor] = [("token_embd.weight", (512, hidden), ttype)]
    for i in range(layers):
        out += [
            (f"blk.{i}.attn_q.weight", (hidden, hidden), ttype),
            (f"blk.{i}.attn_norm.weight", (hidden,), 0),
        ]
    return out


# ---- the project's own tiny models ----------------------------------------------------------


def test_tiny_gguf(tiny: TinyModel) -> None:
    spec = SIZES["small"]
    info = inspect_model(tiny.gguf_path)
    assert info.format == "gguf" and info.architecture == "llama"
    assert info.quantization == "F32" and info.bits_per_weight == 32.0
    assert info.parameters == info.active_parameters == spec.n_params
    assert info.weights_bytes == 4 * spec.n_params
    assert (info.layers, info.hidden_size, info.heads, info.kv_heads, info.head_dim) == (
        spec.num_layers,
        spec.hidden_size,
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
    )
    assert info.context_length == spec.max_position_embeddings and info.vocab_size == spec.vocab_size
    assert not (info.is_moe or info.multimodal or info.hybrid_attention)
    assert info.kv_bytes_per_token() == 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2
    assert info.files == (str(tiny.gguf_path),)
    assert inspect_model(tiny.root).parameters == spec.n_params  # a directory holding one GGUF


def test_tiny_hf(tiny: TinyModel) -> None:
    spec = SIZES["small"]
    info = inspect_model(tiny.hf_dir)
    assert info.format == detect_format(tiny.hf_dir) == "safetensors"
    assert info.architecture == "llama" and info.quantization == "f32"
    assert info.parameters == info.active_parameters == spec.n_params
    assert info.weights_bytes == 4 * spec.n_params and info.bits_per_weight == 32.0
    assert (info.layers, info.heads, info.kv_heads, info.head_dim, info.vocab_size) == (
        spec.num_layers,
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.vocab_size,
    )
    assert inspect_model(tiny.hf_dir / "model.safetensors").parameters == spec.n_params
    gguf_info = inspect_model(tiny.gguf_path)
    assert info.kv_bytes_per_token() == gguf_info.kv_bytes_per_token()


# ---- GGUF variants ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("file_type", "ttype", "name", "bpw"),
    [
        (gguf.LlamaFileType.MOSTLY_Q8_0, 8, "Q8_0", 8.5),
        (gguf.LlamaFileType.MOSTLY_Q4_0, 2, "Q4_0", 4.5),
        (gguf.LlamaFileType.MOSTLY_Q4_K_M, 12, "Q4_K_M", 4.5),
        (gguf.LlamaFileType.MOSTLY_Q6_K, 14, "Q6_K", 6.5625),
        (gguf.LlamaFileType.MOSTLY_IQ2_XXS, 16, "IQ2_XXS", 2.0625),
        (gguf.LlamaFileType.MOSTLY_BF16, 30, "BF16", 16.0),
        (gguf.LlamaFileType.MOSTLY_F16, 1, "F16", 16.0),
    ],
)
def test_quantized_gguf(tmp_path: Path, file_type: int, ttype: int, name: str, bpw: float) -> None:
    tensors = [(n, s, ttype) for n, s, _ in llama_tensors(ttype) if len(s) == 2]
    path = write_gguf(tmp_path / "q.gguf", tensors, kv=LLAMA_KV, file_type=int(file_type))
    info = inspect_model(path)
    assert info.quantization == name
    assert info.parameters == 512 * 256 + 2 * 256 * 256
    assert info.bits_per_weight == pytest.approx(bpw)
    assert info.head_dim == 64 and info.kv_heads == 2 and info.context_length == 8192


def test_gguf_without_file_type_names_the_dominant_tensor_type(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "q.gguf", llama_tensors(8), kv=LLAMA_KV)
    assert inspect_model(path).quantization == "Q8_0"
    guessed = write_gguf(tmp_path / "g.gguf", llama_tensors(8), kv=LLAMA_KV, file_type=7 | 1024)
    assert inspect_model(guessed).quantization == "Q8_0"


def test_split_gguf(tmp_path: Path) -> None:
    tensors = llama_tensors(0, layers=3)
    write_gguf(tmp_path / "m.gguf", tensors, kv=LLAMA_KV, split_max_tensors=2)
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) == 4
    whole = sum(int(np.prod(s)) for _, s, _ in tensors)
    for part in (parts[0], parts[-1]):
        info = inspect_model(part)
        assert info.parameters == whole and info.weights_bytes == 4 * whole
        assert info.files == tuple(str(p) for p in parts)
        assert info.architecture == "llama" and info.layers == 2
    assert inspect_model(tmp_path).parameters == whole  # the directory of parts
    parts[2].unlink()
    with pytest.raises(ModelFormatError, match="missing"):
        inspect_model(parts[0])


def test_moe_gguf(tmp_path: Path) -> None:
    kv = {**LLAMA_KV, "{arch}.expert_count": 8, "{arch}.expert_used_count": 2}
    experts: list[Tensor] = [
        (f"blk.{i}.ffn_{w}_exps.weight", (8, 512, 256), 8) for i in range(2) for w in ("up", "down")
    ]
    path = write_gguf(tmp_path / "moe.gguf", llama_tensors(8) + experts, arch="qwen3moe", kv=kv)
    info = inspect_model(path)
    dense = 512 * 256 + 2 * (256 * 256 + 256)
    expert = 4 * 8 * 512 * 256
    assert info.is_moe and (info.experts, info.experts_per_token) == (8, 2)
    assert info.parameters == dense + expert
    assert info.active_parameters == dense + expert // 4


def test_multimodal_and_hybrid_gguf(tmp_path: Path) -> None:
    proj = write_gguf(tmp_path / "mmproj.gguf", [("v.patch_embd.weight", (64, 64), 1)], arch="clip")
    assert inspect_model(proj).multimodal
    d = tmp_path / "vlm"
    d.mkdir()
    write_gguf(d / "model.gguf", llama_tensors(0), kv=LLAMA_KV)
    shutil.copy(proj, d / "mmproj-model-f16.gguf")
    assert inspect_model(d).multimodal
    assert not inspect_model(d / "model.gguf").multimodal
    swa = {**LLAMA_KV, "{arch}.attention.sliding_window": 4096}
    gemma = write_gguf(tmp_path / "g.gguf", llama_tensors(0), arch="gemma2", kv=swa)
    assert inspect_model(gemma).hybrid_attention
    ssm = {**LLAMA_KV, "{arch}.ssm.state_size": 16}
    jamba = write_gguf(tmp_path / "j.gguf", llama_tensors(0), arch="jamba", kv=ssm)
    assert inspect_model(jamba).hybrid_attention


def sparse_gguf(path: Path, total_bytes: int) -> Path:
    """A GGUF whose header claims ``total_bytes`` of F16 weights, the data a sparse hole."""
    layers = 40
    per = total_bytes // (2 * layers * 4) // 4096 * 4096
    tensors: list[Tensor] = [
        (f"blk.{i}.ffn_{k}.weight", (per // 4096, 4096), 1) for i in range(layers) for k in "abcd"
    ]
    write_gguf(path, tensors, kv=LLAMA_KV, file_type=1, data=False)
    end = read_gguf_header(path).data_end
    assert end is not None
    with path.open("r+b") as f:
        f.truncate(end)
    return path


def test_sparse_40gb_gguf_is_inspected_from_its_header(tmp_path: Path, reads: Reads) -> None:
    path = sparse_gguf(tmp_path / "big.gguf", 40 * 10**9)
    reads.calls = reads.bytes = 0  # sparse_gguf read the header itself
    info = inspect_model(path)
    # the magic, then the header (10 kB) in one block of 64 KiB: nothing of the 40 GB of weights
    assert reads.bytes <= (1 << 16) + 8 and reads.calls <= 4, reads
    assert info.weights_bytes == pytest.approx(40e9, rel=0.01)
    assert info.quantization == "F16" and info.bits_per_weight == 16.0
    assert info.parameters == pytest.approx(20e9, rel=0.01)


# ---- GGUF: lazy inspection past a large vocabulary -------------------------------------------

VOCAB, MERGES = 150_000, 100_000
LAYOUTS = ("converter", "quantize", "arch-after")


def vocab_gguf(
    path: Path,
    layout: str,
    *,
    tokens: int = VOCAB,
    merges: int = MERGES,
    arch: str = "llama",
    kv: dict[str, int] | None = None,
    tensors: Sequence[Tensor] | None = None,
) -> Path:
    """A Q8_0 GGUF with a ``tokens``-token vocabulary and ``merges`` merges around small tensors, its
    keys in the order of ``layout``: "converter" as convert_hf_to_gguf writes them (general.file_type
    and the <arch>.* keys, then the tokenizer), "quantize" as llama-quantize rewrites them
    (general.file_type removed and appended last), "arch-after" with the <arch>.* keys after the
    tokenizer too (no writer does: the lazy read must notice and read the file whole)."""
    w = gguf.GGUFWriter(str(path), arch)

    def arch_keys() -> None:
        for key, value in (LLAMA_KV if kv is None else kv).items():
            w.add_uint32(key.replace("{arch}", arch), value)

    if layout != "arch-after":
        arch_keys()
    if layout == "converter":
        w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0))
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(tokens)])
    w.add_token_types([1] * tokens)
    w.add_token_merges([f"t{i} k{i}" for i in range(merges)])
    w.add_bos_token_id(1)
    w.add_chat_template("{{ messages }}")
    if layout == "arch-after":
        arch_keys()
    if layout != "converter":
        w.add_quantization_version(2)
        w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0))
    for name, shape, ttype in llama_tensors(8) if tensors is None else tensors:
        per_block, block_bytes = GGML_BLOCKS[ttype]
        raw = np.zeros((*shape[:-1], shape[-1] // per_block * block_bytes), dtype=np.uint8)
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType(ttype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The 150k-token, 100k-merge GGUF in each layout."""
    d = tmp_path_factory.mktemp("vocab")
    return {layout: vocab_gguf(d / f"{layout}.gguf", layout) for layout in LAYOUTS}


# what selection and the planner take from ModelInfo, besides the sizes
SHAPE_FIELDS = (
    "format", "architecture", "quantization", "layers", "hidden_size", "heads", "kv_heads",
    "head_dim", "context_length", "vocab_size", "experts", "experts_per_token", "multimodal",
    "hybrid_attention", "files",
)  # fmt: skip


def lazy_and_full(path: Path) -> tuple[ModelInfo, ModelInfo]:
    """``inspect_model``'s answer and the full read's, checked against each other: the same shape;
    the same sizes, or, where the lazy answer says they are estimated, weights within the bound."""
    lazy, full = inspect_model(path), _inspect._inspect_gguf(path, lazy=False)
    assert full.estimated == ()
    for name in SHAPE_FIELDS:
        assert getattr(lazy, name) == getattr(full, name), name
    if not lazy.estimated:
        assert lazy == full
        return lazy, full
    assert set(lazy.estimated) == {"weights_bytes", "parameters", "active_parameters", "bits_per_weight"}
    h_lazy, h_full = read_gguf_header(path, lazy=True), read_gguf_header(path)
    assert lazy.weights_bytes is not None and full.weights_bytes is not None
    # over by the header bytes not read (beyond their least) and the padding, never under
    over = h_full.data_offset - h_lazy.data_offset + 32 * h_full.tensor_count
    assert full.weights_bytes <= lazy.weights_bytes <= full.weights_bytes + over
    bpw = bits_per_weight(lazy.quantization)  # the file type's usual bits per weight
    assert bpw is not None and lazy.bits_per_weight == bpw
    assert lazy.active_parameters == lazy.parameters == round(lazy.weights_bytes * 8 / bpw)
    return lazy, full


def test_lazy_inspection_of_the_tiny_model_agrees_with_the_full_read(
    tiny: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the threshold under its 512 tokens, the tiny model (general.file_type first) is
    inspected without its vocabulary and tensor infos: its 1.7 MB of weights dwarf the 12 kB of
    header, so the estimates are close."""
    monkeypatch.setattr(_inspect._gguf_reader, "_LAZY_STRINGS", 100)
    assert read_gguf_header(tiny.gguf_path, lazy=True).unread is not None
    lazy, full = lazy_and_full(tiny.gguf_path)
    assert lazy.estimated
    assert lazy.weights_bytes == pytest.approx(full.weights_bytes, rel=0.01)
    assert lazy.parameters == pytest.approx(full.parameters, rel=0.01)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lazy_inspection_of_a_150k_vocabulary_agrees_with_the_full_read(
    big_vocab: dict[str, Path], layout: str
) -> None:
    path = big_vocab[layout]
    lazy, full = lazy_and_full(path)
    assert lazy.vocab_size == VOCAB and lazy.quantization == "Q8_0" and lazy.layers == 2
    assert full.parameters == 512 * 256 + 2 * (256 * 256 + 256)
    header = read_gguf_header(path, lazy=True)
    assert header.unread is not None  # the vocabulary's strings were not read
    if layout == "converter":  # stopped at the vocabulary: sizes from the file's, and said so
        assert not header.tensors_read and lazy.estimated
        # here the vocabulary is most of the file: the bound, not the weights, is what is checked
        assert full.weights_bytes is not None and lazy.weights_bytes is not None
        assert lazy.weights_bytes - full.weights_bytes < path.stat().st_size - full.weights_bytes
    elif layout == "quantize":  # general.file_type and the tensor infos found past the vocabulary
        assert header.tensors_read and header.unread_keys == 5 and lazy == full
    else:  # the shape is after the vocabulary, unread: the file is read whole
        assert _inspect._lazy_enough(header) is False and lazy == full


def test_a_vocabulary_before_a_moe_shape_is_read_whole(tmp_path: Path) -> None:
    """Active parameters need the expert tensors' names: no estimate from the file's size."""
    kv = {**LLAMA_KV, "{arch}.expert_count": 8, "{arch}.expert_used_count": 2}
    experts: list[Tensor] = [(f"blk.{i}.ffn_up_exps.weight", (8, 512, 256), 8) for i in range(2)]
    path = vocab_gguf(
        tmp_path / "moe.gguf", "converter", tokens=5000, merges=10, arch="qwen3moe", kv=kv,
        tensors=llama_tensors(8) + experts,
    )  # fmt: skip
    lazy, full = lazy_and_full(path)
    assert lazy == full and lazy.is_moe and full.active_parameters is not None
    assert full.parameters is not None and full.active_parameters < full.parameters


def test_a_split_gguf_estimates_only_the_part_holding_the_vocabulary(tmp_path: Path) -> None:
    tensors = llama_tensors(0, layers=3)
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama", split_max_tensors=2)
    for key, value in LLAMA_KV.items():
        w.add_uint32(key.replace("{arch}", "llama"), value)
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_token_list([f"tok{i}" for i in range(5000)])
    for name, shape, _ in tensors:
        w.add_tensor(name, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) == 4 and read_gguf_header(parts[0], lazy=True).unread is not None
    lazy, full = lazy_and_full(parts[0])
    assert lazy.estimated and lazy.files == full.files == tuple(str(p) for p in parts)


def test_a_150k_vocabulary_costs_little_more_than_the_tiny_model(
    tiny: TinyModel, big_vocab: dict[str, Path], reads: Reads
) -> None:
    """Selection needs the vocabulary's length, not its strings (issue 12). The work is counted in
    calls made (a string walked over is a call or more: its length prefix unpacked); the times are
    benchmarks/inspect_scaling.py's, each the first read of the file in a fresh process."""
    inspect_model(tiny.gguf_path)  # what is imported on first use, imported
    tiny_calls = calls_made(lambda: inspect_model(tiny.gguf_path))
    for layout in ("converter", "quantize"):  # the first read of each file
        big_calls = calls_made(lambda: inspect_model(big_vocab[layout]))  # noqa: B023 (used at once)
        assert big_calls < 10 * tiny_calls, (layout, big_calls, tiny_calls)
    # the full read walks all 250k strings, a call each, the file read in blocks (9 MB in ~30 reads)
    strings = VOCAB + MERGES
    reads.calls = 0
    full_calls = calls_made(lambda: _inspect._inspect_gguf(big_vocab["quantize"], lazy=False))
    assert strings <= full_calls < 2 * strings and reads.calls <= 64, (full_calls, reads)


# ---- Hugging Face directories ----------------------------------------------------------------


def write_hf(d: Path, config: dict[str, Any], tensors: dict[str, np.ndarray] | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        safetensors_numpy.save_file(tensors, str(d / "model.safetensors"))
    return d


BASE = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 8192,
}


def test_sharded_safetensors(tiny: TinyModel, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    d = tmp_path / "sharded"
    d.mkdir()
    shutil.copy(tiny.hf_dir / "config.json", d / "config.json")
    tensors = load_file(str(tiny.hf_dir / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i, chunk in enumerate((names[::2], names[1::2])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        safetensors_numpy.save_file({n: tensors[n] for n in chunk}, str(d / shard))
        weight_map.update(dict.fromkeys(chunk, shard))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    info = inspect_model(d)
    assert info.parameters == SIZES["small"].n_params and len(info.files) == 2
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="missing"):
        inspect_model(d)


def packed(rows: int, cols: int, bits: int) -> dict[str, np.ndarray]:
    """A GPTQ-style linear layer: int32 words of 32/bits weights, plus scales and zeros."""
    return {
        "model.layers.0.mlp.up_proj.qweight": np.zeros((rows * bits // 32, cols), np.int32),
        "model.layers.0.mlp.up_proj.scales": np.zeros((rows // 128, cols), np.float16),
        "model.layers.0.mlp.up_proj.qzeros": np.zeros((rows // 128, cols * bits // 32), np.int32),
        "model.embed_tokens.weight": np.zeros((512, 256), np.float16),
    }


@pytest.mark.parametrize(
    ("quant", "fmt", "name", "group"),
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "awq", "awq-4bit", 128),
        ({"quant_method": "gptq", "bits": 8, "group_size": 32}, "gptq", "gptq-8bit", 32),
        ({"quant_method": "fp8", "fmt": "e4m3"}, "fp8", "fp8", None),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g0": {"weights": {"num_bits": 4, "group_size": 64}}},
            },
            "compressed-tensors",
            "compressed-tensors-4bit",
            64,
        ),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes", "bitsandbytes-4bit", None),
        ({"quant_method": "mxfp4"}, "mxfp4", "mxfp4", 32),
        ({"quant_method": "exl2", "bits": 4.65}, "exl2", "exl2-4.65bit", None),
        ({"quant_method": "exl3", "bits": 3.0}, "exl3", "exl3-3bit", None),
    ],
)
def test_quantization_config(
    tmp_path: Path, quant: dict[str, Any], fmt: str, name: str, group: int | None
) -> None:
    info = inspect_model(write_hf(tmp_path / fmt, {**BASE, "quantization_config": quant}))
    assert (info.format, info.quantization, info.group_size) == (fmt, name, group)
    assert info.format == detect_format(tmp_path / fmt)
    assert info.layers == 2 and info.head_dim == 64 and info.parameters is None  # no weights: unknown


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_weights_are_unpacked(tmp_path: Path, bits: int) -> None:
    config = {**BASE, "quantization_config": {"quant_method": "gptq", "bits": bits, "group_size": 128}}
    info = inspect_model(write_hf(tmp_path / "g", config, packed(1024, 256, bits)))
    assert info.parameters == 1024 * 256 + 512 * 256
    assert info.weights_bytes is not None and info.bits_per_weight is not None
    assert bits < info.bits_per_weight < 16


def test_mlx(tmp_path: Path) -> None:
    tensors: dict[str, np.ndarray] = {
        "model.layers.0.mlp.up_proj.weight": np.zeros((1024, 256 * 4 // 32), np.uint32),
        "model.layers.0.mlp.up_proj.scales": np.zeros((1024, 256 // 64), np.float16),
        "model.layers.0.mlp.up_proj.biases": np.zeros((1024, 256 // 64), np.float16),
    }
    info = inspect_model(
        write_hf(tmp_path / "mlx", {**BASE, "quantization": {"bits": 4, "group_size": 64}}, tensors)
    )
    assert (info.format, info.quantization, info.group_size) == ("mlx", "mlx-4bit", 64)
    assert info.parameters == 1024 * 256 and info.bits_per_weight == pytest.approx(4.5)


def test_exl2_recognised_by_tensor_names(tmp_path: Path) -> None:
    tensors: dict[str, np.ndarray] = {
        "model.layers.0.self_attn.q_proj.q_weight": np.zeros((64, 256), np.int32),
        "model.layers.0.self_attn.q_proj.q_scale": np.zeros((8, 32), np.int32),
        "model.layers.0.self_attn.q_proj.q_groups": np.zeros((4,), np.int16),
        "model.embed_tokens.weight": np.zeros((512, 256), np.float16),
    }
    d = write_hf(tmp_path / "exl2", dict(BASE), tensors)
    assert detect_format(d) == "safetensors"  # no quant_method: only the tensor names tell
    info = inspect_model(d)
    assert info.format == "exl2" and info.quantization == "exl2"
    assert info.parameters is None and info.weights_bytes is not None  # bits unknown: not guessed
    (d / "config.json").write_text(json.dumps({**BASE, "quantization_config": {"bits": 8.0}}))
    info = inspect_model(d)
    assert info.quantization == "exl2-8bit" and info.parameters == 256 * 256 + 512 * 256


def test_moe_multimodal_hybrid_configs(tmp_path: Path) -> None:
    expert = np.zeros((64, 256), np.float16)
    tensors = {f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight": expert for e in range(8)}
    tensors["model.embed_tokens.weight"] = np.zeros((512, 256), np.float16)
    moe = {
        **BASE,
        "model_type": "mixtral",
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "torch_dtype": "bfloat16",
    }
    info = inspect_model(write_hf(tmp_path / "moe", moe, tensors))
    assert info.is_moe and info.experts_per_token == 2 and info.quantization == "f16"
    assert info.parameters == 8 * 64 * 256 + 512 * 256
    assert info.active_parameters == 2 * 64 * 256 + 512 * 256

    vlm = {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "text_config": BASE,
        "vision_config": {"hidden_size": 1024},
        "torch_dtype": "bfloat16",
    }
    info = inspect_model(write_hf(tmp_path / "vlm", vlm))
    assert info.multimodal and info.layers == 2 and info.kv_heads == 2 and info.quantization == "bf16"
    assert not info.hybrid_attention

    hybrid = {**BASE, "model_type": "gemma3_text", "layer_types": ["sliding_attention", "full_attention"]}
    assert inspect_model(write_hf(tmp_path / "hybrid", hybrid)).hybrid_attention
    jamba = {**BASE, "model_type": "custom", "attn_layer_period": 8}
    assert inspect_model(write_hf(tmp_path / "jamba", jamba)).hybrid_attention
    plain = inspect_model(write_hf(tmp_path / "plain", BASE))
    assert not (plain.hybrid_attention or plain.multimodal or plain.is_moe)


# ---- repo ids: the local cache only ----------------------------------------------------------


def test_repo_id_resolves_through_the_local_cache_only(
    tiny: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFound):
        inspect_model("unillm-test/not-cached")
    commit = "0" * 40
    repo = tmp_path / "models--unillm-test--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(tiny.hf_dir, repo / "snapshots" / commit)
    assert inspect_model("unillm-test/tiny").parameters == SIZES["small"].n_params


# ---- hostile files ---------------------------------------------------------------------------

_KEY = struct.pack("<Q", 1) + b"k"


def _gguf_bytes(n_tensors: int, n_kv: int, body: bytes) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + body


def _safetensors_bytes(header: bytes, length: int | None = None, payload: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header + payload


def _st_entry(shape: bytes) -> bytes:
    """A header of one F32 tensor of ``shape`` whose data is 4 bytes (the payload's size)."""
    return b'{"w": {"dtype": "F32", "shape": ' + shape + b', "data_offsets": [0, 4]}}'


_DEEP = b"[" * 200_000 + b"]" * 200_000
_GGUF_CASES: dict[str, bytes] = {
    "wrong magic": b"GGUG" + bytes(60),
    "version": b"GGUF" + struct.pack("<IQQ", 99, 0, 0),
    "truncated header": _gguf_bytes(0, 3, _KEY),
    "lying string length": _gguf_bytes(0, 1, struct.pack("<Q", 1 << 60)),
    "huge counts": _gguf_bytes(1 << 40, 1 << 40, b""),
    "tensors beyond the file": _gguf_bytes(100_000, 0, bytes(64)),
    "huge array": _gguf_bytes(0, 1, _KEY + struct.pack("<IIQ", 9, 8, 1 << 50)),
    "huge string array item": _gguf_bytes(0, 1, _KEY + struct.pack("<IIQQ", 9, 8, 2, 1 << 60)),
    "unknown value type": _gguf_bytes(0, 1, _KEY + struct.pack("<I", 77)),
    "huge tensor": _gguf_bytes(
        1, 0, _KEY + struct.pack("<I", 4) + struct.pack("<4Q", *[1 << 20] * 4) + bytes(12)
    ),
    "too many dims": _gguf_bytes(1, 0, _KEY + struct.pack("<I", 1000) + bytes(40)),
}
_ST_CASES: dict[str, bytes] = {
    "huge header length": _safetensors_bytes(b"{}", length=1 << 62),
    "header past the end": _safetensors_bytes(b"{}", length=5000),
    "not json": _safetensors_bytes(b"{nope"),
    "deep nesting": _safetensors_bytes(_DEEP),
    "not an object": _safetensors_bytes(b"[1, 2]"),
    "offsets past payload": _safetensors_bytes(
        b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1000000]}}'
    ),
    "negative shape": _safetensors_bytes(b'{"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 0]}}'),
    "huge shape": _safetensors_bytes(b'{"w": {"dtype": "F32", "shape": [1e300], "data_offsets": [0, 0]}}'),
    "reversed offsets": _safetensors_bytes(
        b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}', payload=bytes(4)
    ),
    "entry not a dict": _safetensors_bytes(b'{"w": 3}'),
    # a list as a dimension once multiplied into a list of 10^8 items, then raised TypeError
    "nested shape": _safetensors_bytes(_st_entry(b"[[1], 100000000]")),
    "nested shape, 2^40": _safetensors_bytes(_st_entry(b"[[1], 1099511627776]")),  # once MemoryError
    "bool dimension": _safetensors_bytes(_st_entry(b"[true, 4]")),
    "float dimension": _safetensors_bytes(_st_entry(b"[4.0]")),
    "string dimension": _safetensors_bytes(_st_entry(b'["4"]')),
    "product over 2^50": _safetensors_bytes(_st_entry(b"[1048576, 1048576, 1048576]")),
    "too many dimensions": _safetensors_bytes(_st_entry(b"[1, 1, 1, 1, 1, 1, 1, 1, 1]")),
    "nested offsets": _safetensors_bytes(
        b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [[0], [4]]}}'
    ),
    "bool offsets": _safetensors_bytes(
        b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [false, true]}}'
    ),
    "negative offset": _safetensors_bytes(b'{"w": {"dtype": "F32", "shape": [0], "data_offsets": [-4, 0]}}'),
    "span unlike the shape": _safetensors_bytes(_st_entry(b"[1024]"), payload=bytes(4)),
    "dtype not a string": _safetensors_bytes(b'{"w": {"dtype": 7, "shape": [1], "data_offsets": [0, 4]}}'),
    "huge integer": _safetensors_bytes(_st_entry(b"[1" + b"0" * 5000 + b"]")),
    "NaN dimension": _safetensors_bytes(_st_entry(b"[NaN]")),
    "Infinity in the metadata": _safetensors_bytes(
        b'{"__metadata__": {"a": Infinity}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
        payload=bytes(4),
    ),
    "float overflowing": _safetensors_bytes(_st_entry(b"[1e999]")),
    "not UTF-8": _safetensors_bytes(b'{"\xff": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'),
}
_CONFIG_CASES: dict[str, tuple[str, bytes]] = {
    "deep config": ("config.json", b'{"a": ' + _DEEP + b"}"),
    "config not an object": ("config.json", b"[]"),
    "config not json": ("config.json", b"\xff\xfe{"),
    "config not UTF-8": ("config.json", b'{"model_type": "caf\xe9"}'),
    "config in UTF-16": ("config.json", json.dumps(BASE).encode("utf-16")),
    "config a string": ("config.json", b'"llama"'),
    "config a number": ("config.json", b"7"),
    "config with a 5000-digit int": ("config.json", b'{"vocab_size": 1' + b"0" * 5000 + b"}"),
    "config with a 5000-digit float": ("config.json", b'{"eps": 0.' + b"1" * 5000 + b"}"),
    "config nested 100k deep in an object": (
        "config.json",
        b'{"a": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001,
    ),
    "deep index": ("model.safetensors.index.json", b'{"weight_map": ' + _DEEP + b"}"),
    "index escapes": ("model.safetensors.index.json", b'{"weight_map": {"w": "../../etc/passwd"}}'),
    "index without map": ("model.safetensors.index.json", b'{"weight_map": []}'),
}


def _hostile_cases() -> list[tuple[str, Callable[[Path], Path]]]:
    cases: list[tuple[str, Callable[[Path], Path]]] = []

    def file(name: str, data: bytes) -> Callable[[Path], Path]:
        def make(tmp: Path) -> Path:
            (tmp / name).write_bytes(data)
            return tmp / name

        return make

    def directory(name: str, data: bytes) -> Callable[[Path], Path]:
        def make(tmp: Path) -> Path:
            (tmp / "config.json").write_text(json.dumps(BASE))
            (tmp / name).write_bytes(data)
            return tmp

        return make

    cases += [(f"gguf: {k}", file("m.gguf", v)) for k, v in _GGUF_CASES.items()]
    cases += [(f"safetensors: {k}", directory("model.safetensors", v)) for k, v in _ST_CASES.items()]
    cases += [(f"hf: {k}", directory(n, v)) for k, (n, v) in _CONFIG_CASES.items()]
    return cases


@pytest.mark.parametrize(("label", "make"), _hostile_cases(), ids=[c[0] for c in _hostile_cases()])
def test_hostile_files_raise_typed_errors_quickly_without_allocating(
    tmp_path: Path, label: str, make: Callable[[Path], Path], reads: Reads
) -> None:
    path = make(tmp_path)
    tracemalloc.start()
    try:
        with pytest.raises(ModelFormatError), Calls() as calls:
            inspect_model(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # quickly: a few hundred calls and a few reads (counted, not timed), never a loop over what
    # the file claims (10^5 tensors, 2^40 keys, 10^8 items)
    assert calls.n < 5000 and reads.calls <= 8, f"{label}: {calls.n} calls, {reads}"
    # the deep-nesting cases hold their own 400 kB input; nothing may approach what was claimed
    assert peak < 16 * 2**20, f"{label}: {peak} bytes"


def test_safetensors_header_over_100_mb_is_refused_unread(tmp_path: Path) -> None:
    d = write_hf(tmp_path / "big", BASE)
    with (d / "model.safetensors").open("wb") as f:
        f.write(_safetensors_bytes(b"{", length=150 * 2**20))
        f.truncate(200 * 2**20)  # sparse: the claimed header is there, and never read
    tracemalloc.start()
    try:
        with pytest.raises(ModelFormatError, match="header length"):
            inspect_model(d)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20


def test_config_json_over_16_mib_is_refused_unread(tmp_path: Path) -> None:
    d = write_hf(tmp_path / "big", BASE)
    with (d / "config.json").open("r+b") as f:
        f.truncate(17 * 2**20)  # sparse
    tracemalloc.start()
    try:
        with pytest.raises(ModelFormatError, match="larger than 16 MiB"):
            inspect_model(d)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 17 * 2**20  # reads one byte past the cap, never the whole file


def test_a_million_digit_int_is_refused_fast_even_with_the_int_guard_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # sys.set_int_max_str_digits(0) lifts CPython's guard: converting 10^6 digits then takes seconds
    converted: list[int] = []  # the digits of every int the JSON reader converts

    def int_(text: str, *base: int) -> int:
        converted.append(len(text))
        return int(text, *base)

    monkeypatch.setattr(_inspect._json, "int", int_, raising=False)  # the builtin, in _json only
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        d = write_hf(tmp_path / "digits", BASE)
        (d / "config.json").write_bytes(b'{"vocab_size": ' + b"7" * 1_000_000 + b"}")
        with pytest.raises(ModelFormatError, match="an integer of 1000000 digits"):
            inspect_model(d)
    finally:
        sys.set_int_max_str_digits(limit)
    assert max(converted, default=0) <= _inspect._json._MAX_NUMBER_CHARS  # refused before converting


def test_json_numbers_real_configs_use_are_read(tmp_path: Path) -> None:
    config = {**BASE, "rope_theta": 1e6, "eps": 1e-05, "init": 0.02, "model_max_length": 10**30}
    info = inspect_model(write_hf(tmp_path / "ok", config))
    assert info.layers == 2 and info.context_length == 8192
    # not JSON, but what Mamba2 and Nemotron-H configs hold (transformers writes them so)
    nemotron = {**BASE, "model_type": "nemotron_h", "time_step_limit": [0.0, float("inf")], "x": float("nan")}
    (tmp_path / "ok" / "config.json").write_text(json.dumps(nemotron))
    assert b"Infinity" in (tmp_path / "ok" / "config.json").read_bytes()
    info = inspect_model(tmp_path / "ok")
    assert info.layers == 2 and info.hybrid_attention
    for junk in (float("nan"), float("inf"), 1e308 * 10):  # where a number is read: ignored
        (tmp_path / "ok" / "config.json").write_text(json.dumps({**BASE, "num_hidden_layers": junk}))
        assert inspect_model(tmp_path / "ok").layers is None
    (tmp_path / "ok" / "config.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(BASE).encode())  # a BOM
    assert inspect_model(tmp_path / "ok").layers == 2


_NESTED: list[Any] = [1]
for _ in range(600):  # deep, but within what json.loads accepts
    _NESTED = [_NESTED]


@pytest.mark.parametrize("junk", [None, True, -1, 2**70, 1.5, "x", [], [[1]], {"a": 1}, _NESTED])
def test_config_values_of_the_wrong_type_are_ignored(tmp_path: Path, junk: object) -> None:
    keys = [*BASE, "architectures", "layer_types", "quantization_config", "text_config", "torch_dtype"]
    keys += ["num_local_experts", "num_experts_per_tok", "head_dim", "vision_config", "multi_query"]
    config = {k: junk for k in keys}
    try:
        info = inspect_model(write_hf(tmp_path / "junk", config))
    except ModelFormatError:
        return
    assert info.layers is None or isinstance(info.layers, int)


def test_truncated_weights_are_reported(tiny: TinyModel, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    data = tiny.gguf_path.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFormatError, match="truncated"):
        inspect_model(cut)
    d = tmp_path / "hf"
    shutil.copytree(tiny.hf_dir, d)
    st = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(st[: len(st) // 2])
    with pytest.raises(ModelFormatError, match="truncated"):
        inspect_model(d)


def test_mutated_gguf_headers_never_escape_as_other_errors(tiny: TinyModel, tmp_path: Path) -> None:
    """Random byte flips in the header: an answer or ModelFormatError, never struct.error & co."""
    data = bytearray(tiny.gguf_path.read_bytes()[:60_000])  # header and the first tensors
    header_end = read_gguf_header(tiny.gguf_path).data_offset
    rng = random.Random(7)
    path = tmp_path / "m.gguf"
    for _ in range(150):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(4, min(header_end, len(data)))] = rng.randrange(256)
        path.write_bytes(bytes(mutated))
        with contextlib.suppress(ModelFormatError):
            inspect_model(path)


def test_missing_things(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound):
        inspect_model(tmp_path / "absent.gguf")
    with pytest.raises(ModelNotFound):
        inspect_model("./not/here")
    with pytest.raises(ModelFormatError, match=r"without config\.json"):
        inspect_model(tmp_path)
