"""Tiny Llama models built on this machine: the same weights as an HF directory and as a GGUF.

There is no network to download weights, and tests should not need it: these builders make a
deterministic random-weight Llama (f32) with a byte-level BPE tokenizer trained here on a small
built-in corpus, and a ChatML chat template. They write

- ``DIR/hf/``: ``config.json``, ``model.safetensors``, ``tokenizer.json``,
  ``tokenizer_config.json`` (with the chat template), ``generation_config.json``;
- ``DIR/tiny-<size>-f32.gguf``: the same tensors for llama.cpp, Q and K permuted into GGML's
  rotary layout, with the vocabulary, merges and chat template in its metadata.

Every engine tokenizes identically (byte-level BPE, GPT-2 pre-tokenizer, no BOS added), so greedy
outputs can be compared token for token across engines. The initialisation is scaled so logits
spread over several units: greedy decoding is not decided by float noise between near-ties.

Needs the ``testing`` extra (numpy, tokenizers, safetensors, gguf).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "SIZES",
    "TinyModel",
    "TinySpec",
    "build_tiny_model",
    "default_cache_dir",
    "tiny_gguf",
    "tiny_model",
]

BUILDER_VERSION = 1

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS, EOS = "<|endoftext|>", "<|im_end|>"
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")  # build_tiny_model(fim=True)

_CORPUS = """\
Local inference runs a language model on hardware you own. The engine loads the weights, turns
text into tokens, runs the forward pass, samples the next token and keeps the key and value cache.
Prefill reads the whole prompt at once and is bound by compute. Decode makes one token at a time
and is bound by memory bandwidth, because every step reads all of the weights again.
A laptop, a desktop with one graphics card, a workstation with four, and a server rack each want a
different engine. The cache grows with the context and with the number of users; a long context can
run out of memory even when the weights fit. Paged attention splits the cache into blocks.
Quantization stores weights in fewer bits: eight, six, five, four or even two bits per weight, with
scales for each group. Formats are not portable between engines. The quick brown fox jumps over the
lazy dog. She sells sea shells by the sea shore. How much wood would a woodchuck chuck? 0 1 2 3 4 5
6 7 8 9 10 100 1000 2026. Hello, world! What is the capital of France? Paris is the capital of
France. Why is the sky blue? Because air scatters blue light more than red light. Once upon a time,
there was a small model that wanted to tell stories. It had few layers and a tiny vocabulary, but it
answered every question it was asked, one token after another, until it reached the end.
"""


@dataclass(frozen=True)
class TinySpec:
    """The shape of a tiny Llama. ``head_dim`` stays 64 (what vLLM's CPU attention supports)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int = 512
    head_dim: int = 64
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    seed: int = 0

    @property
    def n_params(self) -> int:
        h, i, v, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        return 2 * v * h + h + self.num_layers * (attn + 3 * h * i + 2 * h)


SIZES: dict[str, TinySpec] = {
    # ~1.7 MB: unit tests
    "small": TinySpec(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256),
    # ~50 MB: benchmarks (per-token work large enough to time)
    "bench": TinySpec(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=1536),
}


@dataclass(frozen=True)
class TinyModel:
    """Where a built tiny model lies."""

    root: Path
    hf_dir: Path
    gguf_path: Path
    spec: TinySpec


def default_cache_dir() -> Path:
    """``$UNILLM_CACHE`` or ``~/.cache/unillm``: where ``tiny_model()`` keeps what it builds."""
    return Path(os.environ.get("UNILLM_CACHE") or Path.home() / ".cache" / "unillm")


def tiny_model(size: Literal["small", "bench"] = "small", cache_dir: str | Path | None = None) -> TinyModel:
    """The tiny model of ``size``, built into the cache on first use and reused after."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return build_tiny_model(root / f"tiny-{size}-v{BUILDER_VERSION}", size=size)


def build_tiny_model(
    directory: str | Path,
    size: Literal["small", "bench"] | TinySpec = "small",
    *,
    force: bool = False,
    eos: tuple[str, ...] = (EOS,),
    fim: bool = False,
) -> TinyModel:
    """Write the tiny model of ``size`` under ``directory`` (HF dir + GGUF), deterministically.

    ``eos`` are the end-of-sequence tokens the model declares (special tokens of its vocabulary):
    the HF files list all of them (``generation_config.json``'s ``eos_token_id`` list), the GGUF
    the first as its EOS, the second as its EOT and the third as its EOM, so a test can check that
    every engine stops on each. ``fim`` makes the last three ids ``FIM_TOKENS`` (fill-in-the-middle's,
    special tokens of the vocabulary; the rest trained three tokens short). An existing build of
    the same spec is reused unless ``force``.
    """
    if not eos or len(eos) > 3 or any(t not in SPECIAL_TOKENS for t in eos):
        raise ValueError(f"eos takes one to three of {SPECIAL_TOKENS}, got {eos!r}")
    spec = SIZES[size] if isinstance(size, str) else size
    name = size if isinstance(size, str) else "custom"
    root = Path(directory)
    hf_dir = root / "hf"
    gguf_path = root / f"tiny-{name}-f32.gguf"
    model = TinyModel(root, hf_dir, gguf_path, spec)
    stamp = root / ".unillm-tiny.json"
    built = {"builder": BUILDER_VERSION, "spec": asdict(spec), "eos": list(eos)}
    want = json.dumps({**built, "fim": True} if fim else built, sort_keys=True)
    if not force and stamp.is_file() and stamp.read_text() == want and gguf_path.is_file():
        return model

    hf_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_json = _train_tokenizer(spec.vocab_size, fim)
    tensors = _weights(spec)
    _write_hf(hf_dir, spec, tensors, tokenizer_json, eos)
    _write_gguf(gguf_path, spec, tensors, tokenizer_json, name, eos=eos)
    stamp.write_text(want)
    return model


def _train_tokenizer(vocab_size: int, fim: bool = False) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - (len(FIM_TOKENS) if fim else 0),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    # Pad to exactly vocab_size with unreachable filler so embeddings and vocab agree.
    for i in range(len(vocab), vocab_size - (len(FIM_TOKENS) if fim else 0)):
        vocab[f"<|unused{i}|>"] = i
    if fim:  # the last three ids (trained three short of vocab_size for them)
        for k, text in enumerate(FIM_TOKENS):
            i = vocab_size - len(FIM_TOKENS) + k
            vocab.pop(f"<|unused{i}|>", None)
            vocab[text] = i
            data["added_tokens"].append({
                "id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True,
            })  # fmt: skip
    return json.dumps(data, ensure_ascii=False, sort_keys=True)


def _weights(spec: TinySpec) -> dict[str, Any]:
    """HF-named f32 tensors. Scales keep activations near unit size and logits spread out."""
    import numpy as np

    rng = np.random.default_rng(spec.seed)
    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size

    def linear(out_f: int, in_f: int) -> Any:
        return (rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)).astype(np.float32)

    def norm(n: int) -> Any:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t: dict[str, Any] = {
        "model.embed_tokens.weight": rng.standard_normal((spec.vocab_size, h)).astype(np.float32)
    }
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        t[p + "input_layernorm.weight"] = norm(h)
        t[p + "self_attn.q_proj.weight"] = linear(spec.num_heads * d, h)
        t[p + "self_attn.k_proj.weight"] = linear(spec.num_kv_heads * d, h)
        t[p + "self_attn.v_proj.weight"] = linear(spec.num_kv_heads * d, h)
        t[p + "self_attn.o_proj.weight"] = linear(h, spec.num_heads * d)
        t[p + "post_attention_layernorm.weight"] = norm(h)
        t[p + "mlp.gate_proj.weight"] = linear(i, h)
        t[p + "mlp.up_proj.weight"] = linear(i, h)
        t[p + "mlp.down_proj.weight"] = linear(h, i)
    t["model.norm.weight"] = norm(h)
    # logit std ~ 4: the top two tokens are typically a unit or more apart
    t["lm_head.weight"] = (4.0 * rng.standard_normal((spec.vocab_size, h)) / np.sqrt(h)).astype(np.float32)
    return t


def _write_hf(
    hf_dir: Path, spec: TinySpec, tensors: dict[str, Any], tokenizer_json: str, eos: tuple[str, ...] = (EOS,)
) -> None:
    from safetensors.numpy import save_file

    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    bos_id, eos_id = vocab[BOS], vocab[eos[0]]
    eos_ids: int | list[int] = eos_id if len(eos) == 1 else [vocab[t] for t in eos]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids,
        "torch_dtype": "float32",
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": eos[0],
        "pad_token": BOS,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    generation_config = {"bos_token_id": bos_id, "eos_token_id": eos_ids}
    _write_json(hf_dir / "config.json", config)
    _write_json(hf_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(hf_dir / "special_tokens_map.json", {"bos_token": BOS, "eos_token": eos[0], "pad_token": BOS})
    _write_json(hf_dir / "generation_config.json", generation_config)
    (hf_dir / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})


def _permute_rope(w: Any, n_head: int) -> Any:
    """HF's rotate-half Q/K rows -> GGML's interleaved pairs (as llama.cpp's converter does)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(
    path: Path,
    spec: TinySpec,
    tensors: dict[str, Any],
    tokenizer_json: str,
    name: str,
    *,
    chat_template: str | None = CHAT_TEMPLATE,
    arch: str = "llama",
    eos: tuple[str, ...] = (EOS,),
    quant: str = "f32",
    split_max_tensors: int = 0,
    pooling_type: int | None = None,
) -> None:
    """Write the GGUF. ``chat_template`` and ``arch`` are overridable so tests can plant a hostile
    template or an architecture llama.cpp does not know; ``quant`` (one of ``QUANTS``) stores the
    matrices in that type, ``split_max_tensors`` writes a split set
    (``stem-0000N-of-0000M.gguf``, gguf-split's layout) of at most that many tensors a part, and
    ``pooling_type`` declares the model an embedding model pooling that way."""
    import gguf

    qtype, ftype = QUANTS[quant]

    tok = json.loads(tokenizer_json)
    vocab: dict[str, int] = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    types = [
        gguf.TokenType.CONTROL
        if t in SPECIAL_TOKENS or t in FIM_TOKENS
        else gguf.TokenType.UNUSED
        if t.startswith("<|unused")
        else gguf.TokenType.NORMAL
        for t in tokens
    ]

    tmp = path.with_suffix(".gguf.partial")
    if split_max_tensors:
        w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    else:
        w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(f"unillm-tiny-{name}")
    w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size)
    w.add_block_count(spec.num_layers)
    w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads)
    w.add_head_count_kv(spec.num_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_vocab_size(spec.vocab_size)
    w.add_file_type(gguf.LlamaFileType(ftype))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[BOS])
    w.add_eos_token_id(vocab[eos[0]])
    if len(eos) > 1:
        w.add_eot_token_id(vocab[eos[1]])
    if len(eos) > 2:
        w.add_eom_token_id(vocab[eos[2]])
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    if pooling_type is not None:  # an embedding model's (llama.cpp's LLAMA_POOLING_TYPE_*)
        w.add_pooling_type(gguf.PoolingType(pooling_type))

    put, qt = w.add_tensor, gguf.GGMLQuantizationType(qtype)

    def add(name: str, t: Any) -> None:  # the matrices in ``quant``; norms stay f32, as llama.cpp's
        if t.ndim == 1 or quant == "f32":
            put(name, t)
        elif quant == "f16":
            put(name, t.astype("float16"))
        else:
            put(name, gguf.quants.quantize(t, qt), raw_dtype=qt)

    w.add_tensor = add  # type: ignore[method-assign,assignment]
    w.add_tensor("token_embd.weight", tensors["model.embed_tokens.weight"])
    for layer in range(spec.num_layers):
        p, b = f"model.layers.{layer}.", f"blk.{layer}."
        w.add_tensor(b + "attn_norm.weight", tensors[p + "input_layernorm.weight"])
        w.add_tensor(
            b + "attn_q.weight", _permute_rope(tensors[p + "self_attn.q_proj.weight"], spec.num_heads)
        )
        w.add_tensor(
            b + "attn_k.weight", _permute_rope(tensors[p + "self_attn.k_proj.weight"], spec.num_kv_heads)
        )
        w.add_tensor(b + "attn_v.weight", tensors[p + "self_attn.v_proj.weight"])
        w.add_tensor(b + "attn_output.weight", tensors[p + "self_attn.o_proj.weight"])
        w.add_tensor(b + "ffn_norm.weight", tensors[p + "post_attention_layernorm.weight"])
        w.add_tensor(b + "ffn_gate.weight", tensors[p + "mlp.gate_proj.weight"])
        w.add_tensor(b + "ffn_up.weight", tensors[p + "mlp.up_proj.weight"])
        w.add_tensor(b + "ffn_down.weight", tensors[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", tensors["model.norm.weight"])
    w.add_tensor("output.weight", tensors["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if not split_max_tensors:
        tmp.replace(path)


#: The GGUF quantizations the tiny model is written in: name -> (tensor type, file type), each a
#: ``(gguf.GGMLQuantizationType, gguf.LlamaFileType)`` value by number (the gguf package writes
#: these; its K-quants have no quantizer).
QUANTS: dict[str, tuple[int, int]] = {"f32": (0, 0), "f16": (1, 1), "Q8_0": (8, 7), "Q4_0": (2, 2)}


def tiny_gguf(
    quant: str = "f32",
    *,
    size: Literal["small", "bench"] = "small",
    split: int = 0,
    cache_dir: str | Path | None = None,
    model: TinyModel | None = None,
) -> list[Path]:
    """The tiny model's GGUF in ``quant`` (one of ``QUANTS``), built on first use beside it: one
    file, or with ``split`` the parts of a split set of at most that many tensors each (first
    part first). ``model`` is a tiny model already built (any spec), else the one of ``size``.
    The weights are the HF directory's, so every quantization is the same model."""
    if quant not in QUANTS:
        raise ValueError(f"quant is one of {', '.join(QUANTS)}, got {quant!r}")
    model = model or tiny_model(size, cache_dir)
    size = model.gguf_path.name.split("-")[1]  # type: ignore[assignment]  # tiny-<size>-f32.gguf
    folder = model.root / (f"quants-split{split}" if split else "quants")
    path = folder / f"tiny-{size}-{quant}.gguf"
    stem = path.stem
    existing = sorted(folder.glob(f"{stem}-*-of-*.gguf")) if split else [path] if path.is_file() else []
    if existing:
        return existing
    import tempfile

    folder.mkdir(parents=True, exist_ok=True)
    spec = model.spec
    with tempfile.TemporaryDirectory(dir=folder) as work:
        out = Path(work) / path.name
        _write_gguf(
            out, spec, _weights(spec), _train_tokenizer(spec.vocab_size), size, quant=quant,
            split_max_tensors=split,
        )  # fmt: skip
        written = sorted(Path(work).glob("*.gguf"))
        for f in written:
            f.replace(folder / f.name)
    return sorted(folder.glob(f"{stem}-*-of-*.gguf")) if split else [path]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_variant_gguf(path: str | Path, size: Literal["small", "bench"] = "small", **overrides: Any) -> Path:
    """Write the tiny GGUF with ``chat_template=`` or ``arch=`` overridden (for error tests)."""
    spec = SIZES[size]
    _write_gguf(Path(path), spec, _weights(spec), _train_tokenizer(spec.vocab_size), size, **overrides)
    return Path(path)


def file_digest(path: str | Path) -> str:
    """SHA-256 of a file: for tests and for recording which model a benchmark ran."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
