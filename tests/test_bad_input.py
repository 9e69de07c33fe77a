"""Hostile and careless input through the public API and the CLI: a typed error or a documented
result, never a crash, a hang or unbounded memory.

Each case runs in a process of its own (forked from one interpreter that has imported the engines)
with an address-space limit and a timeout, so a case that would kill the interpreter (a native
abort, a segfault) or eat the machine fails its test instead of ending the run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from unillm.testing import TinyModel

HAS_LLAMA = importlib.util.find_spec("llama_cpp") is not None
HAS_MLX = importlib.util.find_spec("mlx_lm") is not None
_LIMIT = 8 << 30  # address space per case: far above what a case needs, far below the machine
_TIMEOUT = 180

# One interpreter imports unillm and the engines once and forks a child per case: each case still
# runs in a process of its own (a native abort or segfault ends only that child, and the child exits
# through the interpreter's normal shutdown), without paying a second of imports per case.
_FORKS = rf"""
import json, os, resource, sys, threading
import unillm
from unillm import *
import importlib
importlib.import_module(sys.argv[1])  # the engine the cases use, imported once before any fork
GGUF, HF, ROOT = (os.environ[k] for k in ("T_GGUF", "T_HF", "T_ROOT"))

def L(**kw):
    from unillm.engines.llamacpp import LlamaCppEngine
    return LlamaCppEngine(model=GGUF, context_length=512, **kw).load()

def B(**options):  # the batching engine: four sequences in one context
    return L(options={{"parallel": 4, **options}})

def M(**kw):
    from unillm.engines.mlx import MLXEngine
    return MLXEngine(model=HF, **kw).load()

def variant(**kw):
    from unillm.testing._tiny import write_variant_gguf
    return str(write_variant_gguf(os.path.join(TMP, "variant.gguf"), **kw))

def case(code, tmp, err):
    global TMP, result
    TMP = tmp
    os.environ["T_TMP"], os.environ["UNILLM_CACHE"] = tmp, os.path.join(tmp, "cache")
    fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    os.close(fd)
    resource.setrlimit(resource.RLIMIT_AS, ({_LIMIT}, {_LIMIT}))
    result = None
    try:
        exec(compile(code, "case", "exec"), globals())
        out = {{"outcome": "ok", "result": repr(result)[:300]}}
    except BaseException as exc:
        typed = isinstance(exc, unillm.UnillmError)
        out = {{"outcome": type(exc).__name__, "typed": typed, "message": str(exc)[:600]}}
    print("RESULT " + json.dumps(out), flush=True)

