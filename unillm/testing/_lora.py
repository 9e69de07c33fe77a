"""A random LoRA adapter for a tiny model, written in the formats the engines read.

``tiny_lora(model)`` writes one adapter (the same numbers in each format) beside the tiny model:

- ``peft/``: ``adapter_config.json`` + ``adapter_model.safetensors`` as PEFT saves them (vLLM,
  ExLlamaV2, PEFT): ``lora_A`` is ``(rank, in)``, ``lora_B`` is ``(out, rank)``, scaled by
  ``lora_alpha / r``;
- ``tiny-lora.gguf``: a GGUF adapter as llama.cpp's ``convert_lora_to_gguf.py`` writes one
  (``general.type = adapter``, ``adapter.lora.alpha``, ``blk.N.attn_q.weight.lora_a`` /
  ``.lora_b`` in PEFT's shapes), with B's rows of Q and K permuted into GGML's rotary layout as
  the model's own Q and K weights are;
- ``mlx/``: ``adapter_config.json`` + ``adapters.safetensors`` as mlx-lm's tuner saves them
  (``lora_a`` is ``(in, rank)``, ``lora_b`` is ``(rank, out)``, ``scale`` given outright).

B is not zero (a trained adapter's never is): the delta is about as large as the base weight, so
greedy output changes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unillm.testing._tiny import TinyModel, _permute_rope, _write_json, file_digest

__all__ = ["TinyLora", "tiny_lora"]

LORA_BUILDER_VERSION = 1

#: HF module name -> (GGUF tensor name in a block, is it under self_attn)
_MODULES: dict[str, tuple[str, str]] = {
    "q_proj": ("attn_q", "self_attn"),
    "k_proj": ("attn_k", "self_attn"),
    "v_proj": ("attn_v", "self_attn"),
    "o_proj": ("attn_output", "self_attn"),
    "gate_proj": ("ffn_gate", "mlp"),
    "up_proj": ("ffn_up", "mlp"),
    "down_proj": ("ffn_down", "mlp"),
}


#: (layer, HF module) -> (A (rank, in), B (out, rank)), f32
Pairs = dict[tuple[int, str], tuple[Any, Any]]


@dataclass(frozen=True)
class TinyLora:
    """Where a built adapter lies, in each format, and its numbers."""

    root: Path
    peft_dir: Path
    gguf_path: Path
    mlx_dir: Path
    rank: int
    alpha: float

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def tiny_lora(
    model: TinyModel,
    rank: int = 4,
    *,
    seed: int = 1,
    alpha: float | None = None,
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    force: bool = False,
) -> TinyLora:
    """A random LoRA adapter for ``model`` in PEFT, GGUF and mlx-lm form, built on first use.

    ``alpha`` defaults to ``2 * rank`` (scale 2). The adapter is cached under the model's
    directory, keyed by the digest of its weights and these arguments.
    """
    unknown = [t for t in targets if t not in _MODULES]
    if unknown or not targets:
        raise ValueError(f"targets are some of {tuple(_MODULES)}, got {targets!r}")
    if rank < 1:
        raise ValueError(f"rank must be at least 1, got {rank}")
    alpha = float(2 * rank if alpha is None else alpha)
    weights = model.hf_dir / "model.safetensors"
    digest = file_digest(weights)
    key = {
        "builder": LORA_BUILDER_VERSION,
        "weights": digest,
        "rank": rank,
        "alpha": alpha,
        "seed": seed,
        "targets": list(targets),
    }
    root = model.root / "lora" / f"{digest[:12]}-r{rank}-s{seed}-{'-'.join(targets)}"
    lora = TinyLora(root, root / "peft", root / "tiny-lora.gguf", root / "mlx", rank, alpha)
    stamp = root / ".unillm-lora.json"
    want = json.dumps(key, sort_keys=True)
    if not force and stamp.is_file() and stamp.read_text() == want and lora.gguf_path.is_file():
        return lora

    from safetensors.numpy import load_file

    shapes = {name: tuple(t.shape) for name, t in load_file(str(weights)).items()}
    pairs = _random_pairs(model, shapes, rank, seed, targets)
    root.mkdir(parents=True, exist_ok=True)
    _write_peft(lora, pairs, targets, model)
    _write_gguf(lora, pairs, model)
    _write_mlx(lora, pairs, targets, model)
    stamp.write_text(want)
    return lora


def _random_pairs(
    model: TinyModel, shapes: dict[str, tuple[int, ...]], rank: int, seed: int, targets: tuple[str, ...]
) -> Pairs:
    import numpy as np

    rng = np.random.default_rng(seed)
    pairs: Pairs = {}
    for layer in range(model.spec.num_layers):
        for module in targets:
            out_f, in_f = shapes[f"model.layers.{layer}.{_MODULES[module][1]}.{module}.weight"]
            a = (rng.standard_normal((rank, in_f)) / np.sqrt(in_f)).astype(np.float32)
            # A x has unit entries; scale x B (A x) about as large as W x (unit entries too)
            b = (0.5 * rng.standard_normal((out_f, rank)) / np.sqrt(rank)).astype(np.float32)
            pairs[(layer, module)] = (a, b)
    return pairs


def _write_peft(lora: TinyLora, pairs: Pairs, targets: tuple[str, ...], model: TinyModel) -> None:
    from safetensors.numpy import save_file

    lora.peft_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, Any] = {}
    for (layer, module), (a, b) in pairs.items():
        p = f"base_model.model.model.layers.{layer}.{_MODULES[module][1]}.{module}."
        tensors[p + "lora_A.weight"] = a
        tensors[p + "lora_B.weight"] = b
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model.hf_dir),
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    _write_json(lora.peft_dir / "adapter_config.json", config)
    save_file(tensors, str(lora.peft_dir / "adapter_model.safetensors"), metadata={"format": "pt"})


def _write_gguf(lora: TinyLora, pairs: Pairs, model: TinyModel) -> None:
    import gguf

    heads = {"q_proj": model.spec.num_heads, "k_proj": model.spec.num_kv_heads}
    tmp = lora.gguf_path.with_suffix(".gguf.partial")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, lora.alpha)
    for (layer, module), (a, b) in pairs.items():
        name = f"blk.{layer}.{_MODULES[module][0]}.weight"
        if module in heads:  # B's output rows follow the base weight's rotary permutation
            b_rows = _permute_rope(b, heads[module])
        else:
            b_rows = b
        w.add_tensor(name + ".lora_a", a)
        w.add_tensor(name + ".lora_b", b_rows)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(lora.gguf_path)


def _write_mlx(lora: TinyLora, pairs: Pairs, targets: tuple[str, ...], model: TinyModel) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    lora.mlx_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, Any] = {}
    for (layer, module), (a, b) in pairs.items():
        p = f"model.layers.{layer}.{_MODULES[module][1]}.{module}."
        tensors[p + "lora_a"] = np.ascontiguousarray(a.T)
        tensors[p + "lora_b"] = np.ascontiguousarray(b.T)
    config = {
        "fine_tune_type": "lora",
        "num_layers": model.spec.num_layers,
        "lora_parameters": {
            "rank": lora.rank,
            "scale": lora.scale,
            "dropout": 0.0,
            "keys": [f"{_MODULES[t][1]}.{t}" for t in targets],
        },
    }
    _write_json(lora.mlx_dir / "adapter_config.json", config)
    save_file(tensors, str(lora.mlx_dir / "adapters.safetensors"))
