"""What each kind of OpenAI-compatible server honours, and how a model or URL is named to it.

The kind comes from ``/v1/models`` (``owned_by``: ``unillm``, ``vllm``, ``sglang``, ``llamacpp``
for llama.cpp's ``llama-server``, ``me`` for llama-cpp-python's server); a server that says
nothing of itself (``mlx_lm.server``, a hosted API) is ``openai``: only the parameters OpenAI's
own API defines are sent to it, unless the ``server_kind`` option names it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "OPENAI",
    "OWNED_BY",
    "RENAMED",
    "SAMPLING",
    "TOKENIZER",
    "TOKEN_IDS",
    "TOKEN_PROMPTS",
    "auth",
    "match",
    "root",
]


OPENAI = frozenset(
    {"max_tokens", "stop", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty"}
)
_VLLM_LIKE = OPENAI | {"top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "min_tokens"}
# servers that enforce OpenAI's response_format (json_schema, json_object) themselves
_FORMATS = frozenset({"response_format"})
SAMPLING: dict[str, frozenset[str]] = {
    "unillm": _VLLM_LIKE | {"logit_bias"} | _FORMATS,
    "vllm": _VLLM_LIKE | {"logit_bias"} | _FORMATS,
    "sglang": _VLLM_LIKE | _FORMATS,
    "llama.cpp": OPENAI | {"top_k", "min_p", "repetition_penalty"},
    "llama-cpp-python": OPENAI | {"top_k", "min_p", "repetition_penalty", "logit_bias"},
    "mlx": OPENAI | {"top_k", "min_p", "repetition_penalty", "logit_bias"},
    "openai": OPENAI,
}
TOKEN_PROMPTS = frozenset({"unillm", "vllm", "sglang", "llama.cpp", "llama-cpp-python"})
# servers that stream each chunk's token ids when a request asks with ``return_token_ids``
# (vLLM: one event per engine step, an id even where the text is held back or empty)
TOKEN_IDS = frozenset({"vllm"})
OWNED_BY = {
    "unillm": "unillm",
    "vllm": "vllm",
    "sglang": "sglang",
    "llamacpp": "llama.cpp",
    "me": "llama-cpp-python",
}
# the name each kind gives repetition_penalty on the wire
RENAMED = {
    "llama.cpp": {"repetition_penalty": "repeat_penalty"},
    "llama-cpp-python": {"repetition_penalty": "repeat_penalty"},
}
# (tokenize route, its body's text field, detokenize route, its answer's text field)
TOKENIZER = {
    "unillm": ("/tokenize", "prompt", "/detokenize", "prompt"),
    "vllm": ("/tokenize", "prompt", "/detokenize", "prompt"),
    "sglang": ("/tokenize", "prompt", "/detokenize", "text"),
    "llama.cpp": ("/tokenize", "content", "/detokenize", "content"),
    "llama-cpp-python": ("/extras/tokenize", "input", "/extras/detokenize", "text"),
}


def root(base: str) -> str:
    """``http://host:port`` from a base URL given with or without ``/v1``."""
    root = base.strip().rstrip("/")
    return root[:-3] if root.endswith("/v1") else root


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin")


def _stem(name: str) -> str:
    """``name`` less a weights-file suffix; other dots stay (``Qwen2.5-7B`` is not ``Qwen2``)."""
    for suffix in _WEIGHT_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def match(model: str, served: Sequence[str]) -> str | None:
    """The served id that names ``model``: the same string, or the same file name, or the same
    name less a weights suffix (``.gguf``), on either side (a server may list the path it loaded)."""
    if model in served:
        return model
    mine = Path(model.rstrip("/")).name
    for s in served:
        theirs = Path(s.rstrip("/")).name
        if theirs == mine or _stem(theirs) == _stem(mine):
            return s
    return None
