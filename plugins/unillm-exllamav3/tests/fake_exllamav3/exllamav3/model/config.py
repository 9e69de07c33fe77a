"""Config: reads config.json like exllamav3/model/config.py (``Config.from_directory``)."""

from __future__ import annotations

import json
import os
from typing import Any

#: architectures the fake knows (exllamav3 has many more); each maps to its model class
_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class Config:
    """An architecture's config. ``from_directory`` asserts what exllamav3's does."""

    def __init__(self, directory: str, model_classes: dict[str, Any], **kwargs: Any) -> None:
        self.directory = directory
        self.model_classes = model_classes
        self.config_filename = os.path.join(directory, "config.json")
        with open(self.config_filename, encoding="utf8") as f:
            self.config_dict: dict[str, Any] = json.load(f)
        arch = self.config_dict["architectures"][0]
        self.architecture = arch
        self.tensor_files = sorted(
            os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".safetensors")
        )
        assert self.tensor_files, f"No .safetensors files found in {directory}"
        cd = self.config_dict
        self.bos_token_id = cd.get("bos_token_id")
        eos = cd.get("eos_token_id")
        self.eos_token_id_list = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
        self.eos_token_id = self.eos_token_id_list[0] if self.eos_token_id_list else None
        self.pad_token_id = cd.get("pad_token_id")
        self.vocab_size = cd.get("vocab_size")
        self.num_hidden_layers = cd["num_hidden_layers"]
        self.num_q_heads = cd["num_attention_heads"]
        self.num_kv_heads = cd.get("num_key_value_heads", self.num_q_heads)
        self.hidden_size = cd["hidden_size"]
        self.head_dim = cd.get("head_dim") or self.hidden_size // self.num_q_heads
        self.max_position_embeddings = cd.get("max_position_embeddings", 8192)
        self.quantization_config = cd.get("quantization_config")

    @staticmethod
    def from_directory(directory: str, **kwargs: Any) -> Config:
        from exllamav3.model.model import Model

        config_filename = os.path.join(directory, "config.json")
        with open(config_filename, encoding="utf8") as f:
            config_dict = json.load(f)
        assert "architectures" in config_dict, f"No architecture defined in {config_filename}"
        archs = config_dict["architectures"]
        assert len(archs) == 1, f"Multiple architectures defined in {config_filename}"
        arch = archs[0]
        assert arch in _ARCHS, f"Unknown architecture {arch} in {config_filename}"
        return Config(directory, {"text": Model}, **kwargs)
