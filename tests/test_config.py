"""Settings precedence (CLI > SERVEWATCH_* env > TOML > defaults) and one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from agent.runtime.settings import ConfigError, Settings, load_settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("SERVEWATCH_"):
            monkeypatch.delenv(name)


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "servewatch.toml"
    path.write_text(text)
    return path


def test_defaults_validate() -> None:
    s = load_settings()
    assert s.data_dir == Path("servewatch-data")
    assert s.health.url is None and s.metrics.url is None
    assert s.watchdog.timeout_s == 300.0 and s.watchdog.hard is False
    assert s.incident.cooldown_s == 300.0
    assert s.pyspy.native is True
    assert Settings.model_validate(s.model_dump()) == s


def test_list_settings_default_to_a_new_list_each() -> None:
    """The list settings' `default=[]` (no factory: see TargetConfig.pids) is never shared."""
    a, b = load_settings(), load_settings()
    a.target.pids.append(7)
    a.api.names.append("x")
    a.fleet.peers.append("h:1")
    assert b.target.pids == [] and b.api.names == [] and b.fleet.peers == []
    assert load_settings().target.match == [] and load_settings().api.unix_socket_uids == []


def test_precedence_cli_over_env_over_toml_over_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _toml(
        tmp_path,
        'data_dir = "/from/toml"\n[watchdog]\ntimeout_s = 11\npoll_interval_s = 0.7\n'
        '[health]\nurl = "http://toml/health"\n[target]\nmatch = ["sglang::scheduler*"]\n',
    )
    monkeypatch.setenv("SERVEWATCH_WATCHDOG__TIMEOUT_S", "22")
    monkeypatch.setenv("SERVEWATCH_HEALTH__URL", "http://env/health")

    s = load_settings({"health": {"url": "http://cli/health"}}, config_file=cfg)
    assert s.health.url == "http://cli/health"  # CLI beats env and file
    assert s.watchdog.timeout_s == 22.0  # env beats file
    assert s.watchdog.poll_interval_s == 0.7  # file beats default, and merges within a table
    assert s.data_dir == Path("/from/toml")
    assert s.target.match == ["sglang::scheduler*"]
    assert s.health.interval_s == 5.0  # default

    # CLI values that were not given (None, empty lists) do not mask lower sources
    s = load_settings({"health": {"url": None}, "target": {"match": []}}, config_file=cfg)
    assert s.health.url == "http://env/health"
    assert s.target.match == ["sglang::scheduler*"]


def test_data_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SERVEWATCH_DATA_DIR", str(tmp_path / "d"))
    assert load_settings().data_dir == tmp_path / "d"


