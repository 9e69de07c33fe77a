"""What unillm knows when it loads an engine: the model, the machine, the workload and the plan.

``auto_engine`` computes these once, to choose a backend, and hands them to the backend it loads
(``engine.facts``), so no backend re-reads the model's headers or re-probes the machine. An engine
constructed directly gets a ``Facts`` that computes each one on first use, the same way.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unillm._hardware import Hardware
    from unillm._inspect import GGUFHeader, ModelInfo
    from unillm._plan._estimate import Plan, Workload

__all__ = ["Facts", "machine"]

_UNSET: Any = object()


@functools.lru_cache(maxsize=1)
def machine() -> Hardware | None:
    """This machine, probed once per process (a few short subprocesses at most); None when the
    probe fails (detection must never stop a load)."""
    from unillm._hardware import detect_hardware

    try:
        return detect_hardware()
    except Exception:
        return None


class Facts:
    """The model (``ModelInfo`` or None when unillm cannot read it), the machine (``Hardware`` or
    None), the workload and the memory plan (``Plan`` or None), each computed once, on first use,
    unless given. A backend reads these instead of inspecting or probing again.

    ``path`` is the model path the facts are about; ``Facts.for_path(path)`` gives the facts of
    another path (a backend that reads one file of a multi-format directory).
    """

    def __init__(
        self,
        path: str,
        *,
        model: ModelInfo | None = _UNSET,
        hardware: Hardware | None = _UNSET,
        workload: Workload | None = None,
        plan: Plan | None = _UNSET,
    ) -> None:
        self.path = path
        self.workload = workload
        for name, value in (("model", model), ("hardware", hardware), ("plan", plan)):
            if value is not _UNSET:
                self.__dict__[name] = value  # fills the cached_property

    @functools.cached_property
    def model(self) -> ModelInfo | None:
        from unillm._errors import UnillmError
        from unillm._inspect import inspect_model

        # auto_engine hands in the registry's inspection (a plugin's format included); an engine
        # built directly gets unillm's own, which its backend can refine
        try:
            return inspect_model(self.path)
        except UnillmError:
            return None

    @functools.cached_property
    def gguf_header(self) -> GGUFHeader:
        """The whole GGUF header of ``path`` (a .gguf file, or the one in a model directory):
        every key, the token ids and chat template included, which inspection's lazy read of the
        same file skips past the vocabulary. Raises what ``read_gguf_header`` raises."""
        from unillm._inspect import read_gguf_header
        from unillm._inspect._paths import gguf_in

        return read_gguf_header(gguf_in(self.path) or self.path)

    @functools.cached_property
    def hardware(self) -> Hardware | None:
        return machine()

    @functools.cached_property
    def plan(self) -> Plan | None:
        from unillm._plan._estimate import plan

        model, hardware = self.model, self.hardware
        if model is None or hardware is None:
            return None
        try:
            return plan(model, hardware, self.workload)
        except Exception:  # a plan is advice: its failure must not stop a load
            return None

    def for_path(self, path: str) -> Facts:
        """These facts when they are about ``path``, else fresh ones for it (same machine)."""
        if path == self.path or getattr(self.__dict__.get("model"), "path", None) == path:
            return self
        known = self.__dict__.get("hardware", _UNSET)
        return Facts(path, hardware=known, workload=self.workload)

    def __repr__(self) -> str:
        known = [n for n in ("model", "hardware", "plan") if n in self.__dict__]
        return f"<Facts {self.path!r} known={known}>"
