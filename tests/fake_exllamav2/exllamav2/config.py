"""ExLlamaV2Config: reads config.json (and generation_config.json) the way exllamav2 does."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

_MISSING = object()


def read(
    data: dict[str, Any], keys: str | list[str], default: Any = _MISSING, types: tuple[type, ...] = (int,)
) -> Any:
    for key in [keys] if isinstance(keys, str) else keys:
        value = data.get(key)
        if value is not None:
            if not isinstance(value, types):
                raise TypeError(f"Value for {key} is not of expected type {types}")
            return value
    if default is not _MISSING:
        return default
    raise ValueError(f"Missing any of the following keys: {keys}")


class ExLlamaV2Config:
    """Model configuration; ``ExLlamaV2Config(model_dir)`` calls ``prepare()`` at once."""

    def __init__(self, model_dir: str | None = None) -> None:
        self.max_batch_size = 1
        self.max_input_len = 2048
        self.max_attention_size = 2048**2
        self.max_output_len = None
        self.scale_pos_emb = 1.0
        self.scale_alpha_value = 1.0
        self.no_flash_attn = "EXLLAMA_NO_FLASH_ATTN" in os.environ
        self.no_xformers = "EXLLAMA_NO_XFORMERS" in os.environ
        self.no_sdpa = "EXLLAMA_NO_SDPA" in os.environ
        self.load_in_q4 = False
        self.no_graphs = "EXLLAMA_NO_GRAPHS" in os.environ
        self.arch_compat_calls = 0
        if model_dir is not None:
            self.model_dir: str | None = model_dir
            self.prepare()
        else:
            self.model_dir = None
        self.max_dq_size = 512 * 1024**2

    def set_low_mem(self) -> None:
        self.max_input_len = 1024
        self.max_attention_size = 1024**2

    def prepare(self, no_tensors: bool = False) -> None:
        assert self.model_dir is not None, "No model_dir specified in ExLlamaV2Config"
        assert os.path.exists(self.model_dir), "Can't find " + self.model_dir
        self.model_config = os.path.join(self.model_dir, "config.json")
        assert os.path.exists(self.model_config), "Can't find " + self.model_config
        with open(self.model_config, encoding="utf8") as f:
            cfg = json.load(f)

        gen_path = os.path.join(self.model_dir, "generation_config.json")
        if os.path.exists(gen_path):
            with open(gen_path, encoding="utf8") as f:
                gen = json.load(f)
            eos = gen.get("eos_token_id")
            self.generation_config = {"eos_token_id": [eos] if isinstance(eos, int) else eos}

        assert len(cfg["architectures"]) == 1, "Multiple architectures defined in config.json"
        self.architecture = cfg["architectures"][0]
        self.bos_token_id = read(cfg, "bos_token_id", None)
        self.eos_token_id = read(cfg, "eos_token_id", None, (int, list))
        self.pad_token_id = read(cfg, "pad_token_id", None)
        self.vocab_size = read(cfg, "vocab_size", 32000)
        if isinstance(self.eos_token_id, list):
            self.eos_token_id = self.eos_token_id[0]
        self.num_hidden_layers = read(cfg, ["num_hidden_layers", "n_layers", "n_layer"])
        self.hidden_size = read(cfg, ["hidden_size", "d_model", "n_embd"])
        self.num_attention_heads = read(cfg, ["num_attention_heads", "n_heads", "n_head"], 0)
        self.head_dim = read(cfg, "head_dim", self.hidden_size // max(self.num_attention_heads, 1))
        self.num_key_value_heads = read(cfg, "num_key_value_heads", self.num_attention_heads)
        self.intermediate_size = read(cfg, "intermediate_size", 4 * self.hidden_size)
        self.max_seq_len = read(
            cfg,
            [
                "max_sequence_length",
                "model_max_length",
                "max_position_embeddings",
                "max_seq_len",
                "n_positions",
            ],
            2048,
        )
        self.original_max_seq_len = self.max_seq_len
        if no_tensors:
            return
        self.tensor_files = glob.glob(os.path.join(self.model_dir, "*.safetensors"))
        if len(self.tensor_files) == 0:
            raise ValueError(f" ## No .safetensors files found in {self.model_dir}")

    def arch_compat_overrides(self, quiet: bool = False, warn_only: bool = False) -> None:
        self.arch_compat_calls += 1
