"""The whole plugin contract of unillm.

A plugin is a module (or package) exposed through the ``unillm`` entry-point group::

    # pyproject.toml of the plugin
    [project.entry-points.unillm]
    myengine = "unillm_myengine"

    # unillm_myengine/__init__.py
    from unillm import hookimpl

    @hookimpl
    def unillm_register_backends(register):
        from unillm_myengine.engine import MyEngine   # keep the engine itself lazy
        register(MyEngine)

Hooks take a callback rather than returning values, so one plugin can register any number of
things and a failure in one plugin never hides another's; ``unillm_inspect_model``, which answers
a question about one path, returns its answer. A plugin that fails to import or raises
inside a hook is reported (a ``UnillmWarning`` and ``unillm doctor``) and skipped.

What a backend knows about itself (its hard rules, its fallback steps on out-of-memory, its install
hint, its build probe) it says through class methods of ``unillm.Engine``, the same for a plugin
as for a built-in; the kit for writing one is ``unillm.backend`` (docs/plugins.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from unillm._choose._guide import GuideEntry
    from unillm._contract._engine import Engine
    from unillm._inspect import ModelInfo

__all__ = ["hookimpl", "hookspec"]

hookspec = pluggy.HookspecMarker("unillm")
hookimpl = pluggy.HookimplMarker("unillm")


@hookspec
def unillm_register_backends(register: Callable[[type[Engine]], None]) -> None:
    """Register backend classes.

    :param register: call it once per backend class, ``register(MyEngine)``. The class must
        subclass ``unillm.Engine`` and set ``name`` and ``formats``. Import the class's module
        here, but never the engine library itself: that belongs in ``Engine._load``.

    A name already taken (by a built-in or an earlier plugin) is refused with a warning; the first
    registration wins. Since 0.1.
    """


@hookspec
def unillm_guide_entries(add: Callable[[GuideEntry], None]) -> None:
    """Add lines to the decision guide (``unillm.backend.GuideEntry``).

    :param add: call it once per entry, ``add(GuideEntry("myengine", "why", formats={"gguf"}))``.
        An entry may name any engine, registered or not (the selector then recommends it with the
        entry's ``install`` text when it is a case's first choice).

    How the selector ranks (docs/selection.md): every eligible backend scores its
    ``suitability().score`` (the built-ins return 1.0 for a format they read; ExLlamaV2 0.8 for
    plain FP16/BF16 weights) plus the bonus of the best-ranked guide entry naming it for the case,
    ``2.0 - 0.5 x rank`` (rank 0: +2.0, rank 1: +1.5). Ties go to the backend registered first
    (built-ins). So to outrank a built-in's rank-0 case, add a rank-0 entry for it and return a
    suitability score above the built-in's (1.0). Something that is not a ``GuideEntry`` is
    refused with a warning. Since 0.2.
    """


@hookspec
def unillm_inspect_model(path: str) -> ModelInfo | None:
    """Recognize a model format of the plugin's own (an ONNX Runtime GenAI directory, an OpenVINO
    IR directory, ...), which unillm's built-in inspection does not read or reads as something else.

    :param path: the model path as the user gave it (a file or a directory; may not exist).
    :returns: a ``unillm.ModelInfo`` whose ``format`` is one of the plugin's backend's
        ``formats`` (so the selector knows who reads it), with what the plugin's files say
        (architecture, parameters, context length, ...; None where they do not say); or None for
        a path that is not the plugin's, which then goes to the next plugin and finally to the
        built-in inspection.

    Asked before the built-in inspection, in plugin registration order; the first answer wins.
    Read headers and small config files only: it runs on every ``auto_engine`` and ``unillm
    select``. An exception is reported as the plugin's failure and the path goes on to the next.
    Since 0.3.
    """
