"""A Hugging Face-style model directory (config.json and safetensors) inspected into a ``ModelInfo``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unillm._inspect._format import _format_of_config
from unillm._inspect._gguf_reader import _SMALL_ARRAY
from unillm._inspect._json import _MAX_CONFIG_BYTES, _load_json
from unillm._inspect._model import ModelInfo, _active, _bpw, _int, _num
from unillm._inspect._pooling import hf_pooling
from unillm._inspect._safetensors import _read_tensors, _safetensors_files

# ---- Hugging Face directories -----------------------------------------------------------------

# safetensors dtype -> the name unquantized weights go by
_DTYPE_NAMES = {
    "BF16": "bf16", "F16": "f16", "F32": "f32", "F64": "f64", "F8_E4M3": "fp8", "F8_E5M2": "fp8",
    "bfloat16": "bf16", "float16": "f16", "half": "f16", "float32": "f32", "float": "f32",
    "float64": "f64",
}  # fmt: skip
_HYBRID_KEYS = (
    "attn_layer_period", "attn_layer_indices", "hybrid_override_pattern", "layers_block_type",
    "full_attn_idxs", "sliding_window_pattern", "hybrid_layer_ids", "full_attention_interval",
    "linear_attn_config",
)  # fmt: skip
_HYBRID_MODEL_TYPES = {
    "gemma2", "gemma3", "gemma3_text", "gemma3n", "cohere2", "jamba", "zamba", "zamba2", "bamba",
    "falcon_h1", "nemotron_h", "granitemoehybrid", "qwen3_next", "lfm2", "gpt_oss", "llama4",
}  # fmt: skip
_MULTIMODAL_KEYS = (
    "vision_config", "audio_config", "vision_tower", "mm_vision_tower", "vision_encoder",
    "image_token_index", "image_token_id", "mm_projector_type", "visual",
)  # fmt: skip


def _inspect_hf(
    d: Path,
    *,
    files: list[Path] | None = None,
    config: dict[str, Any] | None = None,
    headers: dict[str, list[tuple[str, str, int, int]]] | None = None,
) -> ModelInfo:
    if config is None:
        config = _load_json(d / "config.json", _MAX_CONFIG_BYTES)
    text = next(
        (
            v
            for v in (config.get(k) for k in ("text_config", "llm_config", "language_config"))
            if isinstance(v, dict)
        ),
        {},
    )

    def get(*keys: str) -> int | None:
        for src in (config, text):
            for k in keys:
                v = _int(src.get(k))
                if v is not None:
                    return v
        return None

    fmt = _format_of_config(config)
    quant, bits, group = _quantization(config, fmt)
    weights = _read_tensors(d, files if files is not None else _safetensors_files(d), fmt, bits, headers)
    if fmt == "safetensors" and (weights.names_exl2 or weights.names_exl3):
        fmt = "exl2" if weights.names_exl2 else "exl3"
        q = config.get("quantization_config")
        bits = _num(q.get("bits")) if isinstance(q, dict) else None
        extra = config.get(fmt)
        if bits is None and isinstance(extra, dict):
            bits = _num(extra.get("bits"))
        quant = f"{fmt}-{bits:g}bit" if bits else fmt
        weights = _read_tensors(d, weights.files, fmt, bits, headers)
    if quant is None and weights.dtype_elements:
        dominant = max(weights.dtype_elements, key=lambda t: weights.dtype_elements[t])
        quant = _DTYPE_NAMES.get(dominant, dominant.lower())
    if quant is None:
        dtype = config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype")
        quant = _DTYPE_NAMES.get(dtype) if isinstance(dtype, str) else None
    params = weights.parameters if weights.files and not weights.unknown_packing else None
    nbytes = weights.nbytes if weights.files else None

    heads, hidden = get("num_attention_heads", "n_head", "num_heads"), get("hidden_size", "n_embd", "d_model")
    kv_heads = get("num_key_value_heads", "num_kv_heads", "n_head_kv")
    if kv_heads is None and config.get("multi_query") is True:
        kv_heads = 1
    kv_heads = kv_heads or heads
    experts = get("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    used = get("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k_experts")
    model_type, text_type = (
        v if isinstance(v, str) else None for v in (config.get("model_type"), text.get("model_type"))
    )
    listed = config.get("architectures")
    archs = [a for a in listed[:16] if isinstance(a, str)] if isinstance(listed, list) else []
    layer_types = config.get("layer_types") or text.get("layer_types")
    multimodal = any(k in config for k in _MULTIMODAL_KEYS) or any(
        ("ForConditionalGeneration" in a and text) or "Vision" in a or "VL" in a or "Llava" in a
        for a in archs
    )
    hybrid = (
        (
            isinstance(layer_types, list)
            and len({t for t in layer_types[:_SMALL_ARRAY] if isinstance(t, str)}) > 1
        )
        or any(k in config or k in text for k in _HYBRID_KEYS)
        or model_type in _HYBRID_MODEL_TYPES
        or text_type in _HYBRID_MODEL_TYPES
    )
    return ModelInfo(
        path=str(d),
        format=fmt,
        architecture=model_type or (archs[0] if archs else None),
        quantization=quant,
        bits_per_weight=_bpw(nbytes, params),
        parameters=params,
        active_parameters=_active(params, weights.expert_parameters, experts, used),
        weights_bytes=nbytes,
        layers=get("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
        hidden_size=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=get("head_dim") or (hidden // heads if hidden and heads else None),
        context_length=get("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"),
        vocab_size=get("vocab_size", "padded_vocab_size"),
        experts=experts,
        experts_per_token=used,
        multimodal=multimodal,
        hybrid_attention=hybrid,
        files=tuple(str(f) for f in weights.files),
        group_size=group,
        pooling=hf_pooling(d, config),
    )


def _quantization(config: dict[str, Any], fmt: str) -> tuple[str | None, float | None, int | None]:
    """(name, bits, group size) from quantization_config or MLX's quantization; Nones if plain."""
    if fmt == "mlx":
        q = config["quantization"]
        bits, group = _num(q.get("bits")), _int(q.get("group_size"))
        return (f"mlx-{bits:g}bit" if bits else "mlx"), bits, group
    q = config.get("quantization_config")
    if fmt == "safetensors" or not isinstance(q, dict):
        return None, None, None
    bits = _num(q.get("bits") if "bits" in q else q.get("w_bit"))
    group = _int(q.get("group_size") if "group_size" in q else q.get("q_group_size"))
    if fmt == "fp8":
        return "fp8", 8.0, None
    if fmt == "mxfp4":
        return "mxfp4", 4.0, 32
    if fmt == "bitsandbytes":
        bits = 4.0 if q.get("load_in_4bit") else 8.0 if q.get("load_in_8bit") else bits
    if fmt == "compressed-tensors":
        groups = q.get("config_groups")
        for g in groups.values() if isinstance(groups, dict) else ():
            w = g.get("weights") if isinstance(g, dict) else None
            if isinstance(w, dict):
                bits = _num(w.get("num_bits")) or bits
                group = _int(w.get("group_size")) or group
                break
    return (f"{fmt}-{bits:g}bit" if bits else fmt), bits, group
