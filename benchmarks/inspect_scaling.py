"""Inspection reads headers only: its cost must not grow with the size of the weights, nor much
with the size of the vocabulary.

Weights: two GGUFs with the same header layout, the ~50 MB tiny bench model and a sparse copy whose
tensor infos claim ~800x larger tensors (~40 GB of weights) while the data is a hole in the file.
Contenders: ``inspect_model``, ``detect_format`` and inspect + plan + select on each file, timed in
interleaved rounds (A, B, A, B, ... with the first rotating), every sample the mean of ``--calls``
calls; medians of ``--runs`` (>= 9) rounds.

Vocabulary: the small tiny model (512 tokens) against GGUFs written with gguf's GGUFWriter holding
a 150k-token vocabulary and 100k merges (English-like byte-level BPE strings) around tiny tensors,
in the two layouts llama.cpp's tools write: llama-quantize's (general.file_type appended after the
tokenizer: the lazy read finds it and the tensor infos past the vocabulary) and convert_hf_to_gguf's
(general.file_type before the tokenizer: the lazy read stops at the vocabulary and estimates the
sizes from the file's). Each is timed as the first read of the file in a fresh process: ``--fresh``
processes per contender, started in interleaved order, medians reported. The full read (what the
llama.cpp backend does at load, for the tokenizer's ids and the chat template) is timed the same
way, for reference.

Goals: t(40 GB) / t(40 MB) <= 1.2 for inspect_model and for inspect + plan + select (issue 7);
t(150k vocabulary, first read) / t(tiny, first read) <= 10 in both layouts (issue 12).

    python benchmarks/inspect_scaling.py [--runs 15] [--calls 20] [--fresh 15] [--json results.json]
    python benchmarks/inspect_scaling.py --fresh-only --unillm OLD  # another unillm's fresh reads
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _common import machine

SCALE = 800  # rows of every 2-D tensor x SCALE: ~50 MB -> ~40 GB
VOCAB, MERGES = 150_000, 100_000
VOCAB_GOAL = 10.0

# The first read of a file in a fresh interpreter: argv = path, "inspect" or "full". Prints the
# seconds of that read and of a second one.
CHILD = """
import sys, time
from unillm._inspect import inspect_model, read_gguf_header
read = inspect_model if sys.argv[2] == "inspect" else read_gguf_header
t0 = time.perf_counter(); read(sys.argv[1]); t1 = time.perf_counter(); read(sys.argv[1])
print(t1 - t0, time.perf_counter() - t1)
"""


def _words(n: int, rng: random.Random) -> list[str]:
    """``n`` English-like tokens as a byte-level BPE vocabulary holds them: letters drawn with their
    English frequencies, about half with the space marker "Ġ" in front, ~6.5 bytes on average."""
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    weights = [127, 91, 82, 75, 70, 67, 63, 61, 60, 43, 40, 28, 28, 24, 24, 22, 20, 20, 19, 15, 10, 8]
    weights += [2, 2, 1, 1]  # per thousand letters: e, t, a, ... q, z
    out = []
    for _ in range(n):
        word = "".join(rng.choices(letters, weights, k=max(1, min(16, round(rng.gauss(5, 2.5))))))
        out.append("\u0120" + word if rng.random() < 0.5 else word)
    return out


def big_vocab_gguf(path: Path, layout: str) -> Path:
    """A Q8_0 GGUF with a ``VOCAB``-token vocabulary and ``MERGES`` merges around tiny tensors, its
    keys as llama-quantize ("quantize": general.file_type appended last) or convert_hf_to_gguf
    ("convert": general.file_type with the model's shape, before the tokenizer) writes them."""
    import gguf
    import numpy as np

    rng = random.Random(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    if layout == "convert":
        w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(_words(VOCAB, rng))
    w.add_token_types([1] * VOCAB)
    w.add_token_merges([f"{a} {b}" for a, b in zip(_words(MERGES, rng), _words(MERGES, rng), strict=True)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    if layout == "quantize":
        w.add_quantization_version(2)
        w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0))
    w.add_tensor(
        "token_embd.weight", np.zeros((8, 64 // 32 * 34), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0
    )
    w.add_tensor("output_norm.weight", np.zeros(64, np.float32))
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


def fresh_reads(files: dict[str, tuple[Path, str]], runs: int, unillm: str | None) -> dict[str, Any]:
    """Each contender's first and second read in ``runs`` fresh interpreters, started in
    interleaved order (the first rotating); milliseconds."""
    env = dict(os.environ)
    if unillm:  # another checkout's unillm, for a before/after
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [unillm, env.get("PYTHONPATH")]))
    first: dict[str, list[float]] = {k: [] for k in files}
    second: dict[str, list[float]] = {k: [] for k in files}
    names = list(files)
    for r in range(runs):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            path, mode = files[name]
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(path), mode],
                capture_output=True, text=True, check=True, env=env, cwd=tempfile.gettempdir(),
            ).stdout.split()  # fmt: skip
            first[name].append(float(out[0]) * 1000)
            second[name].append(float(out[1]) * 1000)
    return {
        "first_read_ms": {k: statistics.median(v) for k, v in first.items()},
        "second_read_ms": {k: statistics.median(v) for k, v in second.items()},
        "samples_first_ms": first,
    }


