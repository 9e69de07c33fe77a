"""ExLlamaV2Lora as exllamav2 0.3.x has it: a PEFT adapter directory read onto the model's linear
layers, enabled for a dynamic generator's jobs with ``generator.set_loras``.

What is real: the files it reads (``adapter_config.json`` with ``r`` and ``lora_alpha``,
``adapter_model.bin`` first, then ``adapter_model.safetensors``), its checks (``fan_in_fan_out``,
keys under ``model.layers.``, A's in-features and B's out-features against the target module,
a non-zero bias) and their ValueErrors, ``lora_scaling *= alpha / r``. What is simulated: the
effect, a seeded logit delta (a function of the adapter's weights, the scaling and the last token)
added to the toy forward pass while the adapter is enabled.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from exllamav2.model import ExLlamaV2

_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _features(config: Any, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a Llama layer's linear module."""
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }[module]


class ExLlamaV2Lora:
    """A LoRA adapter on ``model``; ``unload()`` takes it off."""

    @staticmethod
    def from_directory(model: ExLlamaV2, directory: str, lora_scaling: float = 1.0) -> ExLlamaV2Lora:
        config_path = os.path.join(directory, "adapter_config.json")
        lora_path_bin = os.path.join(directory, "adapter_model.bin")
        lora_path_st = os.path.join(directory, "adapter_model.safetensors")
        if os.path.exists(lora_path_bin):
            return ExLlamaV2Lora(model, config_path, lora_path_bin, lora_scaling)
        if os.path.exists(lora_path_st):
            return ExLlamaV2Lora(model, config_path, lora_path_st, lora_scaling)
        raise ValueError(f"No LoRA found in {directory}")

    def __init__(
        self, model: ExLlamaV2, lora_config_path: str, lora_path: str, lora_scaling: float = 1.0
    ) -> None:
        self.model = model
        self.config = model.config
        self.lora_config_path = lora_config_path
        self.lora_path = lora_path
        self.lora_scaling = lora_scaling
        self.bias_ignored = False
        self.tensors: dict[str, Any] = {}
        with open(lora_config_path, encoding="utf8") as f:
            read_config = json.load(f)
        self.lora_r = read_config["r"]
        self.lora_alpha = float(read_config["lora_alpha"])
        self.lora_scaling *= self.lora_alpha / self.lora_r
        if read_config.get("fan_in_fan_out"):
            raise ValueError(" ## Error: fan_in_fan_out mode not supported.")
        if not lora_path.endswith(".safetensors"):
            raise ValueError(" ## Error: the fake reads .safetensors adapters only")  # no torch here
        from safetensors.numpy import load_file

        crc = 0
        for key, tensor in sorted(load_file(lora_path).items()):
            i = key.find("model.layers.")
            if i == -1:
                raise ValueError(f" ## Error: unsupported layer in {self.lora_path}: {key}")
            target_key = key[i:]
            ks = target_key.split(".")
            module, lora_half = ".".join(ks[4:-2]), ks[-2]
            if lora_half == "bias":
                if np.abs(tensor).max() > 1e-6:
                    raise ValueError(f" ## Error: unsupported bias target {self.lora_path}: {key}")
                self.bias_ignored = True
                continue
            if int(ks[2]) >= self.config.num_hidden_layers or module not in _MODULES:
                raise KeyError(target_key)  # exllamav2's modules_dict lookup
            in_f, out_f = _features(self.config, module)
            if lora_half == "lora_A":
                bad = tensor.shape[1] != in_f
            elif lora_half == "lora_B":
                bad = tensor.shape[0] != out_f
            else:
                raise ValueError(f" ## Error: unsupported layer in {self.lora_path}: {key}")
            if bad:
                raise ValueError(f" ## Error: incompatible tensor shape in {self.lora_path}: {key}")
            self.tensors[target_key] = tensor
            crc = zlib.crc32(np.ascontiguousarray(tensor, dtype=np.float16).tobytes(), crc)
        v = self.config.vocab_size
        rng = np.random.default_rng(crc)
        # the toy effect: as large as the toy model's own logits, times the scaling
        self._delta = (4.0 * self.lora_scaling * rng.standard_normal((v, v))).astype(np.float32)

    def fake_delta(self, ids: list[int]) -> Any:
        """Fake only: what this adapter adds to the toy model's next-token logits."""
        assert self.tensors, "the LoRA was unloaded"
        return self._delta[ids[-1]]

    def unload(self) -> None:
        self.tensors = {}
