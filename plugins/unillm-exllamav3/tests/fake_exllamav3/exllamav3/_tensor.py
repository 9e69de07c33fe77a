"""A stand-in for the few ``torch.Tensor`` methods exllamav3's callers use (no torch here)."""

from __future__ import annotations

from typing import Any

import numpy as np


class _Device:
    type = "cpu"
    index = None

    def __repr__(self) -> str:
        return "device(type='cpu')"


_CPU = _Device()


class Tensor:
    """A CPU tensor over a numpy array: ``shape``, ``dim()``, indexing, iteration over rows,
    ``tolist()``, ``item()``, ``numpy()``, ``cpu()``, ``new_tensor()``, ``clone()``, ``device``."""

    __slots__ = ("_a",)

    def __init__(self, data: Any, dtype: Any = None) -> None:
        self._a = np.array(data, dtype=dtype if dtype is not None else np.int64)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._a.shape)

    @property
    def device(self) -> _Device:
        return _CPU

    @property
    def dtype(self) -> Any:
        return self._a.dtype

    def dim(self) -> int:
        return int(self._a.ndim)

    def tolist(self) -> Any:
        return self._a.tolist()

    def item(self) -> Any:
        return self._a.item()

    def numpy(self) -> Any:
        return self._a

    def cpu(self) -> Tensor:  # torch's: a copy in host memory (this one is there already)
        return self

    def float(self) -> Tensor:
        return Tensor(self._a, np.float32)

    def logsumexp(self, dim: int) -> Tensor:
        a = self._a.astype(np.float64)
        m = a.max(axis=dim, keepdims=True)
        return Tensor(np.squeeze(m, axis=dim) + np.log(np.exp(a - m).sum(axis=dim)), np.float64)

    def clone(self) -> Tensor:
        return Tensor(self._a.copy(), self._a.dtype)

    def new_tensor(self, data: Any) -> Tensor:
        return Tensor(data, self._a.dtype)

    def __getitem__(self, index: Any) -> Tensor:
        return Tensor(self._a[index], self._a.dtype)

    def __iter__(self) -> Any:
        return (Tensor(row, self._a.dtype) for row in self._a)

    def __len__(self) -> int:
        return len(self._a)

    def __repr__(self) -> str:
        return f"tensor({self._a.tolist()})"


def tensor(data: Any, dtype: Any = None) -> Tensor:
    return Tensor(data, dtype)