@pytest.mark.parametrize(
    ("cli", "env", "message"),
    [
        ({"watchdog": {"timeout_s": -1}}, {}, "invalid setting watchdog.timeout_s: Input should be greater than 0 (got -1)"),
        ({}, {"SERVEWATCH_WATCHDOG__TIMEOUT_S": "soon"}, "invalid setting watchdog.timeout_s"),
        ({"watchdog": {"signal": "SIGNOPE"}}, {}, "invalid setting watchdog.signal"),
        ({"health": {"unhealthy_after": 0}}, {}, "invalid setting health.unhealthy_after"),
        ({"bogus": 1}, {}, "invalid setting bogus: unknown key"),
        ({"target": {"pids": ["x"]}}, {}, "invalid setting target.pids.0"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, cli: dict, env: dict, message: str
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as info:
        load_settings(cli)
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(message)


def test_bad_toml_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_settings(config_file=tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="invalid config file .*bad.toml"):
        load_settings(config_file=_toml(tmp_path, "[watchdog\n").rename(tmp_path / "bad.toml"))
    with pytest.raises(ConfigError, match="invalid setting watchdog.timeout_s in .*: Input should be a valid number"):
        load_settings(config_file=_toml(tmp_path, "[watchdog]\ntimeout_s = 'x'\n"))


def test_hard_targets_and_flight_recorder_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    s = load_settings()
    assert s.watchdog.hard_targets == "culprit" and s.flightrec.enabled and s.flightrec.buffer_size == 2000
    monkeypatch.setenv("SERVEWATCH_WATCHDOG__HARD_TARGETS", "all")
    monkeypatch.setenv("SERVEWATCH_FLIGHTREC__TIMEOUT_S", "0.5")
    s = load_settings()
    assert s.watchdog.hard_targets == "all" and s.flightrec.timeout_s == 0.5
    with pytest.raises(ConfigError) as exc:
        load_settings({"watchdog": {"hard_targets": "everyone"}})
    assert "hard_targets" in str(exc.value)


def test_env_names_cover_every_setting_and_its_table() -> None:
    from agent.runtime.settings import env_names

    names = env_names()
    assert names["SERVEWATCH_DATA_DIR"] == "data_dir"
    assert names["SERVEWATCH_HEALTH"] == "health"
    assert names["SERVEWATCH_WATCHDOG__TIMEOUT_S"] == "watchdog.timeout_s"
    for table, field in Settings.model_fields.items():
        assert f"SERVEWATCH_{table.upper()}" in names
        model = field.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            assert {f"{table}.{f}" for f in model.model_fields} <= set(names.values())


def test_unknown_servewatch_variables_are_named_with_the_closest_valid_name() -> None:
    from agent.runtime.settings import unknown_env_warnings

    env = {
        "SERVEWATCH_HEALTH__URLL": "http://x/health",  # typo of a setting
        "SERVEWATCH_SPAN_FALBACK": "1",  # typo of an SDK variable
        "SERVEWATCH_ZZZQQQ": "1",  # nothing close
        "servewatch_data_dir": "d",  # known, in lower case (Settings reads it so)
        "SERVEWATCH_SHM_DIR": "/dev/shm",  # the SDK's
        "SERVEWATCH_HEALTH": "{}",  # a whole table as JSON
        "OTHER_HEALTH__URLL": "x",
    }
    assert unknown_env_warnings(env) == [
        "unknown variable SERVEWATCH_HEALTH__URLL is ignored (did you mean SERVEWATCH_HEALTH__URL?)",
        "unknown variable SERVEWATCH_SPAN_FALBACK is ignored (did you mean SERVEWATCH_SPAN_FALLBACK?)",
        "unknown variable SERVEWATCH_ZZZQQQ is ignored (see the settings reference in docs/settings.md)",
    ]
    assert unknown_env_warnings({"SERVEWATCH_WATCHDOG__TIMEOUT_S": "3", "PATH": "/bin"}) == []


def test_unknown_toml_key_names_the_closest_valid_key(tmp_path: Path) -> None:
    cfg = _toml(tmp_path, "data_dirr = \"d\"\n[watchdog]\ntimeout_ss = 3\n[fleet]\njob = \"j\"\n")
    with pytest.raises(ConfigError) as info:
        load_settings(config_file=cfg)
    assert str(info.value) == (
        f"invalid setting data_dirr in {cfg}: unknown key (did you mean data_dir?);"
        f" watchdog.timeout_ss in {cfg}: unknown key (did you mean watchdog.timeout_s?)"
    )


SETTINGS_DOC = Path(__file__).resolve().parent.parent / "docs" / "settings.md"


def test_settings_doc_is_the_generated_reference() -> None:
    from agent.runtime.settings import settings_reference

    text = SETTINGS_DOC.read_text(encoding="utf-8")
    start, end = "<!-- settings-reference:start -->\n", "<!-- settings-reference:end -->"
    assert start in text and end in text
    block = text.split(start, 1)[1].split(end, 1)[0]
    assert block == settings_reference(), "docs/settings.md is stale: paste `python -m agent.runtime.settings --reference` between the markers"


def test_settings_doc_names_every_setting_and_its_environment_variable() -> None:
    from agent.runtime.settings import env_names

    text = SETTINGS_DOC.read_text(encoding="utf-8")
    tables = {dotted.rpartition(".")[0] for dotted in env_names().values()}
    for env, dotted in env_names().items():
        if dotted in tables:  # a table (SERVEWATCH_HEALTH='{...}'), not a setting
            continue
        assert f"`{dotted}`" in text and f"`{env}`" in text, dotted


#: Given values as a one-shot `dump` passes them (its flags), valid and not.
_DUMP_VALUES = [
    {},
    {"data_dir": "d1", "target": {"pids": [41, 7]}, "export": {"endpoint": "http://127.0.0.1:4318", "protocol": "http/protobuf"}},
    {"target": {"pids": [3], "any_uid": True}, "metrics": {"url": "http://127.0.0.1:30000/metrics", "metrics_preset": "sglang"}},
    {"host_name": "h1", "export": {"protocol": "grpc"}},
]
_DUMP_BAD_VALUES = [
    {"target": {"pids": ["x"]}},
    {"host_name": "../etc"},
    {"export": {"protocol": "ftp"}},
    {"metrics": {"metrics_preset": "nope"}},
    {"no_such_table": {"x": 1}},
]


@pytest.mark.parametrize("cli", _DUMP_VALUES)
def test_lean_settings_are_the_sourced_settings(cli: dict) -> None:
    """With no --config and no SERVEWATCH_* setting, `load_settings(lean=True)` (the one-shot dump)
    validates on the plain pydantic base, without the settings sources, to the same values."""
    from pydantic_settings import BaseSettings

    lean, sourced = load_settings(cli, lean=True), load_settings(cli)
    assert not isinstance(lean, BaseSettings) and isinstance(sourced, BaseSettings)
    assert lean.model_dump() == sourced.model_dump()
    assert lean.agent_values() == sourced.agent_values()
    assert lean.component_tables == sourced.component_tables and list(type(lean).model_fields) == list(Settings.model_fields)


@pytest.mark.parametrize("cli", _DUMP_BAD_VALUES)
def test_lean_settings_say_what_the_sourced_settings_say(cli: dict) -> None:
    with pytest.raises(ConfigError) as sourced:
        load_settings(cli)
    with pytest.raises(ConfigError) as lean:
        load_settings(cli, lean=True)
    assert str(lean.value) == str(sourced.value)


def test_lean_settings_read_the_sources_when_one_could_matter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SERVEWATCH_* variable of a setting, or a --config file, is read as always (the lean base is
    only for values given in full); an SDK variable (SERVEWATCH_SHM_DIR) is no setting."""
    from pydantic_settings import BaseSettings

    monkeypatch.setenv("SERVEWATCH_SHM_DIR", str(tmp_path))
    assert not isinstance(load_settings({}, lean=True), BaseSettings)
    monkeypatch.setenv("servewatch_watchdog__timeout_s", "7")
    s = load_settings({}, lean=True)
    assert isinstance(s, BaseSettings) and s.watchdog.timeout_s == 7.0
    monkeypatch.delenv("servewatch_watchdog__timeout_s")
    monkeypatch.setenv("SERVEWATCH_DATA_DIR", "from-env")
    assert load_settings({}, lean=True).data_dir == Path("from-env")
    monkeypatch.delenv("SERVEWATCH_DATA_DIR")
    s = load_settings({}, config_file=_toml(tmp_path, "[watchdog]\ntimeout_s = 9\n"), lean=True)
    assert isinstance(s, BaseSettings) and s.watchdog.timeout_s == 9.0
