"""ExLlamaV2: weights placed on fake GPUs (manual split or autosplit) and a toy next-token table."""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from exllamav2 import _fake

if TYPE_CHECKING:
    from exllamav2.cache import ExLlamaV2CacheBase
    from exllamav2.config import ExLlamaV2Config


class ExLlamaV2:
    """A model: ``load(gpu_split)`` or ``load_autosplit(cache)``, ``unload()``.

    Its modules are the embedding, one per layer and the head; each weighs an equal share of the
    safetensors files. ``fake_load_calls`` records how it was loaded (for tests).
    """

    def __init__(self, config: ExLlamaV2Config, lazy_load: bool = False, archparams: Any = None) -> None:
        self.config = config
        self.loaded = False
        self.cache_map: dict[int, str] = {}
        self.fake_load_calls: list[tuple[str, Any]] = []
        n = config.num_hidden_layers + 2
        total = sum(os.path.getsize(f) for f in config.tensor_files)
        self._module_bytes = [total // n] * n
        self._placed: list[int] = []  # device of each loaded module
        with open(config.model_config, "rb") as f:
            seed = zlib.crc32(f.read())
        rng = np.random.default_rng(seed)
        v = config.vocab_size
        self._a = (4.0 * rng.standard_normal((v, v))).astype(np.float32)
        self._b = (2.0 * rng.standard_normal((v, v))).astype(np.float32)
        self._b += self._printable_bias(config)[None, :]

    @staticmethod
    def _printable_bias(config: ExLlamaV2Config) -> Any:
        """A toy model's taste: it prefers tokens that print on their own (no lone UTF-8 bytes,
        control characters or special tokens other than EOS), so outputs read as text."""
        bias = np.zeros(config.vocab_size, dtype=np.float32)
        path = os.path.join(config.model_dir or "", "tokenizer.json")
        if not os.path.exists(path):
            return bias
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(path)
        for i in range(min(config.vocab_size, tok.get_vocab_size())):
            piece = tok.decode([i], skip_special_tokens=False)
            if i != config.eos_token_id and (
                "\ufffd" in piece or piece.startswith("<|") or not piece.isprintable()
            ):
                bias[i] = -30.0
        return bias

    # ---- loading ----

    def load(
        self,
        gpu_split: list[float] | None = None,
        lazy: bool = False,
        stats: bool = False,
        callback: Callable[[int, int], None] | None = None,
        callback_gen: Any = None,
        progress: bool = False,
    ) -> None:
        """Manual split: GB of weights per GPU, in order; None uses the first GPU only."""
        self.fake_load_calls.append(("load", gpu_split))
        budgets = [int(gb * 1024**3) for gb in (gpu_split or [99999])]
        device = 0
        try:
            for size in self._module_bytes:
                while device < len(budgets) - 1 and budgets[device] < size:
                    device += 1
                _fake.allocate(device, size)
                budgets[device] -= size
                self._placed.append(device)
        except Exception:
            self.unload()
            raise
        self._set_cache_map()
        self.loaded = True

    def load_autosplit(
        self,
        cache: ExLlamaV2CacheBase,
        reserve_vram: int | list[int] | None = None,
        last_id_only: bool = False,
        callback: Callable[[int, int], None] | None = None,
        callback_gen: Any = None,
        progress: bool = False,
    ) -> None:
        """Fill each GPU in turn with modules and, beside each attention layer, its cache layer."""
        self.fake_load_calls.append(("load_autosplit", reserve_vram))
        device = 0
        for idx, size in enumerate(self._module_bytes):
            layer = idx - 1 if 0 < idx <= self.config.num_hidden_layers else None
            need = size + (cache.fake_layer_bytes() if layer is not None else 0)
            while True:
                try:
                    _fake.allocate(device, need)
                    break
                except _fake.OutOfMemoryError:
                    device += 1
                    if device >= len(_fake.GPU_MEMORY):
                        self.unload()
                        cache.fake_release()
                        raise RuntimeError("Insufficient VRAM for model and cache") from None
            _fake.release(device, need - size)
            self._placed.append(device)
            if layer is not None:
                self.cache_map[layer] = f"cuda:{device}"
                cache.fake_allocate_layer(layer)
        self.loaded = True

    def _set_cache_map(self) -> None:
        for layer in range(self.config.num_hidden_layers):
            self.cache_map[layer] = f"cuda:{self._placed[layer + 1]}"

    def unload(self) -> None:
        for device, size in zip(self._placed, self._module_bytes, strict=False):
            _fake.release(device, size)
        self._placed = []
        self.cache_map = {}
        self.loaded = False

    def get_cache_devices(self) -> list[str]:
        return sorted(set(self.cache_map.values()))

    # ---- the toy forward pass ----

    def fake_logits(self, ids: list[int]) -> Any:
        """Next-token logits after ``ids``: a seeded function of the last two tokens."""
        assert self.loaded, "model is not loaded"
        last = ids[-1]
        prev = ids[-2] if len(ids) > 1 else 0
        return self._a[last] + self._b[prev]
