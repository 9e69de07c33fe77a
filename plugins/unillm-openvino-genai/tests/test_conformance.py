"""unillm's conformance kit on the OpenVINO GenAI backend (fixtures in conftest.py): the engine
contract rule by rule, closing, and greedy parity with llama.cpp on the same weights."""

from __future__ import annotations

from unillm.testing import Conformance


class TestConformance(Conformance):
    pass
