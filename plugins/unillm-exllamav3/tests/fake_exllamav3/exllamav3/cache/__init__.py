"""Cache and its layer types, as exllamav3/cache/{cache,fp16,quant}.py (v1.6.5): one layer per
attention layer, tensors allocated when the model loads (``initialized`` from then until it
unloads), ``storage_size()`` per layer."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from exllamav3 import _fake
from exllamav3.constants import PAGE_SIZE

__all__ = ["Cache", "CacheLayer", "CacheLayer_fp16", "CacheLayer_quant"]


class CacheLayer:
    def __init__(self, config: Any, attention: Any, cache_id: int, max_num_tokens: int, **kwargs: Any):
        self.config = config
        self.attention = attention
        self.cache_id = cache_id
        self.max_num_tokens = max_num_tokens
        self.token_dim = config.num_kv_heads * config.head_dim

    def storage_size(self) -> int:
        raise NotImplementedError

    def overhead_size(self) -> int:
        return 0


class CacheLayer_fp16(CacheLayer):
    def __init__(self, config: Any, attention: Any, cache_id: int, max_num_tokens: int, **kwargs: Any):
        super().__init__(config, attention, cache_id, max_num_tokens)
        assert max_num_tokens % PAGE_SIZE == 0, f"max_num_tokens must be a multiple of {PAGE_SIZE}."
        self.shape = (max_num_tokens // PAGE_SIZE, PAGE_SIZE, config.num_kv_heads, config.head_dim)

    def storage_size(self) -> int:
        return int(2 * np.prod(self.shape) * 2)


class CacheLayer_quant(CacheLayer):
    def __init__(
        self,
        config: Any,
        attention: Any,
        cache_id: int,
        max_num_tokens: int,
        k_bits: int,
        v_bits: int,
        **kwargs: Any,
    ):
        super().__init__(config, attention, cache_id, max_num_tokens)
        assert max_num_tokens % PAGE_SIZE == 0, f"max_num_tokens must be a multiple of {PAGE_SIZE}."
        assert (2 <= k_bits <= 8) and (2 <= v_bits <= 8), "quantized cache must be from 2 to 8 bits"
        self.k_bits, self.v_bits = k_bits, v_bits
        pages = max_num_tokens // PAGE_SIZE
        self.shape = (pages, PAGE_SIZE, config.num_kv_heads, config.head_dim)
        self.qshape_k = (pages, PAGE_SIZE, self.token_dim // 32 * k_bits)
        self.qshape_v = (pages, PAGE_SIZE, self.token_dim // 32 * v_bits)
        self.qshape_s = (pages, PAGE_SIZE, self.token_dim // 32)

    def storage_size(self) -> int:
        return int(np.prod(self.qshape_k) * 4 + np.prod(self.qshape_v) * 4 + 2 * np.prod(self.qshape_s) * 2)

    def overhead_size(self) -> int:
        return int(2 * np.prod(self.shape[2:]) * 2)


class Cache:
    """``Cache(model, max_num_tokens, layer_type=None, max_batch_size=16, max_history=0,
    recurrent_dtype=torch.half, **kwargs)``; ``k_bits``/``v_bits`` go to ``CacheLayer_quant``.
    Create it before ``model.load()``: loading allocates it and sets ``initialized``."""

    def __init__(
        self,
        model: Any,
        max_num_tokens: int,
        layer_type: type[CacheLayer] | None = None,
        max_batch_size: int = 16,
        max_history: int = 0,
        recurrent_dtype: Any = None,
        **kwargs: Any,
    ) -> None:
        self.model = model
        # set by Model.load(), cleared by Model.unload(): a cache is usable only after a load of
        # the model it was attached to
        self.initialized = False
        self.config = model.config
        self.max_num_tokens = max_num_tokens
        self.layer_type = layer_type or CacheLayer_fp16
        self.num_layers = self.config.num_hidden_layers
        self.layers = {
            i: self.layer_type(self.config, None, id(self), max_num_tokens, **kwargs)
            for i in range(self.num_layers)
        }
        self.num_slots = max_batch_size
        self.max_history = max_history
        self.num_recurrent_layers = 0  # the fake's architectures have none
        self._allocated: list[tuple[int, int]] = []
        # attached: the model's next load allocates it (one created after the load never is, and
        # a generator over it refuses to iterate)
        model.cache_weakrefs[id(self)] = weakref.ref(self)

    def detach_from_model(self, model: Any = None) -> None:
        (model or self.model).cache_weakrefs.pop(id(self), None)
        self.fake_free()

    def fake_alloc(self, devices: list[int]) -> None:
        total = sum(layer.storage_size() + layer.overhead_size() for layer in self.layers.values())
        share = -(-total // len(devices))
        try:
            for d in devices:
                _fake.allocate(d, share)
                self._allocated.append((d, share))
        except BaseException:
            self.fake_free()
            raise

    def fake_free(self) -> None:
        for d, nbytes in self._allocated:
            _fake.release(d, nbytes)
        self._allocated = []

    def __del__(self) -> None:
        self.fake_free()
