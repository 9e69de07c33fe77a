"""Chat templates as untrusted input: real ones render exactly as before, hostile ones are stopped.

Every hostile case that would hang or exhaust the interpreter if its bound failed runs in a child
process with an address-space limit and a timeout, so a broken bound fails its test instead of
ending the run. Asserted times are generous (the render deadline plus slack): this suite shares a
loaded machine.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from unillm import ConfigError, ModelFormatError
from unillm._chat._template import (
    MAX_OUTPUT_CHARS,
    MAX_TEMPLATE_CHARS,
    RENDER_DEADLINE_S,
    render_chat_template,
)
from unillm._types import ChatMessage
from unillm.testing import TinyModel
from unillm.testing._tiny import CHAT_TEMPLATE, write_variant_gguf

from .conftest import needs_llama_cpp

SLACK_S = 20.0  # on top of the render deadline, for a loaded 2-core machine
CHILD_TIMEOUT_S = 60

# ---- real templates (as published, lightly trimmed) ----

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set "
    "system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set "
    "system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == "
    "'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != "
    "false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + "
    "message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if "
    "message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif "
    "message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
    "supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}"
    "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)
PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + "
    "message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + "
    "message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}{% if loop.last and "
    "add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}{% endfor %}"
)
DEEPSEEK_R1 = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, system_prompt='') %}{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}{%- endif %}"
    "{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}{%- for message in messages %}{%- if "
    "message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}{%- endif %}{%- if "  # noqa: RUF001
    "message['role'] == 'assistant' %}{% set content = message['content'] %}{% if '</think>' in "
    "content %}{% set content = content.split('</think>')[-1] %}{% endif %}{{ '<｜Assistant｜>' + "  # noqa: RUF001
    "content + '<｜end▁of▁sentence｜>' }}{%- endif %}{%- endfor -%}{% if add_generation_prompt %}"  # noqa: RUF001
    "{{ '<｜Assistant｜><think>\\n' }}{% endif %}"  # noqa: RUF001
)
QWEN3 = """{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>')
            and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or message.role == "system" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')
                    .split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n')
                + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""
# Not a published template: the features real ones use, together (macros and recursion, break,
# selectattr/map/join/dictsort/tojson, dict and list literals, %, str.format, ~, * on a string).
FEATURES = """{%- macro render(value, depth) -%}
  {%- if value is mapping -%}{ {%- for k, v in value|dictsort %}{{ k }}: {{ render(v, depth + 1) }}
      {{- ', ' if not loop.last }}{% endfor -%} }
  {%- elif value is string -%}{{ value|trim }}
  {%- elif value is iterable -%}[{{ value|map('string')|join(', ') }}]
  {%- else -%}{{ '%03d' % value }}
  {%- endif -%}
{%- endmacro -%}
{%- set users = messages|selectattr('role', 'equalto', 'user')|list -%}
{{- '%d user turns' % (users|length) }} / {{ '{:>3}'.format(messages|length) }}{{ '\\n' }}
{%- for m in messages -%}
  {%- if loop.index > 3 %}{% break %}{% endif -%}
  {{ '=' * 3 }} {{ m.role|upper ~ (' (first)' if loop.first else '') }}
{{ render({'text': m.content, 'meta': {'n': loop.index, 'tags': [m.role, 'x']}}, 0) }}
{% endfor -%}
{{ messages|map(attribute='role')|join(',') }}|{{ messages|tojson }}
{%- if add_generation_prompt %}{{ '\\n' ~ 'assistant:' }}{% endif -%}"""

USER = [ChatMessage("user", "Capital of France?")]
ALTERNATING = [
    ChatMessage("user", "  Hi {{ there }} {% raw %} <|im_end|>  "),
    ChatMessage("assistant", "<think>hmm\n</think>\n\nHello! ünïcödé 🙂"),
    ChatMessage("user", "What is 2+2?\n"),
]
WITH_SYSTEM = [ChatMessage("system", "Be brief."), *ALTERNATING]
REAL = [
    (CHAT_TEMPLATE, [USER, WITH_SYSTEM]),
    (LLAMA3, [USER, WITH_SYSTEM]),
    (LLAMA2, [USER, ALTERNATING, WITH_SYSTEM]),
    (MISTRAL, [USER, ALTERNATING]),
    (GEMMA, [USER, ALTERNATING]),
    (PHI3, [USER, WITH_SYSTEM]),
    (DEEPSEEK_R1, [USER, WITH_SYSTEM]),
    (QWEN3, [USER, WITH_SYSTEM]),
    (FEATURES, [USER, WITH_SYSTEM]),
]
REAL_IDS = ["chatml", "llama3", "llama2", "mistral", "gemma", "phi3", "deepseek-r1", "qwen3", "features"]


def plain_render(template: str, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
    """What jinja's sandbox renders with no bounds: the reference for 'renders identically'."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    return env.from_string(template).render(
        messages=[{"role": m.role, "content": m.content} for m in messages],
        add_generation_prompt=add_generation_prompt,
        bos_token="<s>",
        eos_token="</s>",
    )


@pytest.mark.parametrize(("template", "conversations"), REAL, ids=REAL_IDS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_real_templates_render_as_the_plain_sandbox_does(
    template: str, conversations: list[list[ChatMessage]], add_generation_prompt: bool
) -> None:
    for messages in conversations:
        ours = render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token="<s>",
            eos_token="</s>",
        )
        assert ours == plain_render(template, messages, add_generation_prompt)
        assert ours  # every one of them writes something


def test_raise_exception_is_still_a_config_error() -> None:
    with pytest.raises(ConfigError, match="refused the messages: Conversation roles must alternate"):
        render_chat_template(MISTRAL, [ChatMessage("user", "a"), ChatMessage("user", "b")])
    with pytest.raises(ConfigError, match="System role not supported"):
        render_chat_template(GEMMA, WITH_SYSTEM)


def test_transformers_generation_tag_renders_its_body() -> None:
    template = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    assert render_chat_template(template, USER) == "[Capital of France?]"


def test_a_long_real_prompt_is_not_refused() -> None:
    """The bounds sit well above real prompts: ~3 MB through templates that copy it a few times."""
    long = [ChatMessage("system", "rules " * 100_000), ChatMessage("user", "word " * 500_000)]
    for template in (CHAT_TEMPLATE, LLAMA3, QWEN3):
        assert len(render_chat_template(template, long, bos_token="<s>")) > 3_000_000


def test_a_prompt_over_the_output_limit_is_refused() -> None:
    huge = [ChatMessage("user", "x" * (MAX_OUTPUT_CHARS + 1))]
    with pytest.raises(ModelFormatError, match=f"over the limit of {MAX_OUTPUT_CHARS}"):
        render_chat_template(CHAT_TEMPLATE, huge)


# ---- escapes: refused by the sandbox, nothing runs (safe in-process: nothing here loops) ----

ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% for m in messages %}{{ m.content.__class__.__base__.__subclasses__() }}{% endfor %}",
    "{{ cycler.__init__.__globals__.os.system('touch PWNED') }}",
    "{{ joiner.__init__.__globals__.os.system('touch PWNED') }}",
    "{{ namespace.__init__.__globals__.os.system('touch PWNED') }}",
    "{{ lipsum.__globals__['os'].system('touch PWNED') }}",
    "{{ (lipsum|attr('__globals__'))['os'].system('touch PWNED') }}",
    "{{ raise_exception.__globals__['__builtins__']['open']('PWNED', 'w') }}",
    "{{ range.__globals__['os'].system('touch PWNED') }}",
    "{{ self._TemplateReference__context.environment }}",
    "{{ ''.format.__globals__['os'].system('touch PWNED') }}",
    "{{ '{0.__class__.__mro__}'.format('') }}",
    "{{ messages.append({'role': 'user', 'content': 'x'}) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_escapes_are_refused_and_run_nothing(
    template: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelFormatError, match="unsafe operation") as info:
        render_chat_template(template, USER, source="evil.gguf")
    assert "'evil.gguf'" in str(info.value) and "trusted chat_template" in str(info.value)
    assert not (tmp_path / "PWNED").exists()


# ---- templates that do not compile (safe in-process: compiling is bounded by the length cap) ----

BROKEN = [
    pytest.param("{% for x %}", "TemplateSyntaxError", id="syntax"),
    pytest.param("{{ messages | no_such_filter }}", "No filter named", id="unknown-filter"),
    pytest.param("{{" + "(" * 500 + "1" + ")" * 500 + "}}", "RecursionError", id="deep-parens"),
    pytest.param("{{ " + "[" * 300 + "]" * 300 + " }}", "RecursionError", id="deep-literal"),
    pytest.param("{% for a in b %}" * 25 + "{% endfor %}" * 25, "nested blocks", id="nested-blocks"),
    pytest.param("{{ " + "9" * 5000 + " }}", "digits", id="huge-int-literal"),
    pytest.param("x" * (MAX_TEMPLATE_CHARS + 1), "over the limit", id="too-long"),
]


@pytest.mark.parametrize(("template", "why"), BROKEN)
def test_templates_that_do_not_compile_are_model_format_errors(template: str, why: str) -> None:
    for _ in range(2):  # the second time from the cache, with the same message
        with pytest.raises(ModelFormatError, match="does not compile") as info:
            render_chat_template(template, USER, source="evil.gguf")
        assert why in str(info.value) and "'evil.gguf'" in str(info.value)


# ---- exhaustion: each in a child process, under a memory limit and a timeout ----

_RENDER_CHILD = r"""
import json, resource, sys, time
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from unillm._chat._template import render_chat_template
from unillm._types import ChatMessage
template = sys.stdin.read()
t0 = time.monotonic()
try:
    out = render_chat_template(template, [ChatMessage("user", "hello")], source="evil.gguf")
    outcome = {"error": None, "message": out[:200]}
except Exception as exc:
    outcome = {"error": type(exc).__name__, "message": str(exc)}
outcome["seconds"] = time.monotonic() - t0
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forking parent (pytest, which
# may hold gigabytes of engines), so the child would report its parent's peak
outcome["peak_rss_mb"] = next(
    int(line.split()[1]) // 1024 for line in open("/proc/self/status") if line.startswith("VmHWM")
)
print(json.dumps(outcome))
"""
CHILD_MEMORY = 2 << 30  # what each hostile case below would need unbounded is far more

_DOUBLE = "{% set a = a ~ a %}"
EXHAUSTION = [
    # time
    pytest.param(
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
        "deadline",
        id="nested-loops-silent",
    ),
    pytest.param(
        "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}",
        "deadline|output passed",
        id="nested-loops-writing",
    ),
    pytest.param(
        "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
        "deadline",
        id="nested-loops-over-strings",
    ),
    pytest.param(
        "{% for a in range(100000) %}{% for b in range(100000) if b < 0 %}{% endfor %}{% endfor %}",
        "deadline",
        id="nested-filtered-loops",
    ),
    pytest.param(
        "{% macro f() %}{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}"
        "{% endfor %}{% endmacro %}{{ f() }}",
        "deadline|characters",
        id="nested-loops-in-a-macro",
    ),
    # recursion
    pytest.param(
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nest more than", id="recursive-macro"
    ),
    pytest.param(
        "{% macro f(n) %}{{ f(n - 1) }}{{ f(n - 1) }}{% endmacro %}{{ f(40) }}",
        "nest more than|deadline",
        id="fan-out-recursion",
    ),
    pytest.param("{% block b %}{{ self.b() }}{% endblock %}", "nest more than", id="recursive-block"),
    pytest.param(
        "{% for x in [[1]] recursive %}{{ loop([x]) }}{% endfor %}", "nest more than", id="recursive-loop"
    ),
    # numbers
    pytest.param("{{ 10 ** (10 ** 10) }}", "power", id="huge-exponent"),
    pytest.param(
        "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
        "bits",
        id="repeated-squaring",
    ),
    pytest.param("{{ 10.0 ** 1000 }}", "OverflowError", id="float-overflow"),
    pytest.param("{{ (10 ** 5000)|string }}", "digits", id="unprintable-int"),
    pytest.param("{{ 1 / 0 }}", "ZeroDivisionError", id="division-by-zero"),
    # size, in one step
    pytest.param("{{ 'a' * 10**10 }}", "characters", id="huge-string"),
    pytest.param("{{ messages[0]['content'] * 10**9 }}", "characters", id="length-scaled-string"),
    pytest.param("{{ messages * 10**8 }}", "characters", id="huge-list"),
    pytest.param("{{ (['x' * 100000] * 1000)|join }}", "characters", id="repeat-then-join"),
    pytest.param("{{ '{:>1000000000}'.format(1) }}", "width", id="format-width"),
    pytest.param("{{ '{0:{1}}'.format(1, 10**9) }}", "width", id="format-computed-width"),
    pytest.param("{{ '%1000000000d' % 1 }}", "width", id="printf-width"),
    pytest.param("{{ '%*d' % (10**9, 1) }}", "width", id="printf-star-width"),
    pytest.param("{{ '%1000000000s'|format('a') }}", "width", id="format-filter"),
    pytest.param("{{ 'x'|center(10**9) }}", "characters", id="center"),
    pytest.param("{{ 'x'.ljust(10**9) }}", "characters", id="ljust"),
    pytest.param("{{ 'x'|indent(10**9) }}", "characters", id="indent"),
    pytest.param("{{ '\t'.expandtabs(10**9) }}", "characters", id="expandtabs"),
    pytest.param("{{ ('x' * 1000).replace('x', 'y' * 100000) }}", "characters", id="replace"),
    pytest.param("{{ ('x' * 1000)|replace('x', 'y' * 100000) }}", "characters", id="replace-filter"),
    pytest.param("{{ (1).to_bytes(10**9, 'big') }}", "characters", id="to-bytes"),
    pytest.param("{{ lipsum(10**6) }}", "characters", id="lipsum"),
    pytest.param("{{ [1]|batch(10**8, 'x')|list }}", "characters", id="batch-fill"),
    pytest.param("{{ [1]|slice(10**8)|list }}", "slices into", id="slice"),
    pytest.param("{{ messages|tojson(indent=10**6) }}", "characters", id="tojson-indent"),
    pytest.param("{{ ('x' * 4000000)|wordwrap(1) }}", "wraps", id="wordwrap-quadratic"),
    pytest.param("{{ range(10**9)|list }}", "Range too big", id="huge-range"),
    # size, by doubling (each step small, the sum huge)
    pytest.param("{% set a = 'x' * 1000 %}" + _DOUBLE * 40 + "{{ a }}", "characters", id="concat-doubling"),
    pytest.param(
        "{% set a = 'x' * 1000 %}" + "{% set a = a + a %}" * 40 + "{{ a }}", "characters", id="plus-doubling"
    ),
    pytest.param(
        "{% set a = ['x' * 1000] %}" + "{% set a = [a, a] %}" * 40 + "{{ a }}", "characters", id="shared-list"
    ),
    pytest.param(
        "{% set a = ('x',) %}{% set b = ('x',) %}"
        + "{% set a = (a, a) %}{% set b = (b, b) %}" * 60
        + "{{ a == b }}",
        "characters",
        id="shared-tuples-compared",
    ),
    pytest.param(
        "{% set ns = namespace(l=[1]) %}{% for i in range(100) %}{% set ns.l = ns.l + [ns.l] %}"
        "{% endfor %}{{ ns.l }}",
        "characters",
        id="namespace-doubling",
    ),
    pytest.param(
        "{% macro f(n) %}{% if n %}{% set x = f(n - 1) %}{{ x }}{{ x }}{% else %}ab{% endif %}"
        "{% endmacro %}{{ f(40) }}",
        "characters",
        id="macro-doubling",
    ),
    pytest.param(
        "{% set ns = namespace(x=[]) %}{% for i in range(300) %}{% set ns.x = [ns.x] %}{% endfor %}"
        "{{ ns.x }}",
        "nested more than",
        id="deep-nesting",
    ),
    pytest.param("{% set ns = namespace() %}{% set ns.me = ns %}{{ [ns] }}", "nested more than", id="cycle"),
    # compiling: the longest template allowed, of the costliest kind to compile, then fails at once
    pytest.param("{{ f(1) }}" * (MAX_TEMPLATE_CHARS // 10), "undefined", id="longest-template"),
]


def run_child(code: str, *args: str, stdin: str = "", cwd: Path | None = None) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter; its last stdout line is a JSON object."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, *args],
            input=stdin,
            check=False,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            cwd=cwd,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the child hung past {CHILD_TIMEOUT_S} s (stderr: {exc.stderr!r:.500})")
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, f"the child died ({done.returncode}): {done.stderr[-2000:]}"
    result: dict[str, Any] = json.loads(lines[-1])
    return result


@pytest.mark.parametrize(("template", "match"), EXHAUSTION)
def test_exhaustion_is_stopped_in_bounded_time_and_memory(template: str, match: str, tmp_path: Path) -> None:
    outcome = run_child(_RENDER_CHILD, str(CHILD_MEMORY), stdin=template, cwd=tmp_path)
    assert outcome["error"] == "ModelFormatError", outcome
    assert re.search(match, outcome["message"]), outcome["message"]
    assert "'evil.gguf'" in outcome["message"]
    assert outcome["seconds"] < RENDER_DEADLINE_S + SLACK_S
    assert outcome["peak_rss_mb"] < 1024  # the hostile values would be gigabytes


_THREADS_CHILD = r"""
import json, threading
from unillm._chat._template import render_chat_template
from unillm._types import ChatMessage
from unillm.testing._tiny import CHAT_TEMPLATE
msgs = [ChatMessage("user", "hello")]
errors = []
def hostile():
    try:
        render_chat_template(
            "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", msgs
        )
    except Exception as exc:
        errors.append(type(exc).__name__)
t = threading.Thread(target=hostile)
t.start()
normal = [render_chat_template(CHAT_TEMPLATE, msgs) for _ in range(200)]
t.join()
print(json.dumps({"hostile": errors, "normal_ok": len(set(normal)) == 1 and len(normal) == 200}))
"""


def test_a_hostile_render_does_not_disturb_another_thread() -> None:
    """Each render keeps its own budget, so a server's other requests render normally meanwhile."""
    outcome = run_child(_THREADS_CHILD)
    assert outcome == {"hostile": ["ModelFormatError"], "normal_ok": True}


# ---- the same templates inside real engines ----

# case -> (template planted in the model, expected error pattern). The operands of the big ones
# come from the messages: llama-cpp-python folds constant expressions when it compiles the file's
# template inside Llama() (see test_llama_cpp_compiles_the_gguf_template_itself_at_load).
ENGINE_CASES: dict[str, tuple[str, str]] = {
    "nested-loops": (
        "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}",
        "deadline|output passed",
    ),
    "huge-exponent": ("{{ 10 ** (10 ** (10 * messages|length)) }}", "power"),
    "huge-string": ("{{ messages[0]['content'] * 10**10 }}", "characters"),
    "recursive-macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nest more than"),
    "file-write": ("{{ cycler.__init__.__globals__.os.system('touch PWNED') }}", "unsafe operation"),
    "syntax-error": ("{% for x %}", "does not compile"),
}

_ENGINE_CHILD = r"""
import json, resource, sys, time
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from unillm import UnillmError, auto_engine
from unillm.testing._tiny import CHAT_TEMPLATE
cases = json.loads(sys.stdin.read())
for case, path in cases.items():
    t0 = time.monotonic()
    outcome = {"case": case, "phase": "load", "error": None, "message": "", "generates": False}
    try:
        with auto_engine(path, context_length=128) as engine:
            outcome["phase"] = "chat"
            try:
                engine.chat([{"role": "user", "content": "hi"}], max_tokens=2, temperature=0.0)
            except UnillmError as exc:
                outcome.update(error=type(exc).__name__, message=str(exc))
            outcome["generates"] = bool(engine.generate("hello", max_tokens=2, temperature=0.0).token_ids)
        with auto_engine(path, context_length=128, chat_template=CHAT_TEMPLATE) as engine:
            reply = engine.chat([{"role": "user", "content": "hi"}], max_tokens=2)
            outcome["trusted_template_works"] = reply.usage.prompt_tokens > 0
    except UnillmError as exc:
        outcome.update(error=type(exc).__name__, message=str(exc))
    outcome["seconds"] = time.monotonic() - t0
    print(json.dumps(outcome), flush=True)
"""


def run_engine_cases(paths: dict[str, str], memory: int, cwd: Path) -> dict[str, dict[str, Any]]:
    """All cases in one child (engine imports are slow): one JSON line per finished case, so a case
    that hangs shows as the one missing."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _ENGINE_CHILD, str(memory)],
            input=json.dumps(paths),
            check=False,
            capture_output=True,
            text=True,
            timeout=4 * CHILD_TIMEOUT_S,
            cwd=cwd,
        )
        out, err = done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = "timed out"
    results = {}
    for line in out.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            results[row["case"]] = row
    results["_stderr"] = {"text": err[-2000:]}
    return results


def check_engine_case(results: dict[str, dict[str, Any]], case: str, cwd: Path, load_phase: set[str]) -> None:
    assert case in results, f"{case} never finished: {results['_stderr']['text']}"
    row = results[case]
    _, match = ENGINE_CASES[case]
    assert row["error"] == "ModelFormatError", row
    assert re.search(match, row["message"]), row["message"]
    assert row["seconds"] < RENDER_DEADLINE_S + SLACK_S + 30  # + loading the model twice
    assert not (cwd / "PWNED").exists()
    if case in load_phase:
        assert row["phase"] == "load"
    else:
        assert row["phase"] == "chat"
        assert row["generates"], "the engine itself must stay usable"
        assert row["trusted_template_works"], "the advice (a trusted chat_template) must work"


@pytest.fixture(scope="module")
def llama_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, dict[str, Any]], Path]:
    cwd = tmp_path_factory.mktemp("llama-templates")
    paths = {
        case: str(write_variant_gguf(cwd / f"{case}.gguf", chat_template=template))
        for case, (template, _) in ENGINE_CASES.items()
    }
    return run_engine_cases(paths, 3 << 30, cwd), cwd


@needs_llama_cpp
@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_llama_cpp_stops_hostile_gguf_templates(
    llama_results: tuple[dict[str, dict[str, Any]], Path], case: str
) -> None:
    results, cwd = llama_results
    check_engine_case(results, case, cwd, load_phase={"syntax-error"})
    if case == "syntax-error":  # unillm compiles the file's template at load and names the file
        message = results[case]["message"]
        assert str(cwd / "syntax-error.gguf") in message and "does not compile" in message


_LOAD_CHILD = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from unillm import UnillmError, auto_engine
t0 = time.monotonic()
try:
    with auto_engine(sys.argv[1], context_length=128):
        outcome = {"error": None}
except UnillmError as exc:
    outcome = {"error": type(exc).__name__}
outcome["seconds"] = time.monotonic() - t0
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forking parent (pytest, which
# may hold gigabytes of engines), so the child would report its parent's peak
outcome["peak_rss_mb"] = next(
    int(line.split()[1]) // 1024 for line in open("/proc/self/status") if line.startswith("VmHWM")
)
print(json.dumps(outcome))
"""


@needs_llama_cpp
@needs_llama_cpp
def test_llama_cpp_does_not_compile_the_gguf_template_itself_at_load(tmp_path: Path) -> None:
    """llama-cpp-python compiles a GGUF's template inside Llama(), in an environment that folds
    constant expressions: 10 ** (10 ** 10) hung the load. unillm keeps Llama() from building chat
    handlers it never uses, and its own bounded compile accepts the template (it only fails when
    rendered)."""
    path = write_variant_gguf(tmp_path / "bomb.gguf", chat_template="{{ 10 ** (10 ** 10) }}")
    try:
        done = subprocess.run(
            [sys.executable, "-c", _LOAD_CHILD, str(path)],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("loading the GGUF hung in llama-cpp-python's own template compile")
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["error"] is None and outcome["peak_rss_mb"] < 1024


@pytest.fixture(scope="module")
def mlx_results(
    tiny: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, dict[str, Any]], Path]:
    cwd = tmp_path_factory.mktemp("mlx-templates")
    paths = {}
    for case, (template, _) in ENGINE_CASES.items():
        model = cwd / case
        shutil.copytree(tiny.hf_dir, model)
        config = json.loads((model / "tokenizer_config.json").read_text(encoding="utf-8"))
        config["chat_template"] = template
        (model / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
        paths[case] = str(model)
    return run_engine_cases(paths, 4 << 30, cwd), cwd


@pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="mlx-lm is not installed")
@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_mlx_stops_hostile_tokenizer_templates(
    mlx_results: tuple[dict[str, dict[str, Any]], Path], case: str
) -> None:
    results, cwd = mlx_results
    check_engine_case(results, case, cwd, load_phase={"syntax-error"})  # MLX checks at load too
