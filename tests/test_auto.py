"""auto_engine walks down the plan when a load runs out of memory, and records every step."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

import pytest
from pydantic import BaseModel, ConfigDict

from unillm import OutOfMemory, Registry, auto_engine
from unillm.testing import MockEngine


class KVOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kv_cache_type: Literal["f16", "q8_0"] = "f16"


class Hungry(MockEngine):
    """Runs out of memory above 4096 tokens of context."""

    name: ClassVar[str] = "hungry"
    formats: ClassVar[frozenset[str]] = frozenset({"gguf"})
    Options: ClassVar[type[BaseModel]] = KVOptions
    loads: ClassVar[list[tuple[int | None, str]]] = []

    def _load(self) -> None:
        ctx = self.config.context_length
        Hungry.loads.append((ctx, self.options.kv_cache_type))
        if self.fits():
            return
        raise OutOfMemory(f"KV cache of {ctx} tokens does not fit")

    def fits(self) -> bool:
        return (self.config.context_length or 0) <= 4096


class NeedsQuantizedKV(Hungry):
    name: ClassVar[str] = "needs-q8"

    def fits(self) -> bool:
        return self.options.kv_cache_type == "q8_0"


class NeverFits(Hungry):
    name: ClassVar[str] = "never-fits"

    def fits(self) -> bool:
        return False


class Fallback(MockEngine):
    name: ClassVar[str] = "fallback"
    formats: ClassVar[frozenset[str]] = frozenset({"gguf"})


def registry(*classes: type) -> Registry:
    reg = Registry(builtins=False, entry_points=False)
    for cls in classes:
        reg.register_backend(cls, source="test")
    return reg


@pytest.fixture(autouse=True)
def _reset_loads() -> None:
    Hungry.loads.clear()


class Tight(Hungry):
    """Runs out of memory above 1500 tokens of context."""

    name: ClassVar[str] = "tight"

    def fits(self) -> bool:
        return (self.config.context_length or 0) <= 1500


def test_more_than_the_trained_context_walks_down_to_it(tiny_gguf: Path) -> None:
    e = auto_engine(tiny_gguf, backend="hungry", context_length=32768, registry=registry(Hungry))
    assert e.config.context_length == 4096  # the tiny model's trained context
    assert [ctx for ctx, _ in Hungry.loads] == [32768, 4096]
    assert e.selection is not None
    (step,) = e.selection.steps
    assert "KV cache of 32768 tokens does not fit" in step and "retrying with context_length=4096" in step
    assert "steps:" in e.selection.explain()


def test_the_context_is_halved_until_it_fits(tiny_gguf: Path) -> None:
    e = auto_engine(tiny_gguf, backend="tight", context_length=4096, registry=registry(Tight))
    assert [ctx for ctx, _ in Hungry.loads] == [4096, 2048, 1024]
    assert e.selection is not None and len(e.selection.steps) == 2


def test_then_a_quantized_kv_cache(tiny_gguf: Path) -> None:
    e = auto_engine(tiny_gguf, backend="needs-q8", context_length=2048, registry=registry(NeedsQuantizedKV))
    assert e.options.kv_cache_type == "q8_0"
    assert Hungry.loads == [(2048, "f16"), (1024, "f16"), (1024, "q8_0")]
    assert e.selection is not None and "quantized KV cache {'kv_cache_type': 'q8_0'}" in e.selection.steps[-1]


def test_then_the_next_backend(tiny_gguf: Path) -> None:
    e = auto_engine(tiny_gguf, context_length=2048, registry=registry(NeverFits, Fallback))
    assert e.name == "fallback"
    assert e.selection is not None
    assert "never-fits failed to load" in e.selection.steps[-1] and "next backend" in e.selection.steps[-1]


def test_out_of_memory_everywhere_is_raised(tiny_gguf: Path) -> None:
    with pytest.raises(OutOfMemory, match="does not fit"):
        auto_engine(tiny_gguf, backend="never-fits", context_length=2048, registry=registry(NeverFits))


class LayerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n_gpu_layers: int | Literal["auto"] | None = None


class Offloader(MockEngine):
    """Offloads by layer; runs out of GPU memory with more than one layer on the GPU."""

    name: ClassVar[str] = "offloader"
    formats: ClassVar[frozenset[str]] = frozenset({"gguf"})
    Options: ClassVar[type[BaseModel]] = LayerOptions
    tried: ClassVar[list[object]] = []

    def _load(self) -> None:
        layers = self.options.n_gpu_layers
        Offloader.tried.append(layers)
        if layers is None or (isinstance(layers, int) and layers > 1):
            raise OutOfMemory("weights do not fit on the GPU")


def test_fewer_gpu_layers_where_there_is_a_gpu(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from unillm import GPU, Hardware, _auto

    gpu = Hardware(
        "Linux", "x86_64", "cpu", 8, (), 64 * 10**9, gpus=(GPU(0, "nvidia", "RTX 4090", 24 * 10**9),)
    )
    monkeypatch.setattr(_auto, "_machine", lambda: gpu)
    Offloader.tried.clear()
    e = auto_engine(tiny_gguf, backend="offloader", context_length=1024, registry=registry(Offloader))
    assert Offloader.tried == [None, 1]  # the tiny model has 2 layers: half of them
    assert e.selection is not None and "retrying with n_gpu_layers=1" in e.selection.steps[0]


def test_no_gpu_no_layer_step(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from unillm import Hardware, _auto

    monkeypatch.setattr(_auto, "_machine", lambda: Hardware("Linux", "x86_64", "cpu", 8, (), 64 * 10**9))
    Offloader.tried.clear()
    with pytest.raises(OutOfMemory):
        auto_engine(tiny_gguf, backend="offloader", context_length=1024, registry=registry(Offloader))
    assert Offloader.tried == [None]
