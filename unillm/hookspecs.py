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

Hooks take a ``register`` callback rather than returning values, so one plugin can register any
number of things and a failure in one plugin never hides another's. A plugin that fails to import
or raises inside a hook is reported (a ``UnillmWarning`` and ``unillm doctor``) and skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from unillm._engine import Engine

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
