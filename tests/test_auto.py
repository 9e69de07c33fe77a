"""auto_engine walks down the plan when a load runs out of memory, and records every step."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

import pytest
from pydantic import BaseModel, ConfigDict

from unillm import EngineConfig, OutOfMemory, Registry, UnillmWarning, auto_engine
from unillm.backend import Cost, Facts
from unillm.backend import Fallback as Step
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

    @classmethod
    def fallbacks(cls, config: EngineConfig, facts: Facts) -> list[Step]:
        # declared by the backend, as a plugin would: the core knows no option name
        q8 = Step("kv_cache_type=q8_0", Cost.QUALITY, options={"kv_cache_type": "q8_0"}, kv_cache_dtype="q8")
        return [*super().fallbacks(config, facts), q8]


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
    said = "did not load with context_length=32768 .*it loaded with context_length=4096"
    with pytest.warns(UnillmWarning, match=said):  # reduced, and said
        e = auto_engine(tiny_gguf, backend="hungry", context_length=32768, registry=registry(Hungry))
    assert e.config.context_length == 4096  # the tiny model's trained context
    assert [ctx for ctx, _ in Hungry.loads] == [32768, 4096]
    assert e.selection is not None
    (step,) = e.selection.steps
    assert "KV cache of 32768 tokens does not fit" in step and "retrying with context_length=4096" in step
    assert "steps:" in e.selection.explain()


def test_the_context_is_halved_until_it_fits(tiny_gguf: Path) -> None:
    with pytest.warns(UnillmWarning, match="it loaded with kv_cache_type=q8_0, context_length=1024 "):
        e = auto_engine(tiny_gguf, backend="tight", context_length=4096, registry=registry(Tight))
    # the cheaper step first (a quantized KV cache keeps the context), then the context halves
    assert Hungry.loads == [(4096, "f16"), (4096, "q8_0"), (2048, "q8_0"), (1024, "q8_0")]
    assert e.selection is not None and len(e.selection.steps) == 3


def test_a_quantized_kv_cache_before_a_shorter_context(tiny_gguf: Path) -> None:
    e = auto_engine(tiny_gguf, backend="needs-q8", context_length=4096, registry=registry(NeedsQuantizedKV))
    assert e.options.kv_cache_type == "q8_0"
    assert e.config.context_length == 4096  # all the context asked for is kept
    assert Hungry.loads == [(4096, "f16"), (4096, "q8_0")]
    assert e.selection is not None and "retrying with kv_cache_type=q8_0" in e.selection.steps[-1]


def test_a_backend_without_steps_gets_only_the_context_ones(tiny_gguf: Path) -> None:
    class Plain(MockEngine):
        name: ClassVar[str] = "plain"
        formats: ClassVar[frozenset[str]] = frozenset({"gguf"})
        tried: ClassVar[list[int | None]] = []

        def _load(self) -> None:
            Plain.tried.append(self.config.context_length)
            if (self.config.context_length or 0) > 1024:
                raise OutOfMemory("too long")

    e = auto_engine(tiny_gguf, backend="plain", context_length=4096, registry=registry(Plain))
    assert Plain.tried == [4096, 2048, 1024] and e.config.context_length == 1024


def test_steps_the_plan_says_cannot_fit_are_skipped(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from unillm import Hardware, inspect_model
    from unillm._choose import _auto

    info = inspect_model(tiny_gguf)
    # a machine whose RAM holds the 1024-token plan with a q8_0 cache, and not the 2048-token one
    from unillm import Workload, plan

    roomy = Hardware("Linux", "x86_64", "cpu", 8, (), 2**40, ram_available_bytes=2**40)
    need = [plan(info, roomy, Workload(n, kv_cache_dtype="q8")).total_bytes for n in (1024, 2048)]
    assert need[0] < need[1]
    ram = int((need[0] + need[1]) / 2 / 0.95)
    small = Hardware("Linux", "x86_64", "cpu", 8, (), ram, ram_available_bytes=ram)
    monkeypatch.setattr(_auto, "_machine", lambda: small)

    class Big(Hungry):
        name: ClassVar[str] = "big"

        def fits(self) -> bool:
            return (self.config.context_length or 0) <= 1024

    e = auto_engine(tiny_gguf, backend="big", context_length=4096, registry=registry(Big))
    steps = e.selection.steps if e.selection else []
    # q8_0 at 4096 and 2048 cannot fit by the plan: never loaded; 1024 (the last step) is tried
    assert Hungry.loads == [(4096, "f16"), (1024, "q8_0")], steps
    assert any("skipped kv_cache_type=q8_0" in s for s in steps)
    assert any("skipped context_length=2048" in s for s in steps)


def test_a_failing_fallbacks_hook_leaves_the_load_error(tiny_gguf: Path) -> None:
    class Buggy(Hungry):
        name: ClassVar[str] = "buggy"

        @classmethod
        def fallbacks(cls, config: EngineConfig, facts: Facts) -> list[Step]:
            raise RuntimeError("plugin bug")

    with pytest.raises(OutOfMemory, match="does not fit"):
        auto_engine(tiny_gguf, backend="buggy", context_length=8192, registry=registry(Buggy))


def test_the_backend_is_handed_what_auto_engine_learned(tiny_gguf: Path) -> None:
    seen: list[Facts] = []

    class Reader(MockEngine):
        name: ClassVar[str] = "reader"
        formats: ClassVar[frozenset[str]] = frozenset({"gguf"})

        def _load(self) -> None:
            seen.append(self.facts)

    auto_engine(tiny_gguf, backend="reader", registry=registry(Reader))
    (facts,) = seen
    # computed once by auto_engine and handed in, not re-read by the backend
    assert {"model", "hardware", "plan"} <= set(vars(facts))
    assert facts.model is not None and facts.model.format == "gguf"


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

    @classmethod
    def fallbacks(cls, config: EngineConfig, facts: Facts) -> list[Step]:
        layers = getattr(facts.model, "layers", None)
        if facts.hardware is None or not facts.hardware.gpus or not layers:
            return [*super().fallbacks(config, facts)]
        half = Step(f"n_gpu_layers={layers // 2}", Cost.SPEED, options={"n_gpu_layers": layers // 2})
        return [*super().fallbacks(config, facts), half]

    def _load(self) -> None:
        layers = self.options.n_gpu_layers
        Offloader.tried.append(layers)
        if layers is None or (isinstance(layers, int) and layers > 1):
            raise OutOfMemory("weights do not fit on the GPU")


def test_fewer_gpu_layers_where_there_is_a_gpu(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from unillm import GPU, Hardware
    from unillm._choose import _auto

    gpu = Hardware(
        "Linux", "x86_64", "cpu", 8, (), 64 * 10**9, gpus=(GPU(0, "nvidia", "RTX 4090", 24 * 10**9),)
    )
    monkeypatch.setattr(_auto, "_machine", lambda: gpu)
    Offloader.tried.clear()
    e = auto_engine(tiny_gguf, backend="offloader", context_length=1024, registry=registry(Offloader))
    assert Offloader.tried == [None, 1]  # the tiny model has 2 layers: half of them
    assert e.selection is not None and "retrying with n_gpu_layers=1" in e.selection.steps[0]


def test_no_gpu_no_layer_step(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from unillm import Hardware
    from unillm._choose import _auto

    monkeypatch.setattr(_auto, "_machine", lambda: Hardware("Linux", "x86_64", "cpu", 8, (), 64 * 10**9))
    Offloader.tried.clear()
    with pytest.raises(OutOfMemory):
        auto_engine(tiny_gguf, backend="offloader", context_length=1024, registry=registry(Offloader))
    assert Offloader.tried == [None]
