"""``ModelInfo``, what inspection returns, and the checks that turn untrusted numbers into its fields."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from unillm._inspect._gguf_reader import _SMALL_ARRAY
from unillm._inspect._kv import kv_bytes_per_token
from unillm._inspect._pooling import task_of


@dataclass(frozen=True)
class ModelInfo:
    """What a model is, read from headers only. None means the files do not say.

    ``quantization`` names the scheme as its engine does ("Q4_K_M", "awq", "gptq", "fp8", "exl2",
    "mlx-4bit", or the dtype "bf16"/"f16"/"f32" for unquantized weights); ``bits_per_weight`` is
    the average over all weights including scales. ``parameters`` counts all weights;
    ``active_parameters`` those used per token (differs for MoE). ``group_size`` is the
    quantization group (weights per scale) where the files say it.

    ``estimated`` names the fields derived rather than read. A GGUF whose general.file_type comes
    before its vocabulary (convert_hf_to_gguf's layout) is inspected without reading the
    vocabulary's strings or the tensor infos after them: ``weights_bytes`` is then an upper bound,
    the file's size less the bytes the header takes at the least (over by at most the header bytes
    not read and the alignment padding: a few MB for a 150k-token vocabulary), and
    ``parameters``, ``active_parameters`` and ``bits_per_weight`` follow from it and the usual bits
    per weight of the file type (``BITS_PER_WEIGHT``).
    """

    path: str
    format: str
    architecture: str | None = None
    quantization: str | None = None
    bits_per_weight: float | None = None
    parameters: int | None = None
    active_parameters: int | None = None
    weights_bytes: int | None = None
    layers: int | None = None
    hidden_size: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    context_length: int | None = None
    vocab_size: int | None = None
    experts: int | None = None
    experts_per_token: int | None = None
    multimodal: bool = False
    hybrid_attention: bool = False
    files: tuple[str, ...] = ()
    group_size: int | None = None
    estimated: tuple[str, ...] = ()
    #: the pooling the model declares (mean, cls, last; rank for a reranker), None for a generative model
    pooling: str | None = None

    @property
    def task(self) -> str:
        """What the model is for: "embed" (it declares a pooling), "rerank" (a cross-encoder), or
        "generate"; ``auto_engine`` loads it for that unless the config's ``task`` says otherwise."""
        return task_of(self.pooling)

    @property
    def is_moe(self) -> bool:
        return bool(self.experts and self.experts > 1)

    def kv_bytes_per_token(self, dtype: str | int = "f16") -> int | None:
        """KV cache bytes per token for a cache of ``dtype`` (any spelling ``unillm.backend.kv_dtype``
        takes), by the one KV formula (unillm/_inspect/_kv.py); None when the shape is unknown."""
        if self.layers is None or self.kv_heads is None or self.head_dim is None:
            return None
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, dtype)


_MAX_INT = 1 << 48  # a config integer beyond this is junk, not a model dimension


def _int(value: Any) -> int | None:
    """A count from untrusted metadata: a sane non-negative int (the max of a per-layer list)."""
    if isinstance(value, list):
        ints = [x for x in value[:_SMALL_ARRAY] if not isinstance(x, (list, dict)) and _int(x) is not None]
        return max(ints) if ints else None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_INT:
        return value
    return None


def _num(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 64:
        return float(value)
    return None


def _bpw(nbytes: int | None, params: int | None) -> float | None:
    return round(nbytes * 8 / params, 4) if nbytes is not None and params else None


def _active(params: int | None, expert_params: int, experts: int | None, used: int | None) -> int | None:
    if params is None or not expert_params or not experts or experts <= 1 or not used:
        return params
    return params - expert_params + expert_params * min(used, experts) // experts


BITS_PER_WEIGHT: dict[str, float] = {
    # GGUF, whole-file averages (the _M/_L mixes keep some tensors in a larger type)
    "f32": 32.0,
    "f16": 16.0,
    "bf16": 16.0,
    "q8_0": 8.5,
    "q6_k": 6.5625,
    "q5_k_m": 5.7,
    "q5_k_s": 5.5,
    "q5_1": 6.0,
    "q5_0": 5.5,
    "q4_k_m": 4.8,
    "q4_k_s": 4.6,
    "q4_1": 5.0,
    "q4_0": 4.5,
    "iq4_nl": 4.5,
    "iq4_xs": 4.25,
    "q3_k_l": 4.3,
    "q3_k_m": 3.9,
    "q3_k_s": 3.5,
    "q2_k": 2.96,
    # Hugging Face quantization methods and dtypes
    "awq": 4.25,  # 4-bit, group 128: 16-bit scale + 4-bit zero per group
    "gptq": 4.25,
    "fp8": 8.0,
    "mxfp4": 4.25,  # 4-bit values + an 8-bit scale per 32
    "fp16": 16.0,
    "float16": 16.0,
    "bfloat16": 16.0,
    "fp32": 32.0,
    "float32": 32.0,
}
_GROUP64_BITS = re.compile(r"mlx-(\d+)bit")  # MLX group 64: a 16-bit scale and bias per 64 weights


def bits_per_weight(quantization: str | None) -> float | None:
    """Average bits per weight (scales included) of a quantization name, or None if unknown."""
    if not quantization:
        return None
    name = quantization.strip().lower()
    if name in BITS_PER_WEIGHT:
        return BITS_PER_WEIGHT[name]
    grouped = _GROUP64_BITS.fullmatch(name)
    if grouped:
        return int(grouped.group(1)) + 0.5
    return None
