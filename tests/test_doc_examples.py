"""Every ```python and ```bash block in README.md and docs/ runs as a user would run it.

Each block runs in a subprocess (a hang fails it) inside a fresh directory laid out like the
user's: the model files, hardware profiles and config files the examples name are there under the
names the page uses (the models are links to the session's tiny model), so the code runs exactly as
shown. Python blocks run with this interpreter; in bash blocks each ``unillm ...`` line runs as
``python -m unillm ...``. A block that cannot run here (an install, a script that installs, an
illustration) is listed in ``NOT_RUN`` with the reason; one that runs but needs something more (an
environment variable, input, a documented failure exit code) is listed in ``RUNS`` with why. A
block that is neither runnable nor listed fails, and so does a table entry that names no block.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from unillm.engines.exllamav2 import ASSUME_GPU_ENV
from unillm.testing import SIZES, HubServer, TinyModel, build_tiny_model, tiny_gguf

from .conftest import VLLM_OPTIONS

ROOT = Path(__file__).resolve().parent.parent
PROFILES = Path(__file__).resolve().parent / "profiles"
FAKE_EXLLAMAV2 = Path(__file__).resolve().parent / "fake_exllamav2"
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]
RUN_LANGUAGES = ("python", "bash")
PYTHON = sys.executable  # the one running the tests: .venv's, as scripts/test.sh runs them
TIMEOUT_S = 240  # per block: the machine is shared, and a vLLM start alone takes up to a minute

# The user's own files, by the name the docs give them -> what stands in for each here. The models
# are the session's tiny model: a GGUF for a .gguf, its HF directory for a model directory, the
# directory holding both formats where the example lets the selector choose between them.
USER_FILES: dict[str, str] = {
    "model.gguf": "tiny:gguf",
    "models/llama-3.2-1b-q4_k_m.gguf": "tiny:gguf",
    "Qwen3-30B-A3B-Q4_K_M.gguf": "tiny:gguf",
    "Llama-3.1-8B-Q4_K_M.gguf": "tiny:gguf",
    "models/llama-3.2-1b": "tiny:root",
    "models/llama-awq": "tiny:hf",
    "models/Llama-3.2-1B-Instruct-4bit": "tiny:hf",
    "models/Llama-3.1-8B-Instruct": "tiny:hf",
    "models/Llama-3.1-8B-Instruct-exl2-4.0bpw": "tiny:hf",
    "h100-8x.json": "profile:h100-8x-nvlink.json",
    "h100x8.json": "profile:h100-8x-nvlink.json",
    "4090.json": "profile:rtx4090-1x.json",
}

# Files the docs show the content of -> the (page, text) of the block that is that content.
DOC_FILES: dict[str, tuple[str, str]] = {
    "unillm.toml": ("docs/configuration.md", 'kv_cache_type = "q8_0"'),
    "unillm_myengine/__init__.py": ("docs/plugins.md", "# unillm_myengine/__init__.py"),
    "unillm_myengine/engine.py": ("docs/plugins.md", "class MyEngine(Engine[MyOptions])"),
}

# Blocks that are not run, keyed by (page, text found in exactly one of its runnable blocks).
NOT_RUN: dict[tuple[str, str], str] = {
    ("docs/plugins.md", "# tests/test_conformance.py"): "a test module: run under pytest with its "
    "conftest by test_the_plugin_conformance_example_runs_with_its_fixtures",
    ("docs/plugins.md", "# tests/conftest.py"): "the conformance example's fixtures: the same test",
    ("docs/server.md", "embedder.embeddings.create("): "talks to a server serving an embedding model; "
    "tests/test_server_embeddings.py makes the same call with the same client",
    ("docs/server.md", "curl http://127.0.0.1:8000/v2/rerank"): "a reranker on vLLM served, then a "
    "request to it; tests/test_vllm_embed.py serves the tiny reranker and sends the same request",
    ("docs/embeddings.md", "models/bge-small-en-v1.5-f16.gguf"): "a model of the reader's (no hub "
    "here); tests/test_embeddings.py makes the same calls on the tiny embedding models",
    ("docs/embeddings.md", "engine.embed(texts, *, pooling=None"): "the method's signature, not code",
    ("docs/embeddings.md", "check_parity([llama_embed, mlx_embed]"): "a fragment over engines the page "
    "names only; tests/test_embeddings.py runs check_parity so",
    ("docs/embeddings.md", "models/bge-reranker-base"): "a reranker of the reader's on vLLM; "
    "tests/test_vllm_embed.py reranks with the tiny one",
    ("README.md", "scripts/demo.sh"): "demo.sh runs scripts/bootstrap.sh (an install) first; "
    "test.sh runs the whole suite, this test among it",
    ("docs/index.md", "scripts/demo.sh"): "the same block as README.md's",
    ("docs/index.md", 'pip install -e ".[llamacpp]"'): "installation commands",
    ("docs/backends/llamacpp.md", "# pins llama-cpp-python"): "installation commands",
    ("docs/backends/llamacpp.md", "CMAKE_ARGS="): "builds llama-cpp-python from source (7 min), "
    "two of them for CUDA and ROCm",
    ("docs/backends/mlx.md", 'pip install "unillm[mlx]"'): "an installation command",
    ("docs/backends/exllamav2.md", 'pip install "unillm[exllamav2]"'): "an installation command",
    ("docs/backends/vllm.md", 'pip install "unillm[vllm]"'): "installation commands",
    ("docs/configuration.md", "python app.py"): "app.py stands for the user's own program",
    ("README.md", "UNILLM_BACKEND=mlx python app.py"): "app.py stands for the user's own program; "
    "examples/swap_engine.py makes the same swap and tests/test_examples.py runs it",
    ("docs/models.md", "Qwen2.5-7B-Instruct-AWQ"): "names real AWQ, MLX and 7B repos the loopback hub "
    "does not hold (their weights are gigabytes); tests/test_hub.py makes the same call on the tiny "
    "model's f32, GGUF and MLX 4-bit copies",
    ("docs/selection.md", "concurrency=16"): "starts vLLM, a second start here (2 min on 2 cores) after "
    "vllm.md's; tests/test_parity.py makes this very call on the tiny model",
    ("docs/backends/vllm-scale-out.md", "export NCCL_SOCKET_IFNAME"): "the network between machines",
    ("docs/backends/vllm-scale-out.md", "ray start --head"): "starts a Ray cluster's head machine",
    ("docs/backends/vllm-scale-out.md", "ray start --address"): "joins a worker machine to the Ray cluster",
    ("docs/backends/vllm-scale-out.md", "ray status"): "needs the Ray cluster of the steps before",
    ("docs/backends/vllm-scale-out.md", 'distributed_executor": "ray"'): "16 GPUs on two machines "
    "joined by Ray",
    ("docs/backends/vllm-scale-out.md", "--headless"): "a worker machine's ranks, waiting for node 0 "
    "until stopped; tests/test_vllm_multinode.py runs this command as node 1 on loopback",
    ("docs/backends/vllm-scale-out.md", "--backend vllm --host 0.0.0.0"): "node 0 of two machines, "
    "serving until stopped; tests/test_vllm_multinode.py loads node 0 on loopback with these options",
    ("docs/backends/vllm-scale-out.md", '"master_addr": "10.0.0.1"'): "node 0 of two machines; "
    "tests/test_vllm_multinode.py makes this call on loopback",
    ("docs/server.md", "unillm serve model.gguf --alias chat"): "a server runs until it is stopped; "
    "tests/test_server.py starts this very command",
    ("docs/server.md", 'base_url="http://127.0.0.1:8000/v1"'): "talks to the server of the block "
    "before; the page's next block makes the same calls in-process",
    ("README.md", "unillm serve model.gguf"): "a server runs until it is stopped; tests/test_server.py "
    "starts this very command",
    ("README.md", 'base_url="http://127.0.0.1:8000/v1"'): "talks to the server of the block before; "
    "docs/server.md's in-process block makes the same calls",
    ("docs/benchmarks.md", "--backends llama.cpp,mlx --concurrency 1,4"): "loads two engines and runs 32 "
    "requests each; tests/test_bench_engines.py runs this command on the tiny model with a smaller workload",
    ("docs/benchmarks.md", "unillm bench --url"): "needs a running server; tests/test_bench_engines.py "
    "benchmarks unillm serve on loopback",
    ("docs/benchmarks.md", "--servers llama-cpp-python,xllamacpp"): "a 1B model and xllamacpp's own "
    "environment; tests/test_bench_engines.py runs --servers llama-cpp-python on the tiny model",
    ("docs/benchmarks.md", "unillm bench compare"): "needs the result files of earlier runs; "
    "tests/test_bench.py runs compare on written results",
    ("docs/benchmarks.md", "--warmup 2 --context 2048"): "the page's measured run (minutes on the shared "
    "machine); its result files are in benchmarks/results/",
    ("docs/benchmarks.md", "bench-workload-shared-prefix.toml --out"): "the page's second measured run; its "
    "result files are in benchmarks/results/",
    ("docs/plugins/openai-http.md", "pip install -e plugins/unillm-openai-http"): "an installation "
    "command; tests/test_plugin_openai_http.py runs the plugin from its directory",
    ("docs/plugins/onnxruntime-genai.md", "pip install -e plugins/unillm-onnxruntime-genai"): "an "
    "installation command; tests/test_plugin_onnxruntime_genai.py runs the plugin from its directory",
    ("docs/plugins/onnxruntime-genai.md", "python -m onnxruntime_genai.models.builder"): "the converter's "
    "environment; scripts/converters.sh builds it and unillm.testing.convert_tiny runs this command",
    ("docs/plugins/openvino-genai.md", "pip install -e plugins/unillm-openvino-genai"): "an installation "
    "command; tests/test_plugin_openvino_genai.py runs the plugin from its directory",
    ("docs/plugins/openvino-genai.md", "optimum-cli export openvino"): "the converter's environment; "
    "scripts/converters.sh builds it and unillm.testing.convert_tiny runs this export",
    ("docs/plugins/exllamav3.md", "pip install exllamav3"): "CUDA only (its import compiles a CUDA "
    "extension); tests/test_plugin_exllamav3.py runs the plugin against its fake",
    ("docs/benchmarks.md", "--backends llama.cpp,mlx,vllm"): "the page's three-engine run (vLLM's start "
    "and 48 requests an engine); its result files are in benchmarks/results/",
    ("docs/benchmarks.md", "guidellm run --backend"): "guidellm, in the environment scripts/loadgen.sh "
    "builds, against a running server; benchmarks/crosscheck_guidellm.py runs this command",
    ("docs/benchmarks.md", "python benchmarks/crosscheck_guidellm.py"): "starts a server and guidellm for "
    "several minutes; tests/test_bench_crosscheck.py runs a small one",
    ("docs/benchmarks.md", "python benchmarks/structured_output.py"): "three engines, vLLM twice, for "
    "several minutes; tests/test_bench_structured.py runs the script with one round on llama.cpp",
    ("docs/scaling-out.md", 'pip install "smg==1.13.0"'): "an installation command; scripts/smg.sh "
    "builds the same environment",
    ("docs/scaling-out.md", "smg launch --host"): "two servers and a router, which run until stopped; "
    "tests/test_smg.py starts these commands (on free ports) and sends requests through the router",
    ("docs/scaling-out.md", 'base_url="http://127.0.0.1:8000/v1"'): "talks to the router of the block "
    "before; tests/test_smg.py makes the same calls through it",
    ("docs/scaling-out.md", "pip install 'unillm[ray]'"): "an installation command; the test environment "
    "installs the extra (pyproject's dev extra)",
    ("docs/scaling-out.md", "export RAY_SERVE_ENABLE_HA_PROXY=1"): "serves until stopped; "
    "tests/test_ray_direct.py runs unillm serve --ray with these variables on a one-node cluster and "
    "sends requests through HAProxy",
    ("docs/scaling-out.md", "--ray local --replicas 2"): "serves until stopped; tests/test_ray_serve.py "
    "runs unillm serve --ray against a two-node cluster, sends requests and stops it with SIGINT",
    ("docs/scaling-out.md", "serve run unillm.server.ray:build_app"): "Ray's own command, serving until "
    "stopped; tests/test_ray_parts.py checks build_app's string arguments as serve run passes them",
}


@dataclass(frozen=True)
class Run:
    """How to run a block, or in a bash block the line holding the key's text, where the default
    (no extra environment, no input, exit status 0) does not fit."""

    why: str
    env: Mapping[str, str] = field(default_factory=dict)
    stdin: str = ""
    exit_code: int = 0
    replace: tuple[tuple[str, str], ...] = ()  # (as shown, as run): only what cannot run here as shown
    vllm: bool = False  # starts vLLM: marked so that `-m 'not vllm'` leaves it out


RUNS: dict[tuple[str, str], Run] = {
    ("docs/configuration.md", 'UNILLM_BACKEND=llama.cpp unillm generate "Hello"'): Run(
        "its comment says UNILLM_MODEL is set", env={"UNILLM_MODEL": "model.gguf"}
    ),
    ("docs/configuration.md", "unillm chat model.gguf"): Run(
        "the REPL: one message, then end of input", stdin="Hello\n"
    ),
    ("docs/testing.md", "unillm testing build-tiny /tmp/tiny"): Run(
        "/tmp is shared with everything else on the machine", replace=(("/tmp/tiny", "tiny"),)
    ),
    ("docs/backends/exllamav2.md", 'backend="exllamav2"'): Run(
        "exllamav2 needs a CUDA or ROCm GPU: the API's fake (tests/fake_exllamav2), a GPU assumed",
        env={"PYTHONPATH": str(FAKE_EXLLAMAV2), ASSUME_GPU_ENV: "1"},
    ),
    ("docs/backends/vllm.md", 'backend="vllm"'): Run(
        "the vLLM page's example, eager with a small KV cache set in the environment (UNILLM_OPTIONS):"
        " a start without compiling; tests/test_parity.py runs vLLM's defaults",
        env={"UNILLM_OPTIONS": json.dumps(VLLM_OPTIONS)},
        vllm=True,
    ),
}


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: str
    line: int  # of the opening fence, 1-based
    language: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def page_blocks(page: str) -> list[Block]:
    """The fenced blocks of ``page``, indented ones (inside a list item) dedented."""
    out: list[Block] = []
    opened: tuple[int, str, str] | None = None  # line, indent, language
    body: list[str] = []
    for number, line in enumerate((ROOT / page).read_text(encoding="utf-8").splitlines(), 1):
        fence = re.fullmatch(r"(\s*)```\s*([\w+-]*)\s*", line)
        if opened is None and fence:
            opened, body = (number, fence[1], fence[2].lower()), []
        elif opened is not None and fence and not fence[2]:
            out.append(Block(page, opened[0], opened[2], "\n".join(body) + "\n"))
            opened = None
        elif opened is not None:
            body.append(line.removeprefix(opened[1]))
    assert opened is None, f"{page}:{opened and opened[0]}: a code block is never closed"
    return out


ALL_BLOCKS = [b for page in PAGES for b in page_blocks(page)]
RUNNABLE = [b for b in ALL_BLOCKS if b.language in RUN_LANGUAGES]


def find(page: str, text: str, blocks: list[Block] = ALL_BLOCKS) -> Block:
    """The one block of ``page`` holding ``text``: a table key must not be stale or ambiguous."""
    found = [b for b in blocks if b.page == page and text in b.code]
    assert len(found) == 1, f"{(page, text)} names {len(found)} blocks of {page}, not one"
    return found[0]


def skip_reason(block: Block) -> str | None:
    return next(
        (why for (page, text), why in NOT_RUN.items() if page == block.page and text in block.code), None
    )


def run_for(block: Block, code: str) -> Run:
    """The ``RUNS`` entry for ``code`` (the block, or one line of a bash block), or the default."""
    runs = [run for (page, text), run in RUNS.items() if page == block.page and text in code]
    assert len(runs) <= 1, f"{block.id}: several RUNS entries match {code!r}"
    return runs[0] if runs else Run("")


def test_every_table_entry_names_one_block() -> None:
    for page, text in [*NOT_RUN, *RUNS]:
        find(page, text, RUNNABLE)
    for page, text in DOC_FILES.values():
        find(page, text)
    shown = "".join(b.code for b in ALL_BLOCKS)
    for name in USER_FILES:  # the table holds only what the docs still name
        assert name in shown, f"no block names {name}: drop it from USER_FILES"
    for page, text in RUNS:  # a bash entry names one line, so its options apply to that line only
        block = find(page, text, RUNNABLE)
        if block.language == "bash":
            assert sum(text in line for line in block.code.splitlines()) == 1, (page, text)


@pytest.fixture(scope="module")
def doc_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyModel, Path]:
    """The user's model, and the UNILLM_CACHE every block shares (where testing.md's ``tiny_model()``
    builds on first use). The model is the small tiny model trained, as Llama 3.x models are, for
    131072 positions, so the examples' ``context_length=8192`` runs as shown."""
    spec = dataclasses.replace(SIZES["small"], max_position_embeddings=131072)
    return build_tiny_model(tmp_path_factory.mktemp("user-model"), spec), tmp_path_factory.mktemp("cache")


