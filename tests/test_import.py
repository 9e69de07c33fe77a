"""`import unillm` stays light: no engine, no numpy, no pydantic until a name needs it."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "mlx", "llama_cpp", "vllm", "exllamav2", "transformers", "numpy")


def loaded_after(code: str) -> list[str]:
    watched = [*HEAVY, "pydantic", "typer", "rich"]
    probe = f"""
import sys, json
{code}
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {watched!r})))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_import_unillm_loads_nothing_heavy() -> None:
    assert loaded_after("import unillm") == []


def test_public_names_load_no_engine() -> None:
    code = "import unillm\nunillm.SamplingParams; unillm.Engine; unillm.auto_engine; unillm.backends()"
    mods = {m.split(".")[0] for m in loaded_after(code)}
    assert not mods & set(HEAVY), mods


def test_every_public_name_resolves() -> None:
    import unillm

    for name in unillm.__all__:
        assert getattr(unillm, name) is not None
    assert set(unillm.__all__) <= set(dir(unillm))
