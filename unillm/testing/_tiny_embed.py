"""Tiny embedding models and a tiny reranker, on the tiny Llama's weights.

``tiny_embedding_model(pooling)`` writes, beside the tiny model's cache, an HF directory holding the
small tiny model's files plus sentence-transformers' ``modules.json``, ``1_Pooling/config.json``
(mean or last-token pooling) and ``2_Normalize``, and a GGUF of the same weights declaring that
pooling (``llama.pooling_type``). Every engine reads the pooling from the files, so the same weights
give the same vectors on llama.cpp, vLLM and MLX (and on sentence-transformers itself).

``tiny_reranker_model()`` writes the same weights as a cross-encoder: a one-label
``LlamaForSequenceClassification`` whose score head (``score.weight``, one row) reads the last
token's final hidden state, as Llama-based rerankers do. Its score of a token sequence is that
state (an embedding model's unnormalized last-pooled vector) times the row, so a test can compute
it on another engine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Literal

from unillm.testing._tiny import (
    BUILDER_VERSION,
    SIZES,
    TinyModel,
    _train_tokenizer,
    _weights,
    _write_gguf,
    _write_json,
    default_cache_dir,
    tiny_model,
)

__all__ = ["RERANK_SEED", "score_head", "tiny_embedding_model", "tiny_reranker_model"]

#: the seed of the reranker's score head (one row of ``hidden_size`` weights)
RERANK_SEED = 7

_GGUF_POOLING = {"mean": 1, "cls": 2, "last": 3}


def tiny_embedding_model(
    pooling: Literal["mean", "last", "cls"] = "last",
    size: Literal["small", "bench"] = "small",
    cache_dir: str | Path | None = None,
) -> TinyModel:
    """The tiny model of ``size`` as an embedding model pooling by ``pooling``, built on first use."""
    if pooling not in _GGUF_POOLING:
        raise ValueError(f"pooling is one of {', '.join(_GGUF_POOLING)}, got {pooling!r}")
    base = tiny_model(size, cache_dir)
    name = f"tiny-embed-{pooling}-{size}"
    root = (Path(cache_dir) if cache_dir else default_cache_dir()) / f"{name}-v{BUILDER_VERSION}"
    hf_dir, gguf_path = root / "hf", root / f"tiny-embed-{pooling}-{size}-f32.gguf"
    model = TinyModel(root, hf_dir, gguf_path, base.spec)
    stamp = root / ".unillm-tiny.json"
    want = json.dumps({"builder": BUILDER_VERSION, "pooling": pooling, "size": size}, sort_keys=True)
    if stamp.is_file() and stamp.read_text() == want and gguf_path.is_file():
        return model
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(base.hf_dir, hf_dir)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (hf_dir / "modules.json").write_text(json.dumps(modules, indent=2) + "\n", encoding="utf-8")
    (hf_dir / "1_Pooling").mkdir()
    _write_json(
        hf_dir / "1_Pooling" / "config.json",
        {
            "word_embedding_dimension": base.spec.hidden_size,
            "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean",
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": pooling == "last",
            "include_prompt": True,
        },
    )
    (hf_dir / "2_Normalize").mkdir()
    _write_json(hf_dir / "sentence_bert_config.json", {"max_seq_length": 512, "do_lower_case": False})
    spec = SIZES[size]
    _write_gguf(
        gguf_path, spec, _weights(spec), _train_tokenizer(spec.vocab_size), f"embed-{pooling}-{size}",
        pooling_type=_GGUF_POOLING[pooling],
    )  # fmt: skip
    stamp.write_text(want)
    return model


def tiny_reranker_model(
    size: Literal["small", "bench"] = "small", cache_dir: str | Path | None = None
) -> Path:
    """The HF directory of the tiny model of ``size`` as a one-label sequence classifier (a
    reranker), built on first use. ``score_head(path)`` reads its score row back."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    base = tiny_model(size, cache_dir)
    root = (Path(cache_dir) if cache_dir else default_cache_dir()) / f"tiny-rerank-{size}-v{BUILDER_VERSION}"
    hf_dir = root / "hf"
    stamp = root / ".unillm-tiny.json"
    want = json.dumps({"builder": BUILDER_VERSION, "rerank": RERANK_SEED, "size": size}, sort_keys=True)
    if stamp.is_file() and stamp.read_text() == want:
        return hf_dir
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(base.hf_dir, hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(architectures=["LlamaForSequenceClassification"], num_labels=1, id2label={"0": "LABEL_0"},
                  label2id={"LABEL_0": 0}, pad_token_id=config["bos_token_id"])  # fmt: skip
    _write_json(hf_dir / "config.json", config)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    del tensors["lm_head.weight"]
    h = base.spec.hidden_size
    rng = np.random.default_rng(RERANK_SEED)
    tensors["score.weight"] = (rng.standard_normal((1, h)) / np.sqrt(h)).astype(np.float32)
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    stamp.write_text(want)
    return hf_dir


def score_head(path: str | Path) -> Any:
    """The reranker's score row (float32, ``hidden_size``) from its safetensors."""
    from safetensors.numpy import load_file

    return load_file(str(Path(path) / "model.safetensors"))["score.weight"][0]
