"""The chat template a model declares, read by one rule for every engine.

A Hugging Face directory: ``tokenizer_config.json``'s ``chat_template`` when it is a string; when
it is a list of named templates, the one named ``default`` (as transformers chooses; a list
without one names no template to use by default); else ``chat_template.jinja`` beside it (where
transformers writes it since 4.43). A GGUF file: its ``tokenizer.chat_template`` metadata. The
engines, the end-of-sequence set (``_eos``) and ``Engine.chat`` all read it through here, so a
model's template is the same whichever engine loads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unillm._inspect._json import _MAX_CONFIG_BYTES, advisory_json

__all__ = ["gguf_chat_template", "hf_chat_template", "named_template"]


def named_template(value: Any) -> str | None:
    """``chat_template`` as tokenizer_config.json holds it (a string, or a list of
    ``{"name", "template"}``) as the one template to use by default, or None."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value else None


def hf_chat_template(directory: str | Path, tokenizer_config: Mapping[str, Any] | None = None) -> str | None:
    """The chat template of the HF model in ``directory`` (``tokenizer_config``: that file's
    contents when the caller has read it already), or None when it declares none."""
    d = Path(directory)
    if tokenizer_config is None:
        tokenizer_config = advisory_json(d / "tokenizer_config.json")
    template = named_template(tokenizer_config.get("chat_template"))
    if template is not None:
        return template
    jinja = d / "chat_template.jinja"
    try:
        if jinja.is_file() and jinja.stat().st_size <= _MAX_CONFIG_BYTES:
            return jinja.read_text(encoding="utf-8") or None
    except (OSError, UnicodeDecodeError):
        return None
    return None


def gguf_chat_template(metadata: Mapping[str, Any]) -> str | None:
    """The chat template in a GGUF header's metadata, or None."""
    template = metadata.get("tokenizer.chat_template")
    return template if isinstance(template, str) and template else None
