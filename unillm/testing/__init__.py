"""Test doubles and fixtures for unillm users and plugin authors.

- ``MockEngine``: an engine driven by a plain function, for testing code that uses unillm.
- ``build_tiny_model`` / ``tiny_model``: tiny random-weight Llama models (HF dir + GGUF) built
  here, so real engines can be tested offline.
- ``Conformance``: the conformance kit, the contract as pytest tests (subclass it in a line);
  ``check_engine``: the same checks as one function call.
- ``convert_tiny``: the tiny model through ONNX Runtime GenAI's or OpenVINO's own converter.
- ``HubServer`` / ``tiny_hub``: a Hugging Face Hub on loopback holding the tiny model's repos
  (several GGUF quantizations, a split GGUF, the HF directory), for testing model names offline.
- ``check_parity``: greedy tokens, finish reasons and counts equal across engines on the same
  weights, with near-ties told apart from bugs.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_LAZY = {
    "Conformance": "unillm.testing._kit",
    "HubRepo": "unillm.testing._hub",
    "HubServer": "unillm.testing._hub",
    "MockEngine": "unillm.testing._mock",
    "WordVocab": "unillm.testing._mock",
    "check_closed": "unillm.testing._conformance",
    "convert_tiny": "unillm.testing._convert",
    "check_engine": "unillm.testing._conformance",
    "check_parity": "unillm.testing._parity",
    "ParityReport": "unillm.testing._parity",
    "build_tiny_model": "unillm.testing._tiny",
    "tiny_model": "unillm.testing._tiny",
    "tiny_gguf": "unillm.testing._tiny",
    "tiny_hub": "unillm.testing._hub",
    "tiny_embedding_model": "unillm.testing._tiny_embed",
    "tiny_reranker_model": "unillm.testing._tiny_embed",
    "tiny_lora": "unillm.testing._lora",
    "TinyLora": "unillm.testing._lora",
    "TinyModel": "unillm.testing._tiny",
    "TinySpec": "unillm.testing._tiny",
    "SIZES": "unillm.testing._tiny",
}
__all__ = [
    "Conformance",
    "HubRepo",
    "HubServer",
    "MockEngine",
    "ParityReport",
    "SIZES",
    "TinyLora",
    "TinyModel",
    "TinySpec",
    "build_tiny_model",
    "check_closed",
    "check_engine",
    "check_parity",
    "convert_tiny",
    "tiny_embedding_model",
    "tiny_gguf",
    "tiny_hub",
    "tiny_lora",
    "tiny_model",
    "tiny_reranker_model",
    "WordVocab",
]


if TYPE_CHECKING:
    from unillm.testing._conformance import check_closed, check_engine
    from unillm.testing._convert import convert_tiny
    from unillm.testing._hub import HubRepo, HubServer, tiny_hub
    from unillm.testing._kit import Conformance
    from unillm.testing._lora import TinyLora, tiny_lora
    from unillm.testing._mock import MockEngine, WordVocab
    from unillm.testing._parity import ParityReport, check_parity
    from unillm.testing._tiny import SIZES, TinyModel, TinySpec, build_tiny_model, tiny_gguf, tiny_model
    from unillm.testing._tiny_embed import tiny_embedding_model, tiny_reranker_model


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'unillm.testing' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return [*globals(), *_LAZY]
