"""``unillm backends`` and ``unillm doctor``: what runs on this machine."""

from __future__ import annotations

import platform
import sys
from typing import TYPE_CHECKING

from unillm.cli._common import JsonOpt, _asdict, _console, _dump, _esc

if TYPE_CHECKING:
    from unillm._choose._registry import Registry

__all__ = ["backends_cmd", "doctor"]


def backends_cmd(as_json: JsonOpt = False) -> None:
    """List every registered backend (built-in and plugin) and whether it runs here."""
    from rich.table import Table

    from unillm._choose._registry import default_registry

    reg = default_registry()
    if as_json:
        rows = {}
        for name, info in reg.backends().items():
            a = info.availability()
            rows[name] = {
                "source": info.source,
                "formats": sorted(info.cls.formats),
                **_asdict(a),
                "capabilities": _asdict(info.capabilities()),
            }
        _dump({"backends": rows, "plugin_failures": reg.failures})
        return
    table = Table("backend", "source", "formats", "available", "detail")
    for info in reg.backends().values():
        a = info.availability()
        detail = a.version or "" if a.available else f"{a.reason}; {a.install_hint or ''}"
        table.add_row(
            _esc(info.name),
            _esc(info.source),
            _esc(", ".join(sorted(info.cls.formats))),
            "[green]yes[/]" if a.available else "[red]no[/]",
            _esc(detail),
        )
    console = _console()
    console.print(table)
    for f in reg.failures:
        console.print(f"[yellow]plugin {_esc(repr(f.plugin))} skipped:[/] {_esc(f.reason)}")
    _capabilities_table(reg)


# what every backend honours (the base class applies them): not worth a column
_EVERYWHERE = frozenset({"max_tokens", "stop", "temperature"})


def _capabilities_table(reg: Registry) -> None:
    """What each backend does with its default options (``capabilities_for``, what a load with
    no options gets): sampling parameters beyond the common ones, structured output, logprobs,
    batching (MLX batches by default; llama.cpp once ``parallel`` or the concurrency is above 1),
    LoRA, speculative decoding."""
    from rich.table import Table

    def mark(ok: bool) -> str:
        return "[green]yes[/]" if ok else "-"

    table = Table(
        "backend",
        "structured",
        "logprobs",
        "batching",
        "lora",
        "speculative",
        "token prompts",
        "more sampling",
    )
    for info in reg.backends().values():
        c = info.capabilities()
        more = ", ".join(sorted(c.sampling - _EVERYWHERE - {"response_format", "logprobs"}))
        table.add_row(
            _esc(info.name),
            mark("response_format" in c.sampling),
            mark("logprobs" in c.sampling),
            mark(c.batching),
            mark(c.lora),
            mark(c.speculative),
            mark(c.token_prompts),
            _esc(more or "-"),
        )
    _console().print(table)


def doctor(as_json: JsonOpt = False) -> None:
    """Check this machine: Python, hardware, installed engines, plugins and their failures.

    The --json output is also a hardware profile: `unillm select MODEL --hardware FILE` judges
    the machine it describes, its installed backends included.
    """
    from unillm._choose._doctor import with_engine_builds
    from unillm._choose._registry import default_registry
    from unillm._hardware import detect_hardware

    reg = default_registry()
    hw = with_engine_builds(detect_hardware(), reg)  # the engine builds, from the backends
    if as_json:
        _dump(
            {
                "python": platform.python_version(),
                "hardware": hw,
                "backends": {n: i.availability() for n, i in reg.backends().items()},
                "plugins": reg.plugins(),
                "plugin_failures": reg.failures,
            }
        )
        return
    console = _console()
    console.print(f"python   {platform.python_version()} ({sys.executable})")
    console.print(f"platform {platform.platform()}")
    for line in hw.summary_lines():
        console.print(_esc(line), highlight=False)
    backends_cmd(as_json=False)
    _plugins_table(reg)


def _plugins_table(reg: Registry) -> None:
    """The installed plugins: distribution and version, what each reaches, and what failed."""
    from rich.table import Table

    plugins = reg.plugins()
    console = _console()
    if not plugins:
        console.print("plugins  none installed (see docs/plugins.md)")
        return
    table = Table("plugin", "distribution", "version", "reaches", "status")
    for p in plugins:
        reaches = ", ".join(p.backends) or "-"
        if p.guide_entries:
            reaches += f" (+{p.guide_entries} guide entries)"
        status = "[green]ok[/]" if not p.failures else f"[red]failed:[/] {_esc('; '.join(p.failures))}"
        table.add_row(
            _esc(p.name), _esc(p.distribution or "?"), _esc(p.version or "?"), _esc(reaches), status
        )
    console.print(table)
