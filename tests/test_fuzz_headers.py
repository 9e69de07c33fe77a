"""Fuzzing the header readers: whatever a model file holds, a reader returns or raises a
``UnillmError``, within a second.

Seeds are the tiny model's own GGUF header, safetensors header and config.json, and a GGUF with a
5,000-token vocabulary laid out as llama-quantize writes one (general.file_type after it), which
inspection's lazy read steps over to find the key. Hypothesis mutates them (byte flips,
truncations, large values written over length and count fields, splices, hostile JSON tokens) and
builds hostile headers from scratch. Every GGUF is read whole and lazily. CI runs a bounded,
derandomized number of examples; ``scripts/fuzz.sh`` drives the same mutators through many more,
in subprocesses with a memory limit. ``UNILLM_FUZZ_EXAMPLES`` sets the examples per test here.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from unillm import UnillmError, detect_format, inspect_model
from unillm._inspect import read_gguf_header

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

EXAMPLES = int(os.environ.get("UNILLM_FUZZ_EXAMPLES", "200"))
SLOWEST_S = 1.0  # generous: a header read takes milliseconds, a hostile one must not take more
FUZZ = hypothesis.settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,  # timed below against SLOWEST_S, per call, so a busy machine does not flake it
    database=None,
    suppress_health_check=list(hypothesis.HealthCheck),
)


# ---- seeds and targets ----------------------------------------------------------------------


@dataclass(frozen=True)
class Seeds:
    """The tiny model's headers, and the offsets and widths of the GGUF's length and count fields."""

    gguf: bytes  # the header, up to the tensor data
    gguf_size: int  # the whole file: a mutated header is padded back to it (sparse)
    gguf_fields: tuple[tuple[int, int], ...]
    safetensors: bytes  # the 8-byte length and the JSON header
    safetensors_size: int
    config: bytes
    safetensors_path: Path
    vocab: bytes = b""  # the large-vocabulary GGUF's header, its size and fields
    vocab_size: int = 0
    vocab_fields: tuple[tuple[int, int], ...] = ()


def load_seeds(model_dir: Path) -> Seeds:
    """Seeds from a tiny model built with ``unillm.testing.build_tiny_model(model_dir)``."""
    from unillm.testing import build_tiny_model

    tiny = build_tiny_model(model_dir, "small")
    header = read_gguf_header(tiny.gguf_path)
    data = tiny.gguf_path.read_bytes()[: header.data_offset]
    st_path = tiny.hf_dir / "model.safetensors"
    with st_path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        st_header = n.to_bytes(8, "little") + f.read(n)
    vocab_path = vocab_gguf(model_dir / "vocab.gguf")
    vocab = vocab_path.read_bytes()[: read_gguf_header(vocab_path).data_offset]
    return Seeds(
        gguf=data,
        gguf_size=tiny.gguf_path.stat().st_size,
        gguf_fields=tuple(gguf_fields(data)),
        safetensors=st_header,
        safetensors_size=st_path.stat().st_size,
        config=(tiny.hf_dir / "config.json").read_bytes(),
        safetensors_path=st_path,
        vocab=vocab,
        vocab_size=vocab_path.stat().st_size,
        vocab_fields=tuple(gguf_fields(vocab)),
    )


def vocab_gguf(path: Path, tokens: int = 5000) -> Path:
    """A GGUF whose vocabulary is long enough for the lazy read to stop at, with general.file_type
    after it (llama-quantize's layout) and two small tensors."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_context_length(4096)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(tokens)])
    w.add_token_types([1] * tokens)
    w.add_token_merges([f"t{i} t{i + 1}" for i in range(64)])
    w.add_bos_token_id(1)
    w.add_quantization_version(2)
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.add_tensor("output_norm.weight", np.zeros(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_WIDTHS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF scalar types


def gguf_fields(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of every count, length and type field of a well-formed GGUF header."""
    out = [(4, 4), (8, 8), (16, 8)]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def field(width: int) -> int:
        nonlocal pos
        out.append((pos, width))
        value = int.from_bytes(data[pos : pos + width], "little")
        pos += width
        return value

    def skip(n: int) -> None:  # not `pos += field(...)`: that adds to pos as it was before the field
        nonlocal pos
        pos += n

    def value(vtype: int) -> None:
        if vtype == 8:
            skip(field(8))
        elif vtype == 9:
            etype, n = field(4), field(8)
            for _ in range(n):
                value(etype)
        else:
            skip(_WIDTHS[vtype])

    for _ in range(n_kv):
        skip(field(8))
        value(field(4))
    for _ in range(n_tensors):
        skip(field(8))
        skip(8 * field(4))
        field(4)
        field(8)
    return out


Target = Callable[[Path, bytes, Seeds], list[Callable[[], object]]]


def gguf_target(d: Path, data: bytes, seeds: Seeds, size: int | None = None) -> list[Callable[[], object]]:
    path = d / "m.gguf"
    with path.open("wb") as f:
        f.write(data)
        f.truncate(max(len(data), seeds.gguf_size if size is None else size))  # the data, as a hole
    return [
        lambda: read_gguf_header(path),
        lambda: read_gguf_header(path, lazy=True),
        lambda: inspect_model(path),  # lazy, and whole where the lazy read does not suffice
    ]


def vocab_target(d: Path, data: bytes, seeds: Seeds) -> list[Callable[[], object]]:
    return gguf_target(d, data, seeds, seeds.vocab_size)


def safetensors_target(d: Path, data: bytes, seeds: Seeds) -> list[Callable[[], object]]:
    (d / "config.json").write_bytes(seeds.config)
    with (d / "model.safetensors").open("wb") as f:
        f.write(data)
        f.truncate(max(len(data), seeds.safetensors_size))
    return [lambda: inspect_model(d)]


def config_target(d: Path, data: bytes, seeds: Seeds) -> list[Callable[[], object]]:
    (d / "config.json").write_bytes(data)
    weights = d / "model.safetensors"
    if not weights.is_symlink():
        weights.unlink(missing_ok=True)
        weights.symlink_to(seeds.safetensors_path)
    return [lambda: detect_format(d), lambda: inspect_model(d)]


JSON_AT = {"gguf": None, "gguf-vocab": None, "safetensors": 8, "config": 0}  # where JSON starts
TARGETS: dict[str, tuple[Target, Callable[[Seeds], bytes]]] = {
    "gguf": (gguf_target, lambda s: s.gguf),
    "gguf-vocab": (vocab_target, lambda s: s.vocab),
    "safetensors": (safetensors_target, lambda s: s.safetensors),
    "config": (config_target, lambda s: s.config),
}
FIELDS: dict[str, Callable[[Seeds], tuple[tuple[int, int], ...]]] = {
    "gguf": lambda s: s.gguf_fields,
    "gguf-vocab": lambda s: s.vocab_fields,
}


def check(calls: Sequence[Callable[[], object]]) -> float:
    """Run each reader: an answer or a ``UnillmError``, anything else propagates. The slowest call's
    seconds."""
    slowest = 0.0
    for call in calls:
        t0 = time.perf_counter()
        with contextlib.suppress(UnillmError):
            call()
        slowest = max(slowest, time.perf_counter() - t0)
    return slowest


# ---- mutators (shared with scripts/fuzz.sh) --------------------------------------------------


def _large(width: int, size: int) -> list[int]:
    top = 1 << (8 * width)
    values = [0, 1, top - 1, top >> 1, (top >> 1) - 1, size, size + 1, 2 * size, size // 2]
    values += [1 << k for k in (7, 8, 15, 16, 20, 24, 31, 32, 40, 50, 60, 63)]
    values += [7, 8, 9, 13, 24, 100]  # GGUF's bool, string and array types; an unknown type
    return [v % top for v in values]


_JSON_TOKENS = [
    b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"1" * 5000, b"0." + b"1" * 1000,
    b"[" * 5000, b"{" * 3000, b'"\\ud800"', b"\xff\xfe", b"\x00", b"true", b"null", b"[[1], 100000000]",
    b"[[1], 1099511627776]", b"[-1]", b"[1e300]", b"[true]", b'{"a": 1, "a": 2}', b"9" * 400,
]  # fmt: skip


_HOSTILE_VALUES: list[Any] = [
    [[1], 100000000], [[1], 2**40], [True, 4], [4.0], ["4"], [-1], [2**64], [2**40, 2**40, 2**40],
    [0, 2**70], [[0], [4]], [False, True], 1e300, float("nan"), float("inf"), -1, 2**64, 10**4000,
    None, {}, [], True, "x" * 1000, "F32", [1] * 9, {"a": [{"b": []}]}, [[[[[[[[1]]]]]]]],
]  # fmt: skip


def mutate_json(data: bytes, rng: random.Random) -> bytes:
    """``data`` (JSON) with one value somewhere inside replaced by a hostile one; ``data`` itself
    when it is not JSON."""
    try:
        root = json.loads(data)
    except (ValueError, RecursionError):  # a mutant of a mutant may be neither
        return data
    parent: Any = None
    key: Any = None
    node = root
    for _ in range(rng.choice((1, 2, 2, 3, 3, 4))):  # down a random path: a tensor's shape is at 2
        if isinstance(node, dict) and node:
            parent, key = node, rng.choice(list(node))
        elif isinstance(node, list) and node:
            parent, key = node, rng.randrange(len(node))
        else:
            break
        node = parent[key]
    value = rng.choice(_HOSTILE_VALUES)
    if parent is None:
        root = value
    else:
        parent[key] = value
    try:
        return json.dumps(root).encode()
    except RecursionError:
        return data


def mutate(
    data: bytes, rng: random.Random, fields: Sequence[tuple[int, int]] = (), json_at: int | None = None
) -> bytes:
    """``data`` after one to four random mutations. ``fields`` are (offset, width) of length and
    count fields, which the "large" mutation prefers; JSON from ``json_at`` on is also mutated as
    JSON (a value replaced), its length prefix (if any) kept right."""
    if json_at is not None and rng.random() < 0.4:  # still JSON, so the checks of its values run
        text = data[json_at:]
        for _ in range(rng.randint(1, 2)):
            text = mutate_json(text, rng)
        return (len(text).to_bytes(8, "little") if json_at == 8 else data[:json_at]) + text
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        at = rng.randrange(len(out) + 1)
        if op == 0:  # byte flips
            for _ in range(rng.randint(1, 8)):
                if out:
                    out[rng.randrange(len(out))] = rng.randrange(256)
        elif op == 1:  # truncation
            del out[at:]
        elif op in (2, 3):  # a large value over a length or count field, or anywhere
            offset, width = rng.choice(fields) if fields and op == 2 else (at, rng.choice((1, 2, 4, 8)))
            value = rng.choice(_large(width, len(out)))
            out[offset : offset + width] = value.to_bytes(width, "little")
        elif op == 4:  # a chunk repeated
            n = rng.randint(1, 64)
            out[at:at] = out[max(0, at - n) : at] * rng.randint(1, 64)
        elif op == 5:  # a chunk deleted
            del out[at : at + rng.randint(1, 256)]
        elif op == 6:  # a hostile JSON token
            out[at : at + rng.randint(0, 16)] = rng.choice(_JSON_TOKENS)
        elif out:  # one bit
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


# ---- structured hostile headers -------------------------------------------------------------

_COUNTS = st.one_of(st.integers(0, 8), st.sampled_from([2**16, 2**20, 2**31, 2**32, 2**63, 2**64 - 1]))
_JSON_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),  # NaN and infinities included: json.dumps writes them, the reader must refuse
    st.text(max_size=8),
)
_JSON = st.recursive(
    _JSON_LEAVES,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=4),
    max_leaves=20,
)


@st.composite
def gguf_headers(draw: Any) -> bytes:
    """A GGUF header whose every count, length, type and value may lie."""

    def u32(v: int) -> bytes:
        return (v % 2**32).to_bytes(4, "little")

    def u64(v: int) -> bytes:
        return (v % 2**64).to_bytes(8, "little")

    def string() -> bytes:
        raw = draw(st.binary(max_size=12))
        return u64(draw(st.one_of(st.just(len(raw)), _COUNTS))) + raw

    def value(vtype: int, depth: int = 0) -> bytes:
        if vtype == 8:
            return string()
        if vtype == 9 and depth == 0:
            etype = draw(st.integers(0, 14))
            items = draw(st.lists(st.just(0), max_size=6))
            n = draw(st.one_of(st.just(len(items)), _COUNTS))
            return u32(etype) + u64(n) + b"".join(value(etype, 1) for _ in items)
        width = _WIDTHS.get(vtype)
        if width is not None and draw(st.integers(0, 4)):  # mostly the right size: parsing goes on
            return draw(st.binary(min_size=width, max_size=width))
        return draw(st.binary(max_size=9))

    kvs = []
    for _ in range(draw(st.integers(0, 6))):
        vtype = draw(st.one_of(st.integers(0, 13), st.integers(0, 2**32 - 1)))
        kvs.append(string() + u32(vtype) + value(vtype))
    tensors = []
    for _ in range(draw(st.integers(0, 4))):
        dims = draw(st.lists(st.one_of(st.integers(0, 4096), _COUNTS), max_size=10))
        n_dims = draw(st.one_of(st.just(len(dims)), _COUNTS))
        ttype, offset = draw(st.integers(0, 50)), draw(st.one_of(st.integers(0, 4096), _COUNTS))
        tensors.append(string() + u32(n_dims) + b"".join(map(u64, dims)) + u32(ttype) + u64(offset))
    version = draw(st.sampled_from([3, 3, 3, 2, 1, 4, 2**32 - 1]))
    n_tensors = draw(st.one_of(st.just(len(tensors)), _COUNTS))
    n_kv = draw(st.one_of(st.just(len(kvs)), _COUNTS))
    body = b"".join(kvs) + b"".join(tensors) + draw(st.binary(max_size=64))
    return b"GGUF" + u32(version) + u64(n_tensors) + u64(n_kv) + body


@st.composite
def safetensors_headers(draw: Any) -> bytes:
    """A safetensors header of tensors whose dtype, shape and offsets may be anything JSON holds;
    mostly each field is at least of the right type, so that the checks of its items are reached."""

    def mostly(right: Any, wrong: Any) -> Any:
        return draw(wrong if draw(st.integers(0, 4)) == 0 else right)

    ints = st.one_of(st.integers(0, 2**20), st.integers(-(2**64), 2**64))
    dims = st.one_of(ints, st.lists(st.integers(0, 8), min_size=1, max_size=2), st.booleans(), _JSON)
    header: dict[str, Any] = {}
    for i in range(draw(st.integers(1, 4))):
        header[f"t{i}"] = {
            "dtype": mostly(st.sampled_from(["F32", "BF16", "U8", "F4", "F8_E4M3"]), _JSON),
            "shape": mostly(st.lists(dims, max_size=10), _JSON),
            "data_offsets": mostly(st.lists(ints, min_size=2, max_size=2), st.lists(dims, max_size=3)),
        }
    if draw(st.booleans()):
        header["__metadata__"] = draw(_JSON)
    raw = json.dumps(header).encode()
    return (mostly(st.just(len(raw)), _COUNTS) % 2**64).to_bytes(8, "little") + raw


@st.composite
def configs(draw: Any) -> bytes:
    """A config.json whose known keys hold anything JSON holds, NaN and infinities included."""
    keys = [
        "model_type", "architectures", "num_hidden_layers", "hidden_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "torch_dtype",
        "quantization_config", "quantization", "text_config", "layer_types", "num_local_experts",
        "num_experts_per_tok", "vision_config", "multi_query",
    ]  # fmt: skip
    config = draw(st.dictionaries(st.sampled_from(keys), _JSON, max_size=10))
    if draw(st.booleans()):
        config["quantization_config"] = draw(
            st.dictionaries(st.sampled_from(["quant_method", "bits", "group_size", "config_groups"]), _JSON)
        )
    return json.dumps(config).encode()


# ---- the tests ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> Seeds:
    return load_seeds(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def test_the_seeds_are_read_whole(seeds: Seeds, work: Path) -> None:
    """Unmutated, every seed is a model: the mutations start from valid headers."""
    for name, (target, seed) in TARGETS.items():
        d = work / f"seed-{name}"
        d.mkdir()
        for call in target(d, seed(seeds), seeds):
            call()
    assert len(seeds.gguf_fields) > 700  # every key, value, string and tensor field
    lazy = read_gguf_header(work / "seed-gguf-vocab" / "m.gguf", lazy=True)
    assert lazy.unread is not None and lazy.tensors_read  # general.file_type found past the vocabulary


@pytest.mark.parametrize("name", list(TARGETS))
@FUZZ
@hypothesis.given(rng=st.randoms(use_true_random=False))
def test_mutated_headers_raise_only_typed_errors(
    seeds: Seeds, work: Path, name: str, rng: random.Random
) -> None:
    target, seed = TARGETS[name]
    d = work / f"mutated-{name}"
    d.mkdir(exist_ok=True)
    fields = FIELDS[name](seeds) if name in FIELDS else ()
    assert check(target(d, mutate(seed(seeds), rng, fields, JSON_AT[name]), seeds)) < SLOWEST_S


@pytest.mark.parametrize(
    ("name", "headers"),
    [("gguf", gguf_headers()), ("safetensors", safetensors_headers()), ("config", configs())],
)
@FUZZ
@hypothesis.given(data=st.data())
def test_generated_hostile_headers_raise_only_typed_errors(
    seeds: Seeds, work: Path, name: str, headers: Any, data: Any
) -> None:
    target, _ = TARGETS[name]
    d = work / f"generated-{name}"
    d.mkdir(exist_ok=True)
    assert check(target(d, data.draw(headers), seeds)) < SLOWEST_S
