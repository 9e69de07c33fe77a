"""A third-party backend for the tests, written only against unillm's public names.

It reads GGUF like llama.cpp, claims (through the decision guide's hook) the case of several users,
where it outranks llama.cpp by the documented rule, and declares its own fallback steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unillm import hookimpl
from unillm.backend import GuideEntry

REASON = "ggufish batches GGUF requests for several users"


@hookimpl
def unillm_register_backends(register: Callable[[Any], None]) -> None:
    from unillm_ggufish.engine import GgufishEngine  # the class's module only, never an engine library

    register(GgufishEngine)


@hookimpl
def unillm_guide_entries(add: Callable[[GuideEntry], None]) -> None:
    add(GuideEntry("ggufish", REASON, formats=frozenset({"gguf"}), workload="serving"))
