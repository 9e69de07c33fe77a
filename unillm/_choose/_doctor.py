"""The installed engine builds, from the backends: above the hardware layer, which knows no engine.

``detect_hardware()`` leaves ``Hardware.engines`` empty; ``with_engine_builds`` asks every
registered backend (built-in or plugin) for its build with ``Engine.probe_build`` and returns the
hardware with the builds and their findings. ``unillm doctor`` (and the profile ``doctor --json``
writes) report through it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from unillm._choose._registry import Registry
    from unillm._hardware import Hardware

__all__ = ["with_engine_builds"]


def with_engine_builds(hardware: Hardware, registry: Registry | None = None) -> Hardware:
    """``hardware`` with the engine builds each backend of ``registry`` (the default registry
    when None) reports, in registration order (one it already lists by that name is replaced),
    and their findings after its own (each once, in order). A backend whose probe raises, or
    returns something other than an ``EngineBuild``, is a finding, never a crash."""
    from unillm._choose._registry import default_registry
    from unillm._hardware import EngineBuild

    reg = registry if registry is not None else default_registry()
    findings = list(hardware.findings)
    builds: list[EngineBuild] = []
    for name, info in reg.backends().items():
        found: list[str] = []
        try:
            build = info.cls.probe_build(hardware, found)
        except Exception as exc:
            findings.append(f"the {name} backend's installed build could not be checked: {exc!r}")
            continue
        findings.extend(str(f) for f in found)
        if build is None:
            continue
        if isinstance(build, EngineBuild):
            builds.append(build)
        else:
            findings.append(f"the {name} backend's probe_build returned {build!r}, not an EngineBuild")
    return dataclasses.replace(
        hardware,
        engines=tuple({e.name: e for e in (*hardware.engines, *builds)}.values()),  # probed wins
        findings=tuple(dict.fromkeys(findings)),
    )
