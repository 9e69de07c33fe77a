"""Tiny embedding models: the tiny Llama's weights declared as a sentence-transformers model.

``tiny_embedding_model(pooling)`` writes, beside the tiny model's cache, an HF directory holding the
small tiny model's files plus sentence-transformers' ``modules.json``, ``1_Pooling/config.json``
(mean or last-token pooling) and ``2_Normalize``, and a GGUF of the same weights declaring that
pooling (``llama.pooling_type``). Every engine reads the pooling from the files, so the same weights
give the same vectors on llama.cpp, vLLM and MLX (and on sentence-transformers itself).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

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

__all__ = ["tiny_embedding_model"]

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
