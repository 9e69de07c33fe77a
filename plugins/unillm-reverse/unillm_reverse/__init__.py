"""unillm-reverse: the tutorial plugin. It registers one backend, ``reverse``.

Installed, the entry point in pyproject.toml points unillm at this module; unillm calls the hook
below once, when it builds its registry. The engine class lives in its own module and is imported
inside the hook, which is where a real plugin keeps its engine library out of ``import unillm``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unillm import hookimpl

__all__ = ["unillm_register_backends"]


@hookimpl
def unillm_register_backends(register: Callable[[Any], None]) -> None:
    from unillm_reverse.engine import ReverseEngine

    register(ReverseEngine)
