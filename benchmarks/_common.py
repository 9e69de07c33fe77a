"""Shared pieces of the overhead benchmarks: machine description, interleaved timing, paired
ratios and the isolated per-token cost of unillm's base class."""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: the checkout whose unillm the benchmarks measure
ROOT = Path(__file__).resolve().parent.parent


def checkout_unillm() -> tuple[list[str], dict[str, str]]:
    """The command and environment that run this checkout's ``unillm`` CLI: ``python -m unillm``
    with the repository first on ``PYTHONPATH``, whatever checkout an editable install points at
    (a shared environment's ``unillm`` script runs the last checkout installed into it)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return [sys.executable, "-m", "unillm"], {"PYTHONPATH": path}


Contender = Callable[[int], tuple[int, str]]  # tokens wanted -> (tokens produced, text)


def tiny_bench_model(model: Any, *, gguf: bool = False) -> dict[str, Any]:
    """What the numbers were measured with: the tiny bench model (or another tiny Llama, such as
    ``large_model``'s, named by its size), as the GGUF or the HF directory."""
    from unillm.testing._tiny import SIZES, file_digest

    weights = model.gguf_path if gguf else model.hf_dir / "model.safetensors"
    bench = model.spec == SIZES["bench"]
    return {
        "name": "unillm tiny bench (random weights)"
        if bench
        else f"unillm tiny llama, {model.spec.n_params / 1e6:.0f}M parameters (random weights)",
        **({} if bench else {"shape": dataclasses.asdict(model.spec)}),
        "architecture": "llama",
        "params": model.spec.n_params,
        "weights": "f32 GGUF" if gguf else "f32 safetensors",
        "sha256": file_digest(weights)[:16],
    }


def machine(*packages: str) -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": round(ram / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        **{pkg: md.version(pkg) for pkg in ("unillm", *packages)},
    }


def timed(fn: Contender, n: int) -> float:
    """Seconds for ``fn`` to produce ``n`` tokens; exits if it produced another count."""
    t0 = time.perf_counter()
    count, _ = fn(n)
    dt = time.perf_counter() - t0
    if count != n:
        sys.exit(f"{getattr(fn, '__name__', fn)} produced {count} tokens, want {n}")
    return dt


def interleaved(plan: dict[str, tuple[Contender, int]], rounds: int) -> dict[str, list[float]]:
    """Time every contender once per round, rotating who goes first, so drift on a shared
    machine and any position effect hit all contenders alike."""
    samples: dict[str, list[float]] = {k: [] for k in plan}
    names = list(plan)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, n = plan[name]
            samples[name].append(timed(fn, n))
    return samples


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in samples.items()}


def paired(samples: dict[str, list[float]], reference: str) -> dict[str, tuple[float, float, float]]:
    """Per contender: the median over rounds of t(reference) / t(contender), and its quartiles."""
    out = {}
    for name, times in samples.items():
        ratios = sorted(r / t for r, t in zip(samples[reference], times, strict=True))
        out[name] = (statistics.median(ratios), ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4])
    return out


def base_class_cost_us(n: int = 200_000) -> float:
    """unillm's own per-token cost, isolated: a backend that yields precomputed tokens, streamed
    through ``Engine.stream`` vs the same generator consumed bare. Median of 5, in microseconds."""
    from unillm import Engine, Request, SamplingParams

    piece = ("x", (1,), None)

    def tokens(k: int) -> Iterator[tuple[str, tuple[int, ...], None]]:
        for _ in range(k):
            yield piece

    class Null(Engine):  # type: ignore[type-arg]
        name = "null"

        def _load(self) -> None:
            pass

        def _stream(
            self, prepared: object, params: SamplingParams, req: Request
        ) -> Iterator[tuple[str, tuple[int, ...], None]]:
            req.prompt_tokens = 1
            return tokens(params.max_tokens)

    engine = Null(model="null").load()
    params = SamplingParams(max_tokens=n)
    bare, wrapped = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in tokens(n):
            pass
        bare.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in engine.stream("x", params):
            pass
        wrapped.append(time.perf_counter() - t0)
    return (statistics.median(wrapped) - statistics.median(bare)) / n * 1e6


def print_floor(
    title: str, tokens: int, floor: dict[str, float], ratios: dict[str, tuple[float, float, float]]
) -> None:
    print(f"\n{title}")
    print("  speed vs reference = median over rounds of t(reference) / t(contender), with its quartiles")
    for name, sec in floor.items():
        med, lo, hi = ratios[name]
        rate = f"{sec * 1000:9.2f} ms  {tokens / sec:9.0f} tok/s"
        print(f"  {name:34s} {rate}  speed {med:.3f}x (IQR {lo:.3f}-{hi:.3f})")


def free_port() -> int:
    """A loopback port free now (for a server that is told its port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def large_model(root: Path | None = None) -> Any:
    """A ~125M-parameter Llama of random weights (f32 GGUF, about 400 MB; vocabulary 32,000),
    built under ``root`` (``$TMPDIR/unillm-bench-models``) on first use: tokens that cost about ten
    times the bench model's compute."""
    from unillm.testing import build_tiny_model
    from unillm.testing._tiny import TinySpec

    spec = TinySpec(
        hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=2048, vocab_size=32000
    )
    root = root or Path(os.environ.get("TMPDIR", "/tmp")) / "unillm-bench-models"
    return build_tiny_model(root / "tiny-large", spec)
