"""The KV cache's size: one formula and one table of bytes per element, used by inspection, the
planner and every backend's ``kv_stats`` (docs/field.md, "Memory math").

KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element, rounded to
whole bytes. Engines spell the element type their own way (llama.cpp ``q8_0``, vLLM ``auto`` or
``fp8_e5m2``, ExLlamaV2 ``q8``, mlx-lm ``kv_bits=8``); ``kv_dtype`` maps every spelling to one
name of ``KV_BYTES_PER_ELEMENT``.
"""

from __future__ import annotations

__all__ = ["KV_BYTES_PER_ELEMENT", "kv_bytes_per_element", "kv_bytes_per_token", "kv_dtype"]

#: Bytes one cached K or V element takes, scales included. The block formats keep one f16 scale
#: per 32 values (llama.cpp q8_0: 32 int8 + 2 bytes = 34/32; q4_0: 16 + 2 = 18/32); ExLlamaV2's
#: Q8/Q6/Q4 caches and mlx-lm's 8/6/4-bit caches (a f16 scale and bias per 64) come to the same.
KV_BYTES_PER_ELEMENT: dict[str, float] = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "fp8": 1.0,
    "q8": 34 / 32,
    "q6": 26 / 32,
    "q5_1": 24 / 32,
    "q5": 22 / 32,
    "q4_1": 20 / 32,
    "q4": 18 / 32,
}

_ALIASES = {
    "float32": "f32",
    "fp32": "f32",
    "float": "f32",
    "float16": "f16",
    "fp16": "f16",
    "half": "f16",
    "bfloat16": "bf16",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "fp8_inc": "fp8",
    "q8_0": "q8",
    "q5_0": "q5",
    "q4_0": "q4",
    "iq4_nl": "q4",  # 18/32 too: 32 4-bit values and a f16 scale
    "8-bit": "q8",
    "6-bit": "q6",
    "4-bit": "q4",
}


def kv_dtype(name: str | int, model_dtype: str | None = None) -> str:
    """The table's name for an engine's KV element type: ``"q8_0"`` -> ``"q8"``, ``8`` (bits) ->
    ``"q8"``, ``"auto"`` -> the model's own dtype (``model_dtype``, default f16).

    :raises ValueError: for a type the table does not know.
    """
    if isinstance(name, int) and not isinstance(name, bool):
        key = {16: "f16", 8: "q8", 6: "q6", 4: "q4"}.get(name)
        if key is None:
            raise ValueError(f"unknown KV cache width {name} bits")
        return key
    text = str(name).strip().lower().removeprefix("torch.")
    if text == "auto":
        return kv_dtype(model_dtype) if model_dtype else "f16"
    text = _ALIASES.get(text, text)
    if text not in KV_BYTES_PER_ELEMENT:
        raise ValueError(f"unknown KV cache type {name!r} (known: {', '.join(KV_BYTES_PER_ELEMENT)})")
    return text


def kv_bytes_per_element(dtype: str | int) -> float:
    """Bytes per cached element of ``dtype`` (any spelling ``kv_dtype`` takes)."""
    return KV_BYTES_PER_ELEMENT[kv_dtype(dtype)]


def kv_bytes_per_token(
    layers: int, kv_heads: int, head_dim: int, dtype: str | int = "f16", *, value_dim: int | None = None
) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element of ``dtype``; with
    ``value_dim`` (a model whose V heads are narrower than its K heads), K and V counted apart."""
    per_head = head_dim + (head_dim if value_dim is None else value_dim)
    return round(layers * kv_heads * per_head * kv_bytes_per_element(dtype))