#: The repos the docs name -> their files: the user's model in each quantization, under the names
#: the real repo gives its files, served by a Hugging Face Hub on loopback (no network here).
HUB_REPOS: dict[str, dict[str, str]] = {
    "Qwen/Qwen2.5-0.5B-Instruct-GGUF": {
        "qwen2.5-0.5b-instruct-fp16.gguf": "f16",
        "qwen2.5-0.5b-instruct-q8_0.gguf": "Q8_0",
        "qwen2.5-0.5b-instruct-q4_0.gguf": "Q4_0",
    },
}


@pytest.fixture(scope="module")
def doc_hub(
    doc_model: tuple[TinyModel, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    """The environment that points the blocks at the loopback hub and one HF cache they share."""
    model, _ = doc_model
    hub = HubServer()
    for repo, files in HUB_REPOS.items():
        hub.add(repo, {name: tiny_gguf(quant, model=model)[0] for name, quant in files.items()})
    with hub:
        yield {
            **hub.environ(tmp_path_factory.mktemp("hf-cache")),
            "HF_HOME": str(tmp_path_factory.mktemp("hf")),
        }


def lay_out(directory: Path, model: TinyModel) -> None:
    """Put the user's files of ``USER_FILES`` and ``DOC_FILES`` into ``directory``."""
    stand_ins = {"tiny:gguf": model.gguf_path, "tiny:hf": model.hf_dir, "tiny:root": model.root}
    for name, what in USER_FILES.items():
        target = stand_ins.get(what) or PROFILES / what.removeprefix("profile:")
        assert target.exists(), f"{name} stands for {target}, which does not exist"
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).symlink_to(target)
    for name, (page, text) in DOC_FILES.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(find(page, text).code, encoding="utf-8")


def environment(cache: Path, extra: Mapping[str, str]) -> dict[str, str]:
    # The user's environment holds no UNILLM_ override and no PYTHONPATH unless the example says so.
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNILLM_") and k != "PYTHONPATH"}
    return {**env, "UNILLM_CACHE": str(cache), **extra}


def execute(argv: list[str], cwd: Path, env: dict[str, str], run: Run, what: str) -> None:
    try:
        proc = subprocess.run(
            argv,
            cwd=cwd,
            env=env,
            input=run.stdin,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        # what it wrote before the kill comes back as bytes, text=True or not
        out, err = (
            b.decode(errors="replace") if isinstance(b, bytes) else b for b in (exc.stdout, exc.stderr)
        )
        pytest.fail(f"{what} did not finish in {TIMEOUT_S} s\n--- stdout\n{out}\n--- stderr\n{err}")
    assert proc.returncode == run.exit_code, (
        f"{what} exited {proc.returncode}, not {run.exit_code}"
        f"\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )


def applied(code: str, run: Run) -> str:
    for shown, instead in run.replace:
        assert shown in code, f"{shown!r} is no longer in the example"
        code = code.replace(shown, instead)
    return code


def bash_commands(code: str) -> list[str]:
    """The commands of a bash block: comments and blank lines dropped, continuations joined."""
    joined = re.sub(r"\\\n", " ", code)
    return [line for line in joined.splitlines() if shlex.split(line, comments=True)]


def params() -> list[object]:
    out: list[object] = []
    for block in RUNNABLE:
        vllm = any(r.vllm for (page, text), r in RUNS.items() if page == block.page and text in block.code)
        marks = [pytest.mark.vllm, pytest.mark.slow] if vllm else []
        out.append(pytest.param(block, id=block.id, marks=marks))
    return out


@pytest.mark.parametrize("block", params())
def test_doc_example_runs(
    block: Block, doc_model: tuple[TinyModel, Path], doc_hub: dict[str, str], tmp_path: Path
) -> None:
    reason = skip_reason(block)
    if reason is not None:
        pytest.skip(f"not run: {reason}")
    model, cache = doc_model
    lay_out(tmp_path, model)
    if block.language == "python":
        run = run_for(block, block.code)
        script = tmp_path / "doc_example.py"
        script.write_text(applied(block.code, run), encoding="utf-8")
        execute([PYTHON, script.name], tmp_path, environment(cache, {**doc_hub, **run.env}), run, block.id)
        return
    for command in bash_commands(block.code):
        run = run_for(block, command)
        words = shlex.split(applied(command, run), comments=True)
        assignments: dict[str, str] = {}  # VAR=value before the command, as the shell takes it
        while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
            name, _, value = words.pop(0).partition("=")
            assignments[name] = value
        assert words[0] == "unillm", (
            f"{block.id}: {command!r} is not a unillm command: run it here or list it in NOT_RUN with why"
        )
        env = environment(cache, {**doc_hub, **run.env, **assignments})
        execute([PYTHON, "-m", "unillm", *words[1:]], tmp_path, env, run, f"{block.id}: {command!r}")


def test_the_plugin_conformance_example_runs_with_its_fixtures(
    doc_model: tuple[TinyModel, Path], tmp_path: Path
) -> None:
    """docs/plugins.md's conformance module and conftest, as shown, under pytest: the kit against a
    built-in standing in for the plugin (MLX, on the tiny model's HF directory) with llama.cpp as
    the parity reference. Only ``BACKEND`` changes: the page's ``MyEngine`` is a skeleton."""
    pytest.importorskip("mlx_lm")
    pytest.importorskip("llama_cpp")
    _, cache = doc_model
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_conformance.py").write_text(find("docs/plugins.md", "# tests/test_conformance.py").code)
    conftest = find("docs/plugins.md", "# tests/conftest.py").code
    run = Run("a built-in stands for the plugin", replace=(('BACKEND = "myengine"', 'BACKEND = "mlx"'),))
    (tests / "conftest.py").write_text(applied(conftest, run))
    argv = [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]
    proc = subprocess.run(
        argv, cwd=tmp_path, env=environment(cache, {}), capture_output=True, text=True,
        timeout=TIMEOUT_S, check=False,
    )  # fmt: skip
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    from unillm.testing import Conformance

    rules = sum(name.startswith("test_") for name in dir(Conformance))
    ran = re.search(r"(\d+) passed(?:, (\d+) skipped)?", proc.stdout)
    assert ran and int(ran[1]) + int(ran[2] or 0) == rules, tail  # every rule of the kit ran
    assert int(ran[1]) >= rules - 2, tail  # MLX passes all but what it cannot apply