print("READY", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        case(job["code"], job["tmp"], job["err"])
        sys.exit(0)  # the child leaves the loop and ends through the interpreter's shutdown
    _, status = os.waitpid(pid, 0)
    print(f"EXIT {{os.waitstatus_to_exitcode(status)}}", flush=True)
"""


class _Forks:
    """The forking interpreter above, started on first use and again after a case that hung."""

    def __init__(self, env: dict[str, str], engine: str) -> None:
        self.env, self.engine = env, engine
        self.proc: subprocess.Popen[str] | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()

    def _start(self) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", _FORKS, self.engine], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, env=self.env, start_new_session=True,
        )  # fmt: skip
        self.lines = lines = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line.rstrip("\n"))
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        assert self._next() == "READY"
        return proc

    def _next(self) -> str | None:
        try:
            return self.lines.get(timeout=_TIMEOUT)
        except queue.Empty:
            self.stop()
            pytest.fail(f"no answer in {_TIMEOUT} s: the case hangs")

    def run(self, code: str, tmp: Path) -> dict[str, object]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        err = tmp / "stderr.txt"
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"code": code, "tmp": str(tmp), "err": str(err)}) + "\n")
        self.proc.stdin.flush()
        result = None
        while (line := self._next()) is not None and not line.startswith("EXIT "):
            if line.startswith("RESULT "):
                result = json.loads(line.removeprefix("RESULT "))
        stderr = err.read_text(errors="replace")[-3000:] if err.exists() else ""
        assert line is not None, f"the forking interpreter died:\n{stderr}"
        code_ = int(line.removeprefix("EXIT "))
        assert code_ == 0, f"the interpreter died ({code_}):\n{stderr}"
        assert result is not None, stderr
        return result

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


# (id, code, the outcome: an exception class name, a tuple of them, or "ok")
L_CASES = [
    ("detokenize-huge-id", "L().detokenize([10**6])", "ConfigError"),
    ("detokenize-negative-id", "L().detokenize([-5])", "ConfigError"),
    ("detokenize-float-id", "L().detokenize([1.5])", "ConfigError"),
    ("detokenize-string", "L().detokenize('abc')", "ConfigError"),
    ("tokenize-none", "L().tokenize(None)", "ConfigError"),
    ("tokenize-bytes", "L().tokenize(b'abc')", "ConfigError"),
    ("tokenize-lone-surrogate", "L().tokenize('\\ud800')", "ConfigError"),
    ("prompt-none", "L().generate(None)", "ConfigError"),
    ("prompt-int", "L().generate(42)", "ConfigError"),
    ("prompt-list-of-str", "L().generate(['a', 'b'])", "ConfigError"),
    ("prompt-bytes", "L().generate(b'hello')", "ConfigError"),
    ("prompt-float-ids", "L().generate([1.5, 2.0])", "ConfigError"),
    ("prompt-bool-ids", "L().generate([True, 1])", "ConfigError"),
    ("prompt-lone-surrogate", "L().generate('x\\udc80')", "ConfigError"),
    ("prompt-id-out-of-vocab", "L().generate([10**6])", "ConfigError"),
    ("prompt-empty-ids", "L().generate([])", "ConfigError"),
    ("prompt-empty-text", "L().generate('')", "ConfigError"),
    ("prompt-past-context", "L().generate('word ' * 2000)", "ContextLengthExceeded"),
    ("temperature-inf", "L().generate('hi', temperature=float('inf'))", "ConfigError"),
    ("temperature-nan", "L().generate('hi', temperature=float('nan'))", "ConfigError"),
    ("repetition-penalty-inf", "L().generate('hi', repetition_penalty=float('inf'))", "ConfigError"),
    ("max-tokens-bool", "L().generate('hi', max_tokens=True)", "ConfigError"),
    ("max-tokens-zero", "L().generate('hi', max_tokens=0)", "ConfigError"),
    ("max-tokens-negative", "L().generate('hi', max_tokens=-1)", "ConfigError"),
    ("logit-bias-out-of-vocab", "L().generate('hi', logit_bias={10**6: 1.0})", "ConfigError"),
    ("logit-bias-negative-id", "L().generate('hi', logit_bias={-1: 1.0})", "ConfigError"),
    ("logit-bias-nan", "L().generate('hi', logit_bias={1: float('nan')})", "ConfigError"),
    ("stop-id-negative", "L().generate('hi', stop_token_ids=[-1])", "ConfigError"),
    ("stop-id-out-of-vocab", "L().generate('hi', stop_token_ids=[10**6])", "ConfigError"),
    ("stop-empty-string", "L().generate('hi', stop=[''])", "ConfigError"),
    ("top-p-zero", "L().generate('hi', top_p=0)", "ConfigError"),
    ("top-p-above-one", "L().generate('hi', top_p=1.5)", "ConfigError"),
    ("seed-string", "L().generate('hi', seed='abc')", "ConfigError"),
    ("params-int", "L().generate('hi', 42)", "ConfigError"),
    ("unknown-param", "L().generate('hi', foo=1)", "ConfigError"),
    ("chat-none", "L().chat(None)", "ConfigError"),
    ("chat-string", "L().chat('hello')", "ConfigError"),
    ("chat-empty", "L().chat([])", "ConfigError"),
    ("chat-bad-role", "L().chat([{'role': 'wizard', 'content': 'x'}])", "ConfigError"),
    ("chat-no-content", "L().chat([{'role': 'user'}])", "ConfigError"),
    ("chat-int-content", "L().chat([{'role': 'user', 'content': 5}])", "ConfigError"),
    ("chat-surrogate", "L().chat([{'role': 'user', 'content': '\\ud800'}])", "ConfigError"),
    ("closed-kv-stats", "e = L(); e.close(); e.kv_stats()", "EngineClosed"),
    ("closed-tokenize", "e = L(); e.close(); e.tokenize('a')", "EngineClosed"),
    ("closed-detokenize", "e = L(); e.close(); e.detokenize([1])", "EngineClosed"),
    ("closed-chat", "e = L(); e.close(); e.chat([{'role': 'user', 'content': 'x'}])", "EngineClosed"),
    ("closed-reset", "e = L(); e.close(); e.reset()", "EngineClosed"),
    ("closed-generate", "e = L(); e.close(); e.generate('x')", "EngineClosed"),
    (
        "never-loaded-generate",
        "from unillm.engines.llamacpp import LlamaCppEngine as C; C(model=GGUF).generate('x')",
        "EngineClosed",
    ),
    (
        "never-loaded-kv-stats",
        "from unillm.engines.llamacpp import LlamaCppEngine as C; C(model=GGUF).kv_stats()",
        "EngineClosed",
    ),
    (
        "close-while-streaming-same-thread",
        "e = L(); it = e.stream('hi', max_tokens=100, ignore_eos=True); next(it); e.close(); list(it)",
        "EngineClosed",
    ),
    (
        "close-while-streaming-other-thread",
        "e = L(); got = []; streaming = threading.Event()\n"
        "def run():\n"
        "    try:\n"
        "        for piece in e.stream('hi', max_tokens=400, ignore_eos=True):\n"
        "            got.append(piece); streaming.set()\n"
        "    except EngineClosed:\n"
        "        got.append('closed')\n"
        "    finally:\n"
        "        streaming.set()\n"
        "t = threading.Thread(target=run); t.start()\n"
        "streaming.wait(); e.close(); t.join(); result = got[-1]",  # closed mid-stream
        "ok",
    ),
    (
        "context-1e9-direct",  # past the trained context where the model is said to extend it: memory
        "from unillm.engines.llamacpp import LlamaCppEngine as C;"
        " C(model=GGUF, context_length=10**9, options={'allow_longer_context': True}).load()",
        "OutOfMemory",
    ),
    (  # past the trained context: loaded at it, and said in a warning (both asserted in the case)
        "context-1e9-load-engine",
        "import warnings; caught = warnings.catch_warnings(record=True).__enter__();"
        " warnings.simplefilter('always');"
        " e = load_engine({'model': GGUF, 'backend': 'llama.cpp', 'context_length': 10**9});"
        " assert e.context_length == 4096 == e.kv_stats().capacity_tokens;"
        " assert any('1000000000 was asked for, 4096 is used' in str(w.message) for w in caught)",
        "ok",
    ),
    ("context-1e12", "load_engine({'model': GGUF, 'context_length': 10**12})", "ConfigError"),
    (
        "context-past-trained",
        "e = load_engine({'model': GGUF, 'context_length': 8192}); assert e.context_length == 4096",
        "ok",
    ),
    ("path-too-long", "auto_engine('a' * 5000 + '.gguf')", ("ModelNotFound", "ModelFormatError")),
    ("empty-directory", "os.mkdir(TMP + '/empty'); auto_engine(TMP + '/empty')", "ModelFormatError"),
    ("hf-dir-to-llama-cpp", "auto_engine(HF, backend='llama.cpp')", "ModelFormatError"),
    ("fifo-named-gguf", "os.mkfifo(TMP + '/x.gguf'); auto_engine(TMP + '/x.gguf')", "ModelFormatError"),
    ("char-device-as-model", "auto_engine('/dev/zero', backend='llama.cpp')", "ModelFormatError"),
    (
        "truncated-gguf",
        "d = open(GGUF, 'rb').read(); open(TMP + '/t.gguf', 'wb').write(d[: len(d) // 2]);"
        " auto_engine(TMP + '/t.gguf')",
        "ModelFormatError",
    ),
    (
        "random-bytes-gguf",
        "open(TMP + '/r.gguf', 'wb').write(os.urandom(4096)); auto_engine(TMP + '/r.gguf')",
        "ModelFormatError",
    ),
    ("directory-as-toml", "os.mkdir(TMP + '/c.toml'); load_engine(TMP + '/c.toml')", "ConfigError"),
    (
        "non-utf8-toml",
        "open(TMP + '/b.toml', 'wb').write(b'model = \"\\xff\\xfe\"'); load_engine(TMP + '/b.toml')",
        "ConfigError",
    ),
    (
        "invalid-toml",
        "open(TMP + '/i.toml', 'w').write('model = ['); load_engine(TMP + '/i.toml')",
        "ConfigError",
    ),
    ("config-int", "load_engine(42)", "ConfigError"),
    ("unknown-backend", "load_engine({'model': GGUF, 'backend': 'nope'})", "UnknownBackend"),
    ("unknown-option", "load_engine({'model': GGUF, 'options': {'bogus': 1}})", "ConfigError"),
    ("option-wrong-type", "load_engine({'model': GGUF, 'options': {'n_threads': 'x'}})", "ConfigError"),
    (
        "options-env-not-json",
        "os.environ['UNILLM_OPTIONS'] = '{nope'; load_engine({'model': GGUF})",
        "ConfigError",
    ),
    (
        "template-nested-loops",
        "e = L(); e.config = e.config.model_copy(update={'chat_template': "
        "'{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}'});"
        " e.chat([{'role': 'user', 'content': 'x'}])",
        "ModelFormatError",
    ),
    (
        "template-huge-string",
        "from unillm.engines.llamacpp import LlamaCppEngine as C;"
        " e = C(model=variant(chat_template=\"{{ 'a' * 10**10 }}\")).load();"
        " e.chat([{'role': 'user', 'content': 'x'}])",
        "ModelFormatError",
    ),
    (
        "template-syntax-error-at-load",
        "from unillm.engines.llamacpp import LlamaCppEngine as C;"
        " C(model=variant(chat_template='{% for %}')).load()",
        "ModelFormatError",
    ),
    (
        "template-attribute-walk",
        "e = L(); e.config = e.config.model_copy(update={'chat_template': "
        "\"{{ ''.__class__.__mro__[1].__subclasses__() }}\"}); e.chat([{'role': 'user', 'content': 'x'}])",
        "ModelFormatError",
    ),
    (
        "safetensors-nested-shape",
        "import shutil, struct; d = TMP + '/st'; shutil.copytree(HF, d);"
        " h = json.dumps({'w': {'dtype': 'F32', 'shape': [[1], 10**8], 'data_offsets': [0, 4]}}).encode();"
        " open(d + '/model.safetensors', 'wb').write(struct.pack('<Q', len(h)) + h + b'0000');"
        " unillm.inspect_model(d)",
        "ModelFormatError",
    ),
    (
        "safetensors-nested-huge-shape",
        "import shutil, struct; d = TMP + '/st2'; shutil.copytree(HF, d);"
        " h = json.dumps({'w': {'dtype': 'F32', 'shape': [[1], 2**40], 'data_offsets': [0, 4]}}).encode();"
        " open(d + '/model.safetensors', 'wb').write(struct.pack('<Q', len(h)) + h + b'0000');"
        " unillm.inspect_model(d)",
        "ModelFormatError",
    ),
    (
        "config-json-deeply-nested",
        "import shutil; d = TMP + '/cj'; shutil.copytree(HF, d);"
        " open(d + '/config.json', 'w').write('[' * 100000 + ']' * 100000); unillm.inspect_model(d)",
        "ModelFormatError",
    ),
]
# the batching llama.cpp engine (its own request path: a worker thread, per-sequence samplers)
B_CASES = [
    ("batch-parallel-zero", "B(parallel=0)", "ConfigError"),
    ("batch-parallel-huge", "B(parallel=10**6)", "ConfigError"),
    ("batch-prefix-cache-negative", "B(prefix_cache_tokens=-1)", "ConfigError"),
    ("batch-prompt-past-context", "B().generate('word ' * 2000)", "ContextLengthExceeded"),
    ("batch-logit-bias-out-of-vocab", "B().generate('hi', logit_bias={10**6: 1.0})", "ConfigError"),
    ("batch-closed-generate", "e = B(); e.close(); e.generate('x')", "EngineClosed"),
    (
        "batch-close-while-streaming-same-thread",
        "e = B(); it = e.stream('hi', max_tokens=100, ignore_eos=True); next(it); e.close(); list(it)",
        "EngineClosed",
    ),
    (
        "batch-close-while-four-stream",
        "e = B(); out = []; going = threading.Barrier(5)\n"
        "def run(i):\n"
        "    try:\n"
        "        it = e.stream(f'story {i}', max_tokens=400, ignore_eos=True); next(it); going.wait()\n"
        "        out.append(len(list(it)))\n"
        "    except EngineClosed:\n"
        "        out.append('closed')\n"
        "ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]; [t.start() for t in ts]\n"
        "going.wait(); e.close(); [t.join() for t in ts]; result = sorted(map(str, out))\n"
        "assert out.count('closed') >= 1, out",
        "ok",
    ),
    (
        "batch-fills-the-context",  # max_tokens past the room left: reduced to what fits
        "e = B(); ids = e.tokenize('word ' * 1000)[:500];"
        " c = e.generate(ids, max_tokens=400, ignore_eos=True);"
        " assert c.finish_reason == 'length' and len(c.token_ids) == 12, (c.finish_reason, len(c.token_ids))",
        "ok",
    ),
    (
        "batch-one-token-steps",  # n_batch 1, four streams: steps hold more decoding rows than n_batch
        "e = B(n_batch=1); out = [None] * 4\n"
        "def run(i):\n"
        "    out[i] = e.generate(f'hello there {i}', max_tokens=5, ignore_eos=True)\n"
        "ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "assert [len(c.token_ids) for c in out] == [5] * 4",
        "ok",
    ),
    (
        "batch-schema-and-logprobs-together",
        "e = B(); out = [None] * 4\n"
        "fmt = {'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': {'type': 'object',"
        " 'properties': {'a': {'type': 'boolean'}}, 'required': ['a']}}}\n"
        "def run(i):\n"
        "    kw = {'response_format': fmt} if i % 2 else {'logprobs': 3}\n"
        "    out[i] = e.generate(f'answer {i}', max_tokens=40, **kw)\n"
        "ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "for i in (1, 3): json.loads(out[i].text)\n"
        "assert all(len(out[i].top_logprobs) == len(out[i].token_ids) for i in (0, 2))",
        "ok",
    ),
    (
        "batch-async-cancel-then-reuse",
        "import asyncio\n"
        "e = B()\n"
        "async def one():\n"
        "    async for c in e.astream('hi', max_tokens=300, ignore_eos=True):\n"
        "        pass\n"
        "async def main():\n"
        "    t = asyncio.create_task(one()); await asyncio.sleep(0.05); t.cancel()\n"
        "    await asyncio.gather(t, return_exceptions=True)\n"
        "    return await e.agenerate('hi', max_tokens=4, ignore_eos=True)\n"
        "c = asyncio.run(main()); assert len(c.token_ids) == 4 and e.kv_stats().running_sequences == 0",
        "ok",
    ),
]
M_CASES = [
    ("mlx-detokenize-huge-id", "M().detokenize([10**6])", "ConfigError"),
    ("mlx-prompt-bytes", "M().generate(b'x')", "ConfigError"),
    ("mlx-closed-kv-stats", "e = M(); e.close(); e.kv_stats()", "EngineClosed"),
    (
        "mlx-close-while-streaming",
        "e = M(options={'batch_size': 1}); it = e.stream('hi', max_tokens=50, ignore_eos=True); next(it);"
        " e.close(); list(it)",
        "EngineClosed",
    ),
    (
        "mlx-template-nested-loops",
        "e = M(); e.config = e.config.model_copy(update={'chat_template': "
        "'{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}'});"
        " e.chat([{'role': 'user', 'content': 'x'}])",
        "ModelFormatError",
    ),
]
# (id, CLI arguments with {GGUF}, {HF}, {TMP} filled in)
CLI_CASES = [
    ("cli-goal-bogus", ["select", "{GGUF}", "--goal", "bogus"]),
    ("cli-build-tiny-size-huge", ["testing", "build-tiny", "{TMP}/t", "--size", "huge"]),
    ("cli-demo-size-huge", ["demo", "--size", "huge"]),
    ("cli-select-concurrency-zero", ["select", "{GGUF}", "--concurrency", "0"]),
    ("cli-select-concurrency-negative", ["select", "{GGUF}", "--concurrency", "-3"]),
    ("cli-plan-context-negative", ["plan", "{GGUF}", "--context", "-5"]),
    ("cli-hardware-unknown-key", ["select", "{GGUF}", "--hardware", "{TMP}/bad-profile.json"]),
    ("cli-generate-missing-model", ["generate", "{TMP}/nope.gguf", "hi"]),
    ("cli-inspect-char-device", ["inspect", "/dev/zero"]),
    ("cli-plan-does-not-fit", ["plan", "{GGUF}", "--context", "1000000000"]),
]


@pytest.fixture(scope="module")
def forks(tiny: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, _Forks]]:
    """A forking interpreter per engine: one with mlx-lm imported ends each child in 1.2 s more
    (the shutdown of what transformers loads), so the llama.cpp cases fork from one without it."""
    env = _env(tiny, tmp_path_factory.mktemp("forks"))
    servers = {m: _Forks(env, m) for m in ("llama_cpp", "mlx_lm")}
    try:
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def _env(tiny: TinyModel, tmp: Path) -> dict[str, str]:
    return {
        **os.environ,
        "T_GGUF": str(tiny.gguf_path),
        "T_HF": str(tiny.hf_dir),
        "T_ROOT": str(tiny.root),
        "T_TMP": str(tmp),
        "UNILLM_CACHE": str(tmp / "cache"),
    }


def _check(code: str, want: str | tuple[str, ...], forks: _Forks, tmp: Path) -> None:
    got = forks.run(code, tmp)
    wanted = (want,) if isinstance(want, str) else want
    assert got["outcome"] in wanted, got
    if got["outcome"] != "ok":
        assert got["typed"], f"{got['outcome']} is not a UnillmError: {got['message']}"
        assert got["message"], "a typed error without a message"


@pytest.mark.skipif(not HAS_LLAMA, reason="llama-cpp-python is not installed")
@pytest.mark.parametrize(
    ("code", "want"), [c[1:] for c in L_CASES + B_CASES], ids=[c[0] for c in L_CASES + B_CASES]
)
def test_api_case(code: str, want: str | tuple[str, ...], forks: dict[str, _Forks], tmp_path: Path) -> None:
    _check(code, want, forks["llama_cpp"], tmp_path)


@pytest.mark.skipif(not HAS_MLX, reason="mlx-lm is not installed")
@pytest.mark.parametrize(("code", "want"), [c[1:] for c in M_CASES], ids=[c[0] for c in M_CASES])
def test_mlx_case(code: str, want: str | tuple[str, ...], forks: dict[str, _Forks], tmp_path: Path) -> None:
    _check(code, want, forks["mlx_lm"], tmp_path)


@pytest.mark.parametrize("args", [c[1] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_case(args: list[str], tiny: TinyModel, tmp_path: Path) -> None:
    (tmp_path / "bad-profile.json").write_text(json.dumps({"cpu_cores": 2, "warp_drive": True}))
    filled = [a.format(GGUF=tiny.gguf_path, HF=tiny.hf_dir, TMP=tmp_path) for a in args]
    out = subprocess.run(
        [sys.executable, "-m", "unillm", *filled],
        check=False,
        capture_output=True,
        text=True,
        env=_env(tiny, tmp_path),
        timeout=_TIMEOUT,
    )
    assert out.returncode > 0, f"exit {out.returncode}: {out.stdout[-1000:]} {out.stderr[-1000:]}"
    assert "Traceback" not in out.stderr + out.stdout, out.stderr[-3000:]
    assert (out.stderr + out.stdout).strip(), "failed without saying why"


def test_the_matrix_is_large_enough() -> None:
    assert len(L_CASES) + len(M_CASES) + len(CLI_CASES) >= 80
