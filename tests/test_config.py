"""Config from a dict, a TOML file and the environment; the environment swaps the backend."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from unillm import (
    ConfigError,
    EngineConfig,
    ModelNotFound,
    Registry,
    UnillmWarning,
    load_engine,
    read_config,
)
from unillm.testing import MockEngine, TinyModel


class AnyOptions(BaseModel):
    model_config = ConfigDict(extra="allow")


class Alpha(MockEngine):
    """A test backend that replies with its name and the options it received."""

    name = "alpha"
    formats = frozenset({"gguf"})
    Options = AnyOptions

    def __init__(self, config=None, **kw):  # type: ignore[no-untyped-def]
        super().__init__(lambda _p, _s: f"{self.name}:{self.options.model_dump()}", config, **kw)


class Beta(Alpha):
    name = "beta"


@pytest.fixture
def registry() -> Registry:
    reg = Registry(builtins=False, entry_points=False)
    reg.register_backend(Alpha)
    reg.register_backend(Beta)
    return reg


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("UNILLM_MODEL", "UNILLM_BACKEND", "UNILLM_CONTEXT_LENGTH", "UNILLM_OPTIONS"):
        monkeypatch.delenv(var, raising=False)


def test_from_dict(tiny_gguf: Path, registry: Registry) -> None:
    e = load_engine({"model": str(tiny_gguf), "backend": "alpha", "context_length": 128}, registry=registry)
    assert e.name == "alpha" and e.loaded and e.config.context_length == 128
    assert e.selection is not None and e.selection.chosen_by == "config"


def test_from_toml_with_per_backend_options(tmp_path: Path, tiny_gguf: Path, registry: Registry) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.gguf").write_bytes(tiny_gguf.read_bytes())
    cfg = tmp_path / "unillm.toml"
    cfg.write_text(
        'model = "models/m.gguf"\nbackend = "alpha"\n'
        "[options]\nshared = 1\n"
        "[backend_options.alpha]\nonly_alpha = true\n"
        "[backend_options.beta]\nonly_beta = true\n"
    )
    e = load_engine(cfg, registry=registry)
    assert e.config.model == str(tmp_path / "models" / "m.gguf")  # relative to the file
    assert e.generate("x").text == "alpha:{'shared': 1, 'only_alpha': True}"


def test_env_overrides_swap_the_backend_without_code_changes(
    tmp_path: Path, tiny_gguf: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "unillm.toml"
    cfg.write_text(f'model = "{tiny_gguf}"\nbackend = "alpha"\n[backend_options.beta]\nonly_beta = 2\n')
    monkeypatch.setenv("UNILLM_BACKEND", "beta")
    monkeypatch.setenv("UNILLM_OPTIONS", '{"threads": 3}')
    e = load_engine(cfg, registry=registry)
    assert e.name == "beta"
    assert e.selection is not None and e.selection.chosen_by == "environment"
    assert e.generate("x").text == "beta:{'threads': 3, 'only_beta': 2}"


def test_env_model_and_context(monkeypatch: pytest.MonkeyPatch, tiny_gguf: Path) -> None:
    monkeypatch.setenv("UNILLM_MODEL", str(tiny_gguf))
    monkeypatch.setenv("UNILLM_CONTEXT_LENGTH", "321")
    cfg = read_config({"model": "elsewhere.gguf", "context_length": 64})
    assert cfg.model == str(tiny_gguf) and cfg.context_length == 321


def test_precedence_file_then_code_then_env() -> None:
    env = {"UNILLM_BACKEND": "from-env"}
    cfg = read_config(
        {"model": "m", "backend": "from-file", "context_length": 32}, env=env, context_length=64
    )
    assert (cfg.backend, cfg.context_length) == ("from-env", 64)


def test_malformed_toml_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('model = "x\nbackend = \n')
    with pytest.raises(ConfigError, match="not valid TOML"):
        read_config(bad)


def test_unknown_config_field_is_refused() -> None:
    with pytest.raises(ConfigError, match="modle: unknown field"):
        EngineConfig(model="m", modle="typo")  # type: ignore[call-arg]


def test_missing_model_path(registry: Registry, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="never downloads"):
        load_engine({"model": str(tmp_path / "nope.gguf")}, registry=registry)


def test_a_forced_backend_decides_what_it_reads(registry: Registry, tmp_path: Path) -> None:
    # a plugin may take what unillm cannot detect (a model name on a server, its own format)
    e = load_engine({"model": "served-model-name", "backend": "alpha"}, registry=registry)
    assert e.selection is not None and e.selection.format == "unknown"


def test_a_forced_backend_for_the_wrong_format_warns(registry: Registry, tiny: TinyModel) -> None:
    with pytest.warns(UnillmWarning, match=r"selector sees a problem: does not read safetensors"):
        e = load_engine({"model": str(tiny.hf_dir), "backend": "alpha"}, registry=registry)
    assert e.selection is not None and "does not read safetensors" in e.selection.explain()


def test_no_model_at_all() -> None:
    with pytest.raises(ConfigError, match="UNILLM_MODEL"):
        read_config({}, env={})


def test_not_a_toml_path_says_what_to_call(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="auto_engine"):
        read_config(tmp_path / "model.gguf")


def test_bad_env_options_json() -> None:
    with pytest.raises(ConfigError, match="JSON object"):
        read_config({"model": "m"}, env={"UNILLM_OPTIONS": "[1, 2]"})


def test_unknown_backend_option_is_refused_with_the_valid_ones(tiny_gguf: Path) -> None:
    from unillm.engines.llamacpp import LlamaCppEngine

    with pytest.raises(ConfigError, match="n_treads: unknown field") as err:
        LlamaCppEngine(model=str(tiny_gguf), options={"n_treads": 2})
    assert "n_threads" in str(err.value)


# -- precedence holds for every option key: file < code < environment ---------------------------


def test_env_options_beat_a_files_backend_table(
    tmp_path: Path, tiny_gguf: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "unillm.toml"
    cfg.write_text(
        f'model = "{tiny_gguf}"\nbackend = "alpha"\n[backend_options.alpha]\nthreads = 1\nkeep = 1\n'
    )
    assert load_engine(cfg, registry=registry).generate("x").text == "alpha:{'threads': 1, 'keep': 1}"
    e = load_engine(cfg, registry=registry, options={"threads": 2})  # code beats the file's table
    assert e.generate("x").text == "alpha:{'threads': 2, 'keep': 1}"
    monkeypatch.setenv("UNILLM_OPTIONS", '{"threads": 3}')  # the environment beats both
    e = load_engine(cfg, registry=registry, options={"threads": 2})
    assert e.generate("x").text == "alpha:{'threads': 3, 'keep': 1}"


# (file options, file's alpha table, code options, code's alpha table, env options) -> alpha gets
@pytest.mark.parametrize(
    ("file_opts", "file_table", "code_opts", "code_table", "env_opts", "expected"),
    [
        ({"k": "file"}, {"k": "file-table"}, None, None, None, "file-table"),  # a table beats its layer
        ({"k": "file"}, {}, {"k": "code"}, None, None, "code"),
        ({}, {"k": "file-table"}, {"k": "code"}, None, None, "code"),
        ({}, {}, {"k": "code"}, {"k": "code-table"}, None, "code-table"),
        ({"k": "file"}, {}, None, {"k": "code-table"}, None, "code-table"),
        ({}, {"k": "file-table"}, None, None, {"k": "env"}, "env"),
        ({}, {}, {"k": "code"}, {"k": "code-table"}, {"k": "env"}, "env"),
    ],
    ids=[
        "table-in-layer",
        "code-opts",
        "code-over-table",
        "code-table",
        "code-table-over-file",
        "env",
        "env-top",
    ],
)
def test_option_precedence_per_key(
    file_opts: dict[str, str],
    file_table: dict[str, str],
    code_opts: dict[str, str] | None,
    code_table: dict[str, str] | None,
    env_opts: dict[str, str] | None,
    expected: str,
) -> None:
    import json

    env = {"UNILLM_OPTIONS": json.dumps(env_opts)} if env_opts else {}
    cfg = read_config(
        {"model": "m", "options": file_opts, "backend_options": {"alpha": file_table}},
        env=env,
        options=code_opts,
        backend_options={"Alpha": code_table} if code_table else None,  # another spelling, same table
    )
    assert cfg.options_for("alpha")["k"] == expected
    assert list(cfg.backend_options) == ["alpha"]


def test_env_options_leave_other_keys_of_the_table() -> None:
    cfg = read_config(
        {"model": "m", "backend_options": {"beta": {"a": 1, "b": 1}}}, env={"UNILLM_OPTIONS": '{"a": 2}'}
    )
    assert cfg.options_for("beta") == {"a": 2, "b": 1}
    assert cfg.options_for("alpha") == {"a": 2}


# -- a config file that cannot be used is a ConfigError that says what to do -------------------


def test_a_directory_as_the_config(tmp_path: Path) -> None:
    (tmp_path / "conf.toml").mkdir()
    with pytest.raises(ConfigError, match=r"is a directory, not a TOML config file; pass the path"):
        read_config(tmp_path / "conf.toml")
    with pytest.raises(ConfigError, match="auto_engine"):  # a model directory: open it as a model
        read_config(tmp_path)


def test_a_config_that_is_not_utf8(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.toml"
    bad.write_bytes('model = "caf\u00e9.gguf"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0xe9 at offset 12\).*save it as UTF-8"):
        read_config(bad)


def test_a_config_path_too_long(tmp_path: Path) -> None:
    long = tmp_path / ("x" * 300 + ".toml")
    with pytest.raises(
        ConfigError, match=r"config path is too long .*move the file to a shorter path"
    ) as err:
        read_config(long)
    assert len(str(err.value)) < 400  # the path is cut short in the message


def test_an_unreadable_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "secret.toml"
    cfg.write_text('model = "m.gguf"\n')

    def denied(self: Path) -> bytes:  # chmod does not stop root, who runs the tests
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(ConfigError, match=r"cannot be read: permission denied; make it readable"):
        read_config(cfg)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("unillm = 3\n", r"`unillm` in .* must be a table \(\[unillm\] followed by its fields\), got int"),
        ('unillm = "model.gguf"\n', r"`unillm` .* must be a table"),
        ('model = "m.gguf"\noptions = 3\n', r"options in .* must be a table of name = value pairs"),
        ('model = "m.gguf"\n[backend_options]\nalpha = 1\n', r"backend_options.alpha in .* must be a table"),
        ('model = "m.gguf"\nbackend_options = [1]\n', r"backend_options in .* must be a table"),
        ('model = "m.gguf"\ncontext_length = "big"\n', r"context_length: .*integer"),
        ("model = 3\n", r"model: .*string"),
        ('model = "m.gguf"\nunsupported_params = "ignore"\n', r"unsupported_params: .*'strict'"),
        ('[unillm]\nmodel = "m.gguf"\nmodle = "x"\n', r"modle: unknown field"),
    ],
    ids=["unillm-int", "unillm-str", "options", "table", "tables-list", "int", "model", "literal", "typo"],
)
def test_wrong_types_in_a_file(tmp_path: Path, text: str, match: str) -> None:
    cfg = tmp_path / "unillm.toml"
    cfg.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=match):
        read_config(cfg, env={})


def test_wrong_types_from_code_and_environment() -> None:
    with pytest.raises(ConfigError, match=r"options in the keyword arguments must be a table"):
        read_config({"model": "m"}, env={}, options=[("a", 1)])
    with pytest.raises(ConfigError, match=r"context_length"):
        read_config({"model": "m"}, env={"UNILLM_CONTEXT_LENGTH": "lots"})
