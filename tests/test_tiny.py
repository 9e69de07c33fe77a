"""The tiny-model builders: deterministic, and the GGUF carries the same model as the HF dir."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from unillm.testing import SIZES, TinyModel, build_tiny_model
from unillm.testing._tiny import CHAT_TEMPLATE, _permute_rope, file_digest

from .conftest import needs_llama_cpp


def test_same_bytes_twice(tmp_path: Path, tiny: TinyModel) -> None:
    again = build_tiny_model(tmp_path / "again", "small")
    files = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    for name in files:
        assert file_digest(again.hf_dir / name) == file_digest(tiny.hf_dir / name), name
    assert file_digest(again.gguf_path) == file_digest(tiny.gguf_path)


def test_a_build_is_reused_unless_forced(tmp_path: Path) -> None:
    m = build_tiny_model(tmp_path, "small")
    stamp = m.gguf_path.stat().st_mtime_ns
    assert build_tiny_model(tmp_path, "small").gguf_path.stat().st_mtime_ns == stamp
    assert build_tiny_model(tmp_path, "small", force=True).gguf_path.stat().st_mtime_ns >= stamp


def test_gguf_metadata_reads_back(tiny: TinyModel) -> None:
    import gguf

    r = gguf.GGUFReader(tiny.gguf_path)

    def field(key: str) -> object:
        f = r.fields[key]
        return f.contents()

    spec = SIZES["small"]
    assert field("general.architecture") == "llama"
    assert field("llama.block_count") == spec.num_layers
    assert field("llama.embedding_length") == spec.hidden_size
    assert field("llama.attention.head_count") == spec.num_heads
    assert field("llama.attention.head_count_kv") == spec.num_kv_heads
    assert field("llama.rope.dimension_count") == spec.head_dim
    assert field("tokenizer.ggml.model") == "gpt2"
    assert field("tokenizer.chat_template") == CHAT_TEMPLATE
    tokens = field("tokenizer.ggml.tokens")
    assert isinstance(tokens, list) and len(tokens) == spec.vocab_size
    vocab = json.loads((tiny.hf_dir / "tokenizer.json").read_text())["model"]["vocab"]
    assert all(vocab[t] == i for i, t in enumerate(tokens))
    assert len(r.tensors) == 2 + 1 + spec.num_layers * 9


def test_gguf_tensors_are_the_hf_tensors(tiny: TinyModel) -> None:
    import gguf
    from safetensors.numpy import load_file

    hf = load_file(tiny.hf_dir / "model.safetensors")
    g = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(tiny.gguf_path).tensors}
    spec = SIZES["small"]
    assert np.array_equal(g["token_embd.weight"], hf["model.embed_tokens.weight"])
    assert np.array_equal(g["output.weight"], hf["lm_head.weight"])
    assert np.array_equal(g["blk.1.ffn_down.weight"], hf["model.layers.1.mlp.down_proj.weight"])
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    assert np.array_equal(g["blk.0.attn_q.weight"], _permute_rope(q, spec.num_heads))
    assert not np.array_equal(g["blk.0.attn_q.weight"], q)  # the permutation really happened


def test_permutation_matches_rotary_layouts() -> None:
    # HF rotates halves (x_i, x_{i+d/2}); GGML rotates neighbours (x_2i, x_2i+1).
    d = 8
    w = np.arange(d, dtype=np.float32).reshape(d, 1)
    assert _permute_rope(w, 1).ravel().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_logits_are_not_near_ties(tiny: TinyModel) -> None:
    """Greedy decoding must not hinge on float noise: the lm_head spreads logits by units."""
    from safetensors.numpy import load_file

    hf = load_file(tiny.hf_dir / "model.safetensors")
    rng = np.random.default_rng(0)
    h = rng.standard_normal((64, SIZES["small"].hidden_size)).astype(np.float32)
    h /= np.sqrt((h * h).mean(axis=1, keepdims=True))  # RMS-normalized, as before the head
    logits = h @ hf["lm_head.weight"].T
    top2 = np.sort(logits, axis=1)[:, -2:]
    assert np.median(top2[:, 1] - top2[:, 0]) > 0.3
    assert logits.std() > 2


@needs_llama_cpp
def test_llama_cpp_tokenizes_like_the_hf_tokenizer(tiny: TinyModel) -> None:
    from llama_cpp import Llama
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(tiny.hf_dir / "tokenizer.json"))
    llm = Llama(str(tiny.gguf_path), vocab_only=True, verbose=False)
    for text in [
        "The quick brown fox jumps over the lazy dog.",
        "Hello, world! 2026 isn't   spaced\n\nnew lines",
        "<|im_start|>user\nünïcödé 🙂<|im_end|>",
    ]:
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == hf.encode(text).ids, text


@pytest.mark.parametrize("size", ["small", "bench"])
def test_sizes(size: str) -> None:
    n = SIZES[size].n_params * 4
    assert (1e6 < n < 3e6) if size == "small" else (40e6 < n < 60e6)
