"""What the plugin reads from a model directory besides the ONNX graph: genai_config.json, the
chat template, the special tokens, and each token's bytes. Every file is untrusted input: sizes
are bounded, types checked, and anything malformed is a ``ModelFormatError``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from unillm import ModelFormatError, ModelInfo, ModelNotFound
from unillm_onnxruntime_genai import FORMAT

__all__ = ["FORMAT", "GENAI_CONFIG", "ModelDir", "byte_level_table", "inspect", "is_genai_dir", "model_dir"]

GENAI_CONFIG = "genai_config.json"
_MAX_JSON = 64 << 20  # a tokenizer.json of a 250k vocabulary is ~20 MB
_MAX_TEMPLATE = 1 << 20


def model_dir(path: str) -> Path:
    """The ONNX Runtime GenAI model directory ``path`` names: ``ModelNotFound`` when nothing is
    there, ``ModelFormatError`` when it is something else (a GGUF, an HF directory)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelNotFound(str(path))
    if p.is_dir() and (p / GENAI_CONFIG).is_file():
        return p
    what = "a GGUF file" if p.suffix == ".gguf" else "a file" if p.is_file() else "a directory without it"
    hint = (
        "; ONNX Runtime GenAI reads the directory its model builder writes "
        "(python -m onnxruntime_genai.models.builder -m HF_DIR -o OUT -p fp32 -e cpu)"
    )
    if p.is_dir() and (p / "config.json").is_file():
        hint += ", or use a backend that reads Hugging Face directories (mlx, vllm)"
    elif p.suffix == ".gguf":
        hint += ", or load the GGUF with llama.cpp"
    raise ModelFormatError(
        f"{str(path)!r} is not an ONNX Runtime GenAI model directory ({GENAI_CONFIG}): it is {what}{hint}"
    )


def is_genai_dir(path: str | Path) -> bool:
    try:
        return (Path(path).expanduser() / GENAI_CONFIG).is_file()
    except OSError:
        return False


def inspect(path: str | Path) -> ModelInfo | None:
    """``path`` as a ``ModelInfo`` of format ``onnx-genai`` when it is a genai directory, else
    None. Reads genai_config.json and the files' sizes only; a config it cannot read still names
    the format, so that loading it says what is wrong."""
    if not is_genai_dir(path):
        return None
    root = Path(path).expanduser()
    try:
        info = ModelDir(root)
    except ModelFormatError:
        return ModelInfo(str(path), FORMAT)
    graphs = [f for f in sorted(root.iterdir())[:10_000] if f.name.endswith((".onnx", ".onnx.data"))]
    weights = sum(f.stat().st_size for f in graphs if f.is_file())
    return ModelInfo(
        str(path),
        FORMAT,
        architecture=info.type,
        weights_bytes=weights or None,
        layers=info.layers,
        hidden_size=info.hidden_size,
        heads=info.heads,
        kv_heads=info.kv_heads,
        head_dim=info.head_size,
        context_length=info.context_length,
        vocab_size=info.vocab_size,
        files=tuple(str(f) for f in graphs),
    )


def read_json(path: Path, limit: int = _MAX_JSON) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            raw = f.read(limit + 1)
    except OSError as exc:
        raise ModelFormatError(f"cannot read {str(path)!r}: {exc}") from exc
    if len(raw) > limit:
        raise ModelFormatError(f"{str(path)!r} is larger than {limit >> 20} MiB")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ModelFormatError(f"{str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelFormatError(f"{str(path)!r} does not hold a JSON object")
    return data


class ModelDir:
    """The facts of one model directory that the engine needs, read once at load."""

    def __init__(self, root: Path) -> None:
        self.root = root
        cfg = read_json(root / GENAI_CONFIG)
        model = cfg.get("model")
        if not isinstance(model, dict) or not isinstance(model.get("decoder"), dict):
            raise ModelFormatError(f"{str(root / GENAI_CONFIG)!r} has no model.decoder section")
        decoder = model["decoder"]
        self.type = str(model.get("type", "?"))
        self.context_length = _int(model.get("context_length"))
        self.vocab_size = _int(model.get("vocab_size"))
        self.layers = _int(decoder.get("num_hidden_layers"))
        self.kv_heads = _int(decoder.get("num_key_value_heads"))
        self.head_size = _int(decoder.get("head_size"))
        self.hidden_size = _int(decoder.get("hidden_size"))
        self.heads = _int(decoder.get("num_attention_heads"))
        outputs = decoder.get("outputs")
        key = outputs.get("present_key_names") if isinstance(outputs, dict) else None
        self.present_key = key if isinstance(key, str) and key.count("%d") == 1 else "present.%d.key"
        eos = model.get("eos_token_id")
        ids = eos if isinstance(eos, list) else [eos]
        self.eos_ids = frozenset(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0)
        self.tokenizer_config = self._optional_json("tokenizer_config.json")
        self.tokenizer_json = root / "tokenizer.json"

    def _optional_json(self, name: str) -> dict[str, Any]:
        path = self.root / name
        return read_json(path) if path.is_file() else {}

    def chat_template(self) -> str | None:
        """The template from chat_template.jinja (what transformers 4.43+ writes), else from
        tokenizer_config.json; a list of named templates gives its "default"."""
        jinja = self.root / "chat_template.jinja"
        if jinja.is_file():
            with jinja.open("rb") as f:
                raw = f.read(_MAX_TEMPLATE + 1)
            if len(raw) > _MAX_TEMPLATE:
                raise ModelFormatError(f"{str(jinja)!r} is larger than 1 MiB")
            return raw.decode("utf-8", "replace") or None
        t = self.tokenizer_config.get("chat_template")
        if isinstance(t, list):
            named = {e.get("name"): e.get("template") for e in t if isinstance(e, dict)}
            t = named.get("default")
        return t if isinstance(t, str) and t else None

    def special_tokens(self) -> dict[str, str]:
        out = {}
        for key in ("bos_token", "eos_token"):
            v = self.tokenizer_config.get(key)
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str):
                out[key] = v
        return out


def byte_level_table(path: Path, vocab_size: int) -> list[bytes] | None:
    """Each token's bytes for a byte-level BPE ``tokenizer.json`` (GPT-2's byte alphabet: Llama 3,
    Qwen, Phi-4, this project's tiny model), added tokens as their text; None for any other kind
    of tokenizer (the engine then decodes with ONNX Runtime GenAI's own stream)."""
    if not path.is_file():
        return None
    data = read_json(path)
    model, decoder = data.get("model"), data.get("decoder")
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(decoder, dict):
        return None
    if decoder.get("type") != "ByteLevel":
        return None
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        return None
    to_byte = {c: b for b, c in _gpt2_byte_chars().items()}
    table: list[bytes | None] = [None] * vocab_size
    for piece, i in vocab.items():
        if isinstance(i, int) and 0 <= i < vocab_size and isinstance(piece, str):
            try:
                table[i] = bytes(to_byte[c] for c in piece)
            except KeyError:  # not a byte-level piece after all
                return None
    for tok in data.get("added_tokens") or ():
        if not isinstance(tok, dict) or not isinstance(tok.get("content"), str):
            continue
        i = tok.get("id")
        if isinstance(i, int) and 0 <= i < vocab_size:
            table[i] = tok["content"].encode("utf-8")
    return [b if b is not None else b"" for b in table]


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE's alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None
