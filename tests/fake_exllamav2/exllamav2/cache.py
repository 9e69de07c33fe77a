"""KV caches: FP16 and grouped-quantized (Q4/Q6/Q8), with exllamav2's tensor shapes."""

from __future__ import annotations

from typing import Any

from exllamav2 import _fake


class ExLlamaV2CacheBase:
    """Shapes as in exllamav2: per layer K and V of (batch, max_seq_len, kv_heads, head_dim //
    weights_per_element), plus fp16 scales of head_dim // 32 for quantized caches."""

    def __init__(
        self,
        model: Any,
        batch_size: int,
        max_seq_len: int,
        itemsize: int,
        weights_per_element_k: int,
        weights_per_element_v: int,
        has_scales: bool,
        num_key_value_heads: int | None = None,
        fixed_device: int | None = None,
    ) -> None:
        self.model = model
        self.max_seq_len = max_seq_len if max_seq_len != -1 else model.config.max_seq_len
        self.batch_size = batch_size
        self.itemsize = itemsize
        self.weights_per_element_k = weights_per_element_k
        self.weights_per_element_v = weights_per_element_v
        self.has_scales = has_scales
        self.num_key_value_heads = num_key_value_heads or model.config.num_key_value_heads
        self.num_hidden_layers = model.config.num_hidden_layers
        self.head_dim = model.config.head_dim
        self.current_seq_len = 0
        self.fixed_device = fixed_device
        self.q_block = 0
        self.key_states: list[str | None] = []  # the device of each layer's tensors, None = lazy
        self.value_states: list[str | None] = []

    def create_state_tensors(self, copy_from: Any, lazy: bool = False) -> None:
        self.key_states = [None] * self.num_hidden_layers
        self.value_states = [None] * self.num_hidden_layers
        if not lazy:
            for layer in range(self.num_hidden_layers):
                self.fake_allocate_layer(layer)

    # ---- fake bookkeeping ----

    def fake_layer_bytes(self) -> int:
        tokens = self.batch_size * self.max_seq_len * self.num_key_value_heads
        k = tokens * self.head_dim // self.weights_per_element_k * self.itemsize
        v = tokens * self.head_dim // self.weights_per_element_v * self.itemsize
        scales = 2 * tokens * (self.head_dim // 32) * 2 if self.has_scales else 0
        return k + v + scales

    def fake_temp_bytes(self) -> int:
        """Quantized caches keep one FP16 K and V buffer of the cache's shape per GPU."""
        return 2 * self.batch_size * self.max_seq_len * self.num_key_value_heads * self.head_dim * 2

    def fake_allocate_layer(self, layer: int) -> None:
        device = self.model.cache_map.get(layer, "cpu")
        if device != "cpu":
            index = int(device.split(":")[1])
            fresh = self.has_scales and device not in self.key_states
            try:
                _fake.allocate(index, self.fake_layer_bytes() + (self.fake_temp_bytes() if fresh else 0))
            except Exception:
                self.fake_release()
                raise
        self.key_states[layer] = self.value_states[layer] = device

    def fake_release(self) -> None:
        seen: set[str] = set()
        for layer, device in enumerate(self.key_states):
            if device is not None and device != "cpu":
                fresh = self.has_scales and device not in seen
                seen.add(device)
                nbytes = self.fake_layer_bytes() + (self.fake_temp_bytes() if fresh else 0)
                _fake.release(int(device.split(":")[1]), nbytes)
            self.key_states[layer] = self.value_states[layer] = None

    def __del__(self) -> None:  # torch frees a tensor's GPU memory when it is collected
        self.fake_release()

    # ---- exllamav2's API ----

    def footprint(self) -> list[int]:
        """Bytes per GPU."""
        fp: list[int] = []
        for device in self.key_states:
            assert device is not None, "cache tensors are not allocated"
            index = 0 if device == "cpu" else int(device.split(":")[1])
            while len(fp) <= index:
                fp.append(0)
            fp[index] += self.fake_layer_bytes()
        if self.has_scales:
            for device in set(self.key_states):
                fp[0 if device == "cpu" else int(str(device).split(":")[1])] += self.fake_temp_bytes()
        return fp

    def all_tensors(self) -> list[Any]:
        return [*self.key_states, *self.value_states]

    def reset(self) -> None:
        self.current_seq_len = 0


class ExLlamaV2Cache(ExLlamaV2CacheBase):
    """FP16 cache."""

    def __init__(
        self,
        model: Any,
        batch_size: int = 1,
        max_seq_len: int = -1,
        copy_from: Any = None,
        lazy: bool = False,
        num_key_value_heads: int | None = None,
        fixed_device: int | None = None,
    ) -> None:
        super().__init__(model, batch_size, max_seq_len, 2, 1, 1, False, num_key_value_heads, fixed_device)
        self.create_state_tensors(copy_from, lazy)


class ExLlamaV2Cache_8bit(ExLlamaV2Cache):
    """FP8 cache (the dynamic generator refuses it)."""


class ExLlamaV2Cache_Q(ExLlamaV2CacheBase):
    """Grouped quantized cache; max_seq_len rounds up to whole quantization blocks."""

    wbits = 0

    def __init__(
        self,
        model: Any,
        batch_size: int = 1,
        max_seq_len: int = -1,
        copy_from: Any = None,
        lazy: bool = False,
        weights_per_byte_k: int = -1,
        weights_per_byte_v: int = -1,
        num_key_value_heads: int | None = None,
        fixed_device: int | None = None,
    ) -> None:
        super().__init__(
            model,
            batch_size,
            max_seq_len,
            1,
            weights_per_byte_k,
            weights_per_byte_v,
            True,
            num_key_value_heads,
            fixed_device,
        )
        kv_dim = self.num_key_value_heads * self.head_dim
        self.q_block = 1
        while (kv_dim * self.q_block) % 512:
            self.q_block += 1
        self.max_seq_len = (self.max_seq_len + self.q_block - 1) // self.q_block * self.q_block
        self.create_state_tensors(copy_from, lazy)


class _FixedBits(ExLlamaV2Cache_Q):
    """The public quantized caches: ExLlamaV2Cache_Q's arguments less the packing, which each
    class fixes (K and V weights per byte)."""

    per_byte: tuple[int, int] = (1, 1)

    def __init__(
        self,
        model: Any,
        batch_size: int = 1,
        max_seq_len: int = -1,
        copy_from: Any = None,
        lazy: bool = False,
        num_key_value_heads: int | None = None,
        fixed_device: int | None = None,
    ) -> None:
        k, v = self.per_byte
        super().__init__(
            model, batch_size, max_seq_len, copy_from, lazy, k, v, num_key_value_heads, fixed_device
        )


class ExLlamaV2Cache_Q4(_FixedBits):
    wbits = 4
    per_byte = (2, 2)


class ExLlamaV2Cache_Q6(_FixedBits):
    wbits = 6
    per_byte = (1, 2)


class ExLlamaV2Cache_Q8(_FixedBits):
    wbits = 8
    per_byte = (1, 1)