def weights_scaling(tmp: Path, runs: int, calls: int) -> dict[str, Any]:
    """The 40 MB tiny bench model against its sparse 40 GB copy (issue 7)."""
    from unillm import Workload, backends, detect_hardware, plan, select
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

    small = tiny_model("bench").gguf_path
    big = tmp / "sparse-40gb.gguf"
    sparse_copy(small, big, SCALE)
    info_small, info_big = inspect_model(small), inspect_model(big)
    assert info_small.weights_bytes is not None and info_big.weights_bytes is not None
    contenders: dict[str, Callable[[], object]] = {
        "inspect_model 40 MB": lambda: inspect_model(small),
        "inspect_model 40 GB": lambda: inspect_model(big),
        "detect_format 40 MB": lambda: detect_format(small),
        "detect_format 40 GB": lambda: detect_format(big),
        "inspect+select 40 MB": lambda: inspect_and_select(small),
        "inspect+select 40 GB": lambda: inspect_and_select(big),
    }
    for fn in contenders.values():  # warm the page cache and the imports
        fn()
    samples: dict[str, list[float]] = {k: [] for k in contenders}
    names = list(contenders)
    for r in range(runs):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(sample(contenders[name], calls))
    ms = {k: statistics.median(v) * 1000 for k, v in samples.items()}
    ratios = {
        what: ms[f"{what} 40 GB"] / ms[f"{what} 40 MB"]
        for what in ("inspect_model", "detect_format", "inspect+select")
    }
    mb, gb = info_small.weights_bytes / 1e6, info_big.weights_bytes / 1e9
    print(f"small: {small} ({small.stat().st_size / 1e6:.1f} MB file, {mb:.1f} MB weights)")
    on_disk = big.stat().st_blocks * 512 / 1e6
    print(f"big:   sparse copy claiming {gb:.1f} GB of weights ({on_disk:.2f} MB on disk)")
    print(f"medians of {runs} interleaved rounds, each the mean of {calls} calls:")
    for name, value in ms.items():
        print(f"  {name:31s} {value:8.3f} ms")
    for what, ratio in ratios.items():
        verdict = "ok" if ratio <= 1.2 else "OVER GOAL"
        print(f"  ratio {what:14s} t(40 GB) / t(40 MB) = {ratio:.3f}  (goal <= 1.2: {verdict})")
    return {
        "runs": runs,
        "calls_per_sample": calls,
        "small_weights_bytes": info_small.weights_bytes,
        "big_weights_bytes": info_big.weights_bytes,
        "median_ms": ms,
        "ratio": ratios,
        "goal": 1.2,
        "samples_ms": {k: [x * 1000 for x in v] for k, v in samples.items()},
    }


def vocabulary(tmp: Path, fresh: int, unillm: str | None) -> dict[str, Any]:
    """The tiny model against the 150k-token vocabulary, first reads in fresh processes (issue 12)."""
    from unillm._inspect import inspect_model
    from unillm.testing import tiny_model

    layouts = {
        layout: big_vocab_gguf(tmp / f"vocab-150k-{layout}.gguf", layout)
        for layout in ("quantize", "convert")
    }
    files = {
        "tiny": (tiny_model("small").gguf_path, "inspect"),
        "150k vocab, llama-quantize layout": (layouts["quantize"], "inspect"),
        "150k vocab, convert layout": (layouts["convert"], "inspect"),
        "150k vocab, full read": (layouts["quantize"], "full"),
    }
    for path, mode in files.values():  # warm the page cache
        subprocess.run([sys.executable, "-c", CHILD, str(path), mode], check=True, capture_output=True)
    reads = fresh_reads(files, fresh, unillm)
    first = reads["first_read_ms"]
    ratios = {k: first[k] / first["tiny"] for k in first if k != "tiny"}
    print(f"vocabulary: {VOCAB} tokens and {MERGES} merges; medians of {fresh} fresh processes each")
    for name, value in first.items():
        again = reads["second_read_ms"][name]
        print(f"  first read {name:34s} {value:8.3f} ms  (a second read: {again:.3f} ms)")
    for name, ratio in ratios.items():
        verdict = "ok" if ratio <= VOCAB_GOAL else "OVER GOAL"
        goal = "for reference" if name.endswith("full read") else f"goal <= {VOCAB_GOAL:g}: {verdict}"
        print(f"  ratio t({name}) / t(tiny) = {ratio:.2f}  ({goal})")
    estimated = {}
    for layout, path in layouts.items() if unillm is None else ():  # what this checkout estimates
        info = inspect_model(path)
        estimated[layout] = list(info.estimated)
        what = ", ".join(info.estimated) or "nothing"
        print(f"  {layout}: {info.quantization}, {info.vocab_size} tokens, estimated: {what}")
    return {
        "tokens": VOCAB,
        "merges": MERGES,
        "fresh_processes": fresh,
        "unillm": unillm or "this checkout",
        **reads,
        "ratio_to_tiny": ratios,
        "goal": VOCAB_GOAL,
        "estimated": estimated,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15, help="interleaved rounds (median reported; >= 9)")
    ap.add_argument("--calls", type=int, default=20, help="calls averaged into one sample")
    ap.add_argument("--fresh", type=int, default=15, help="fresh processes per vocabulary contender (>= 5)")
    ap.add_argument("--fresh-only", action="store_true", help="only the vocabulary's fresh-process reads")
    ap.add_argument("--unillm", help="a directory holding another unillm package, for the fresh reads")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.runs < 9 or args.fresh < 5:
        ap.error("--runs must be at least 9 and --fresh at least 5")
    result: dict[str, Any] = {"benchmark": "inspect_scaling", "machine": machine()}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.fresh_only:
            result.update(weights_scaling(Path(tmp), args.runs, args.calls))
        result["vocab"] = vocabulary(Path(tmp), args.fresh, args.unillm)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
