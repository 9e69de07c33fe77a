"""Inspection reads headers only: its cost must not grow with the size of the weights, nor much
with the size of the vocabulary.

Weights: two GGUFs with the same header layout, the ~50 MB tiny bench model and a sparse copy whose
tensor infos claim ~800x larger tensors (~40 GB of weights) while the data is a hole in the file.
Contenders: ``inspect_model``, ``detect_format`` and inspect + plan + select on each file.

Vocabulary: the small tiny model (512 tokens) against a GGUF written with gguf's GGUFWriter holding
a 150k-token vocabulary and 100k merges around tiny tensors. ``inspect_model`` is timed warm (the
file read before in this process: the ends of its long string arrays are remembered) and cold (as
the first read of the file in a process: the length prefixes of all 250k strings are walked).

Each contender is timed in interleaved rounds (A, B, A, B, ... with the first rotating), every
sample the mean of ``--calls`` calls; medians of ``--runs`` (>= 9) rounds.

Goals: t(40 GB) / t(40 MB) <= 1.2 for inspect_model and for inspect + plan + select (issue 7);
t(150k vocabulary, warm) / t(tiny) <= 10 (issue 12). The cold ratio is reported, without a goal:
walking 250k length prefixes in Python takes tens of milliseconds.

    python benchmarks/inspect_scaling.py [--runs 15] [--calls 20] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import machine

SCALE = 800  # rows of every 2-D tensor x SCALE: ~50 MB -> ~40 GB
VOCAB, MERGES = 150_000, 100_000


def big_vocab_gguf(path: Path) -> Path:
    """A GGUF as llama.cpp's converter writes one, with a ``VOCAB``-token vocabulary and ``MERGES``
    merges, keys after them, and tiny tensors."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_context_length(4096)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(VOCAB)])
    w.add_token_merges([f"t{i} k{i}" for i in range(MERGES)])
    w.add_bos_token_id(1)
    w.add_chat_template("{{ messages }}")
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def sparse_copy(src: Path, dst: Path, scale: int) -> int:
    """Copy ``src``'s header with every 2-D tensor ``scale`` x taller and the offsets redone; the
    data becomes a hole. The header keeps its exact length. Returns the claimed file size."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    alignment = 32
    field = reader.fields.get("general.alignment")
    if field is not None:
        alignment = int(field.parts[field.data[0]][0])
    header = bytearray(src.read_bytes()[: reader.data_offset])
    offset = 0
    for t in reader.tensors:
        f = t.field  # parts: name length, name, n_dims, dims, type, offset
        dims_at = f.offset + 8 + len(bytes(f.parts[1])) + 4
        n_dims = int(f.parts[2][0])
        dims = [int(d) for d in f.parts[3]]
        if n_dims == 2:
            dims[1] *= scale
        header[dims_at : dims_at + 8 * n_dims] = b"".join(d.to_bytes(8, "little") for d in dims)
        offset_at = dims_at + 8 * n_dims + 4
        header[offset_at : offset_at + 8] = offset.to_bytes(8, "little")
        per_block, block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        elements = 1
        for d in dims:
            elements *= d
        offset += (elements // per_block * block_bytes + alignment - 1) // alignment * alignment
    size = reader.data_offset + offset
    with dst.open("wb") as out:
        out.write(header)
        out.truncate(size)
    return size


def sample(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15, help="interleaved rounds (median reported; >= 9)")
    ap.add_argument("--calls", type=int, default=20, help="calls averaged into one sample")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.runs < 9:
        ap.error("--runs must be at least 9")

    from unillm import Workload, _inspect, backends, detect_hardware, plan, select
    from unillm._inspect import detect_format, inspect_model
    from unillm.testing import tiny_model

    # What auto_engine does before loading, less the I/O done once per process (hardware
    # detection, the backends' availability): inspect, plan, select.
    hw = detect_hardware()
    registered = backends()
    available = {n: b.availability() for n, b in registered.items()}
    workload = Workload()

    def inspect_and_select(path: Path) -> object:
        info = inspect_model(path)
        return select(hw, info, workload, registered, available=available, plan=plan(info, hw, workload))

    def cold(path: Path) -> object:
        _inspect._STRING_RUNS.clear()  # as if this were the process's first read of the file
        return inspect_model(path)

    small = tiny_model("bench").gguf_path
    tiny = tiny_model("small").gguf_path
    with tempfile.TemporaryDirectory() as tmp:
        big = Path(tmp) / "sparse-40gb.gguf"
        sparse_copy(small, big, SCALE)
        vocab = big_vocab_gguf(Path(tmp) / "vocab-150k.gguf")
        # a file changed in the last seconds is not remembered (it may change again): let it settle
        time.sleep(max(0.0, _inspect._SETTLED_S + 0.1 - (time.time() - vocab.stat().st_ctime)))
        info_small, info_big = inspect_model(small), inspect_model(big)
        assert info_small.weights_bytes is not None and info_big.weights_bytes is not None
        assert inspect_model(vocab).vocab_size == VOCAB
        contenders: dict[str, Callable[[], object]] = {
            "inspect_model 40 MB": lambda: inspect_model(small),
            "inspect_model 40 GB": lambda: inspect_model(big),
            "detect_format 40 MB": lambda: detect_format(small),
            "detect_format 40 GB": lambda: detect_format(big),
            "inspect+select 40 MB": lambda: inspect_and_select(small),
            "inspect+select 40 GB": lambda: inspect_and_select(big),
            "inspect_model tiny": lambda: inspect_model(tiny),
            "inspect_model 150k vocab": lambda: inspect_model(vocab),
            "inspect_model 150k vocab, cold": lambda: cold(vocab),
        }
        for fn in contenders.values():  # warm the page cache and the imports
            fn()
        samples: dict[str, list[float]] = {k: [] for k in contenders}
        names = list(contenders)
        for r in range(args.runs):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                samples[name].append(sample(contenders[name], args.calls))
        on_disk = big.stat().st_blocks * 512

    ms = {k: statistics.median(v) * 1000 for k, v in samples.items()}
    ratios = {
        what: ms[f"{what} 40 GB"] / ms[f"{what} 40 MB"]
        for what in ("inspect_model", "detect_format", "inspect+select")
    }
    vocab_ratios = {
        what: ms[f"inspect_model 150k vocab{what}"] / ms["inspect_model tiny"] for what in ("", ", cold")
    }
    mb, gb = info_small.weights_bytes / 1e6, info_big.weights_bytes / 1e9
    print(f"small: {small} ({small.stat().st_size / 1e6:.1f} MB file, {mb:.1f} MB weights)")
    print(f"big:   sparse copy claiming {gb:.1f} GB of weights ({on_disk / 1e6:.2f} MB on disk)")
    print(f"medians of {args.runs} interleaved rounds, each the mean of {args.calls} calls:")
    for name, value in ms.items():
        print(f"  {name:31s} {value:8.3f} ms")
    for what, ratio in ratios.items():
        verdict = "ok" if ratio <= 1.2 else "OVER GOAL"
        print(f"  ratio {what:14s} t(40 GB) / t(40 MB) = {ratio:.3f}  (goal <= 1.2: {verdict})")
    verdict = "ok" if vocab_ratios[""] <= 10 else "OVER GOAL"
    print(f"  ratio inspect_model t(150k vocab) / t(tiny) = {vocab_ratios['']:.2f}  (goal <= 10: {verdict})")
    print(f"  ratio inspect_model t(150k vocab, cold) / t(tiny) = {vocab_ratios[', cold']:.1f}  (no goal)")
    if args.json:
        result = {
            "benchmark": "inspect_scaling",
            "machine": machine(),
            "runs": args.runs,
            "calls_per_sample": args.calls,
            "small_weights_bytes": info_small.weights_bytes,
            "big_weights_bytes": info_big.weights_bytes,
            "median_ms": ms,
            "ratio": ratios,
            "goal": 1.2,
            "vocab": {"tokens": VOCAB, "merges": MERGES, "ratio_to_tiny": vocab_ratios, "goal": 10},
            "samples_ms": {k: [x * 1000 for x in v] for k, v in samples.items()},
        }
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
