"""Model: ``Model.from_config(config)``, ``load(...)`` onto fake GPUs, ``unload()``, and a toy
next-token table in place of the forward pass.

The load arguments are those of exllamav3/model/model.py ``load_gen`` (v1.6.5), with its
assertions; loading allocates every attached cache and marks it ``initialized`` (exllamav3 ties
cache tensors to the load), unloading clears that.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from exllamav3 import _fake

if TYPE_CHECKING:
    from exllamav3.model.config import Config


class Model:
    """Fake only, for tests: ``fake_load_calls`` records each ``load``'s keyword arguments,
    ``fake_devices`` the devices it was placed on."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        self.config = config
        self.caps: dict[str, Any] = {"supports_tp": True}
        self.draft_verifier_params: dict[str, Any] = {}  # what a drafter adds to the verifying pass
        self.active_devices: list[int] = []
        self.output_device: int | None = None
        self.cache_weakrefs: dict[int, Any] = {}
        self.loaded_tp = False
        self.component = "text"
        self.fake_load_calls: list[dict[str, Any]] = []
        self._placed: list[tuple[int, int]] = []  # (device, bytes)
        self._weights_bytes = sum(os.path.getsize(f) for f in config.tensor_files)
        with open(config.config_filename, "rb") as f:
            seed = zlib.crc32(f.read())
        rng = np.random.default_rng(seed)
        v = config.vocab_size
        self._a = (4.0 * rng.standard_normal((v, v))).astype(np.float32)
        self._b = (2.0 * rng.standard_normal((v, v))).astype(np.float32)
        self._b += self._printable_bias(config)[None, :]

    @staticmethod
    def from_config(config: Config, component: str = "text", **kwargs: Any) -> Model:
        assert component in config.model_classes, (
            f"{config.architecture} does not define a '{component}' component model"
        )
        model: Model = config.model_classes[component](config, **kwargs)
        model.component = component
        return model

    @staticmethod
    def _printable_bias(config: Config) -> Any:
        """The toy model prefers tokens that print on their own (no lone UTF-8 bytes, control
        characters or special tokens other than EOS), so that outputs read as text."""
        bias = np.zeros(config.vocab_size, dtype=np.float32)
        path = os.path.join(config.directory, "tokenizer.json")
        if not os.path.exists(path):
            return bias
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(path)
        for i in range(min(config.vocab_size, tok.get_vocab_size())):
            piece = tok.decode([i], skip_special_tokens=False)
            if i not in config.eos_token_id_list and (
                "\ufffd" in piece or piece.startswith("<|") or not piece.isprintable()
            ):
                bias[i] = -30.0
        return bias

    # ---- loading ----

    def load(
        self,
        device: Any = None,
        tp_output_device: Any = None,
        reserve_per_device: list[float] | float | None = None,
        use_per_device: list[float] | float | None = None,
        tensor_p: bool = False,
        progressbar: bool = False,
        max_chunk_size: int = 2048,
        max_output_size: int = 32,
        max_output_factor: int = 1,
        callback: Callable[[int, int], None] | None = None,
        generator: bool = True,
        tp_dev_limits: dict[str, int] | None = None,
        tp_backend: str = "native",
        verbose: bool = False,
        max_batch_size: int = 1,
        tp_options: dict[str, Any] | None = None,
        autosplit_no_forward: bool = False,
        draft_model: Any = None,
    ) -> None:
        self.fake_load_calls.append(
            {
                "device": device,
                "reserve_per_device": reserve_per_device,
                "use_per_device": use_per_device,
                "tensor_p": tensor_p,
                "max_chunk_size": max_chunk_size,
                "tp_backend": tp_backend,
                "max_batch_size": max_batch_size,
                "tp_options": tp_options,
                "draft_model": draft_model,
            }
        )
        assert not (bool(reserve_per_device) and bool(use_per_device)), (
            "Cannot specify both memory usage and memory reserve."
        )
        assert max_chunk_size >= 1, "max_chunk_size must be positive"
        caches = [ref() for ref in self.cache_weakrefs.values() if ref() is not None]
        try:
            if device is not None:
                assert not bool(reserve_per_device) and not bool(use_per_device), (
                    "Cannot specify reserve_per_device or use_per_device when loading to single device."
                )
                assert not tensor_p, "Cannot use tensor_p when loading to single device."
                index = _device_index(device)
                self._alloc(index, self._weights_bytes)
                self.active_devices = [index]
            else:
                devices = self._usable_devices(use_per_device, reserve_per_device)
                if tensor_p:
                    share = -(-self._weights_bytes // len(devices))
                    for d in devices:
                        self._alloc(d, share)
                    self.active_devices = devices
                    self.loaded_tp = True
                else:  # autosplit: fill each device in turn
                    left = self._weights_bytes
                    for d in devices:
                        take = min(left, max(0, _fake.free_bytes(d) - 2**20))
                        if take:
                            self._alloc(d, take)
                            self.active_devices.append(d)
                        left -= take
                        if not left:
                            break
                    if left:
                        _fake.allocate(devices[-1], left)  # raises OutOfMemoryError
            self.output_device = self.active_devices[-1]
            for cache in caches:
                cache.fake_alloc(self.active_devices)
                cache.initialized = True
        except BaseException:
            self.unload()
            raise

    def _usable_devices(self, use: Any, reserve: Any) -> list[int]:
        n = len(_fake.GPU_MEMORY)
        if isinstance(use, list):
            return [i for i, gb in enumerate(use) if gb and i < n]
        if isinstance(reserve, list):
            return [i for i in range(n) if i >= len(reserve) or reserve[i] >= 0]
        return list(range(n))

    def _alloc(self, device: int, nbytes: int) -> None:
        _fake.allocate(device, nbytes)
        self._placed.append((device, nbytes))

    def unload(self) -> None:
        for device, nbytes in self._placed:
            _fake.release(device, nbytes)
        self._placed = []
        for ref in list(self.cache_weakrefs.values()):
            cache = ref()
            if cache is not None:
                cache.fake_free()
                cache.initialized = False
        self.active_devices = []
        self.output_device = None
        self.loaded_tp = False

    # ---- the toy forward pass ----

    def fake_logits(self, ids: list[int]) -> Any:
        """Next-token logits after ``ids``: a seeded function of the last two tokens."""
        assert self.active_devices, "model is not loaded"
        last = ids[-1]
        prev = ids[-2] if len(ids) > 1 else 0
        return self._a[last] + self._b[prev]


def _device_index(device: Any) -> int:
    if isinstance(device, int):
        return device
    text = str(device)
    assert text.startswith("cuda"), f"the fake loads on CUDA devices only, not {device!r}"
    return int(text.partition(":")[2] or 0)
