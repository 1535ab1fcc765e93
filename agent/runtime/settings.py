"""Settings: CLI > ``SERVEWATCH_*`` environment > TOML file (``--config``) > defaults.

Owns :class:`AgentSettings` (the agent's own tables: where data goes, which processes are targets,
the stall and start-up rules, the incident logic, the API and the job's peers, the telemetry
export and the SDK span shipping),
:func:`settings_model` (the whole settings: the agent's tables plus one table per registered
component's settings model,
assembled from the registries, :mod:`agent.host.registry`), :func:`registries` (:class:`Registries`) and :func:`load_settings`,
which merges the sources and turns any invalid value into one :class:`ConfigError` line naming
the setting. Telemetry uses the standard ``OTEL_*`` variables (read by :mod:`exporters.otlp.provider`),
not ``SERVEWATCH_*`` ones.

Environment names: ``SERVEWATCH_<FIELD>`` for top-level fields and
``SERVEWATCH_<SECTION>__<FIELD>`` for nested ones, e.g. ``SERVEWATCH_DATA_DIR``,
``SERVEWATCH_HEALTH__URL``, ``SERVEWATCH_WATCHDOG__TIMEOUT_S``. The TOML file uses the same
names: top-level keys plus ``[health]``, ``[watchdog]``, ... tables.

Imports the registries (the light package ``__init__`` of each kind) and the agent's own settings
models (:mod:`agent.host.config`: watchdog, startup; :mod:`agent.incidents.config`,
:mod:`agent.fleet.config`, :mod:`exporters.config`); a component's settings model is imported by the path its registration
line names, never a component module.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import socket
import sys
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from agent.errors import ConfigError
from agent.fleet.config import ApiConfig, FleetConfig, check_fleet_settings
from agent.host.config import StartupConfig, TargetConfig, WatchdogConfig
from agent.host.fsutil import ensure_private_dir
from agent.host.registry import AgentValues, Kind, Registry
from agent.host.security import unsafe_dir_reason, validate_host_name
from agent.incidents.config import IncidentConfig
from agent.model.datadir import DataDir
from agent.runtime.location import DEFAULT_DATA_DIR, ENV_DATA_DIR, ENV_PREFIX
from exporters.config import ExportConfig, SpansConfig

if TYPE_CHECKING:
    from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

    from agent.actors import Actor
    from agent.watchers import TargetWatchers, Watcher
    from exporters import Exporter
    from exporters.otlp.provider import Destination

__all__ = [
    "ENV_DATA_DIR",
    "ENV_PREFIX",
    "AgentSettings",
    "AgentSettingsBase",
    "ConfigError",
    "Registries",
    "Settings",
    "TargetConfig",
    "check_data_dir",
    "env_names",
    "load_settings",
    "registries",
    "settings_model",
    "settings_reference",
    "unknown_env_warnings",
]



#: :class:`AgentValues` fields that collect every providing table's value (a tuple)
_COLLECTED_VALUES = frozenset(f.name for f in dataclasses.fields(AgentValues) if isinstance(f.default, tuple))


class AgentSettingsBase(BaseModel):
    """The agent's own settings; :func:`settings_model` adds one table per registered component
    (see the module docstring for sources and names). This is the model on a plain pydantic
    base: :class:`AgentSettings` adds the ``SERVEWATCH_*`` and TOML sources (pydantic-settings,
    imported with it); ``load_settings(lean=True)`` validates on this base when no source but the
    given values could matter (no ``--config``, no ``SERVEWATCH_*`` variable), as a one-shot
    ``dump`` does: the same fields, validators, defaults and messages, without pydantic-settings.

    A component's settings model may define ``with_agent_values(values) -> model`` (a default
    that depends on an agent-wide value, e.g. ``coredump.folder`` under ``data_dir``) and
    ``provides``, a mapping of :class:`~agent.host.registry.AgentValues` fields to its own fields
    (``{"sdk_socket_dir": "socket_dir"}``: the agent-wide value is set in that table; a tuple
    value such as ``server_urls`` collects every table's, unset ones left out).
    """

    #: what BaseSettings' own configuration sets for validation (AgentSettings keeps the same)
    model_config = ConfigDict(extra="forbid", validate_default=True, arbitrary_types_allowed=True)

    #: the tables of the registered components (set on the assembled model)
    component_tables: ClassVar[tuple[str, ...]] = ()

    data_dir: Path = Field(DEFAULT_DATA_DIR, description="bundles and embedded-default span files")
    host_name: str = Field(
        default_factory=socket.gethostname, description="host.name on spans and bundle paths",
        json_schema_extra={"shown_default": "this machine's host name"},
    )
    target: TargetConfig = Field(default_factory=TargetConfig)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    incident: IncidentConfig = Field(default_factory=IncidentConfig)
    api: ApiConfig = Field(default_factory=ApiConfig)
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    startup: StartupConfig = Field(default_factory=StartupConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    spans: SpansConfig = Field(default_factory=SpansConfig)

    if TYPE_CHECKING:  # a registered component's table, by its name (settings.pyspy)
        def __getattr__(self, name: str) -> Any: ...

    @model_validator(mode="after")
    def _fleet_consistent(self) -> AgentSettingsBase:
        problems = check_fleet_settings(self.api, self.fleet)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @field_validator("host_name")
    @classmethod
    def _host_name_is_one_path_component(cls, value: str) -> str:
        # bundles and span files go to <data_dir>/<host_name>/: never "..", "a/b" or escapes
        return validate_host_name(value)

    @model_validator(mode="after")
    def _defaults_from_agent_values(self) -> AgentSettingsBase:
        # e.g. core files go beside the bundles unless a folder was given explicitly
        values = self.agent_values()
        for table in self.component_tables:
            resolve = getattr(getattr(self, table), "with_agent_values", None)
            if resolve is not None:
                setattr(self, table, resolve(values))
        return self

    @property
    def layout(self) -> DataDir:
        """Every path under ``data_dir`` for ``host_name`` (:class:`agent.model.datadir.DataDir`)."""
        return DataDir(self.data_dir, self.host_name)

    @functools.cached_property
    def export_destination(self) -> Destination:
        """Where the agent's spans go (:class:`exporters.otlp.provider.Destination`): ``[export]``
        over ``OTEL_EXPORTER_OTLP_*`` over the defaults, resolved from the environment once, at
        first use; the CLI's check, the span pipeline and ``profile``'s export decision all read
        this one value.

        Raises:
            ExportConfigError: a bad setting or env variable (the message names it).
        """
        from exporters.otlp.provider import resolve_destination

        return resolve_destination(self.export)

    def table(self, name: str) -> BaseModel:
        """A table by name (``"pyspy"``, ``"watchdog"``).

        Raises:
            AttributeError: no such table.
        """
        value = getattr(self, name)
        if not isinstance(value, BaseModel):
            raise AttributeError(f"{name!r} is a setting, not a table")
        return value

    def agent_values(self) -> AgentValues:
        """The agent-wide values components read besides their own table (:class:`AgentValues`)."""
        provided: dict[str, Any] = {}
        for table in self.component_tables:
            config = getattr(self, table)
            for value, field in getattr(type(config), "provides", {}).items():
                given = getattr(config, field)
                if value in _COLLECTED_VALUES:  # collected from every table
                    many = given if isinstance(given, tuple) else (given,) if given else ()  # several servers' URLs
                    provided[value] = (*provided.get(value, ()), *many)
                else:
                    provided[value] = given
        return AgentValues(
            data_dir=self.data_dir, host_name=self.host_name, watchdog=self.watchdog, target_uids=tuple(self.target.uids),
            **provided,
        )



def _sources(
    settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource, env_settings: PydanticBaseSettingsSource,
) -> tuple[PydanticBaseSettingsSource, ...]:
    """:class:`AgentSettings`' sources: the given values, ``SERVEWATCH_*``, the TOML file (``--config``)."""
    from pydantic_settings import TomlConfigSettingsSource

    sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
    toml_file = settings_cls.model_config.get("toml_file")
    if toml_file:
        sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
    return tuple(sources)


if TYPE_CHECKING:
    class AgentSettings(BaseSettings, AgentSettingsBase):  # type: ignore[misc]
        """:class:`AgentSettingsBase` read from the settings sources (see :func:`_agent_settings`)."""


@functools.cache
def _agent_settings() -> type[AgentSettings]:
    """:class:`AgentSettingsBase` read from ``SERVEWATCH_*`` and the TOML file (pydantic-settings):
    the module attribute ``AgentSettings``, made (and pydantic-settings imported) at first use."""
    from pydantic_settings import BaseSettings, SettingsConfigDict

    class AgentSettings(BaseSettings, AgentSettingsBase):
        __doc__ = AgentSettingsBase.__doc__
        model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid",
                                          validate_default=True)

        @classmethod
        def settings_customise_sources(cls, settings_cls: Any, init_settings: Any, env_settings: Any,
                                       dotenv_settings: Any, file_secret_settings: Any) -> tuple[Any, ...]:
            return _sources(settings_cls, init_settings, env_settings)

    AgentSettings.__qualname__ = "AgentSettings"  # the module attribute, as before
    made: Any = AgentSettings
    return made


class Registries(TypedDict):
    """The three registries by kind (:data:`agent.host.registry.Kind`), each typed with its
    kind's contract."""

    watcher: Registry[Watcher | TargetWatchers]
    actor: Registry[Actor]
    exporter: Registry[Exporter]


#: The kinds, in the registries' order (their tables' order in the settings).
KINDS: tuple[Kind, ...] = ("watcher", "actor", "exporter")


def registries() -> Registries:
    """The three registries, each with every component registered (imports only the light
    package ``__init__`` modules, never a component)."""
    from agent.actors import ACTORS
    from agent.watchers import WATCHERS
    from exporters import EXPORTERS

    return {"watcher": WATCHERS, "actor": ACTORS, "exporter": EXPORTERS}


#: assembled settings models, by the tables registered and the base (the same registrations, the same model)
_assembled: dict[tuple[bool, tuple[tuple[str, str, str], ...]], type[AgentSettingsBase]] = {}


def settings_model(*, lean: bool = False) -> type[AgentSettings]:
    """The whole settings model: :class:`AgentSettings` plus, for each registered component
    with a settings model, its table (registries' order: watchers, actors, exporters), each
    defaulting to the component's :meth:`~agent.host.registry.Factory.default_config`. The same
    registrations give the same model; a change (tests register components of their own) gives
    another. ``lean``: the same model on :class:`AgentSettingsBase` (no settings sources, no
    pydantic-settings), for values given in full (:func:`load_settings`).

    Raises:
        ValueError: two components (or a component and the agent) claim the same table.
    """
    regs = registries()
    entries = [(kind, entry) for kind in KINDS for entry in regs[kind]]
    key = (lean, tuple((e.table, e.config, f"{kind} {e.name!r}") for kind, e in entries if e.table and e.config))
    model = _assembled.get(key)
    if model is not None:
        return typing.cast("type[AgentSettings]", model)
    owners: dict[str, str] = {name: "the agent" for name in AgentSettingsBase.model_fields}
    tables: dict[str, Any] = {}
    for kind, entry in entries:
        if entry.table is None:
            continue
        if entry.table in owners:
            raise ValueError(f"{kind} {entry.name!r}: settings table {entry.table!r} is taken by {owners[entry.table]}")
        owners[entry.table] = f"{kind} {entry.name!r}"
        tables[entry.table] = (entry.config_model(), Field(default_factory=entry.default_config))
    base: type[AgentSettingsBase] = AgentSettingsBase if lean else _agent_settings()
    assembled: type[AgentSettingsBase] = create_model("Settings", __base__=base, __module__=__name__, **tables)
    assembled.component_tables = tuple(tables)
    _assembled[key] = assembled
    return typing.cast("type[AgentSettings]", assembled)


if TYPE_CHECKING:
    Settings = AgentSettings
else:
    def __getattr__(name: str) -> Any:
        if name == "Settings":  # the assembled model (see settings_model)
            return settings_model()
        if name == "AgentSettings":  # with the settings sources: pydantic-settings loads now
            return _agent_settings()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _drop_none(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            nested = _drop_none(value)
            if nested:
                out[key] = nested
        elif value is not None and value != [] and value != ():
            out[key] = value
    return out


def _unknown_key(dotted: str) -> str:
    """``watchdog.timeout_ss: unknown key (did you mean watchdog.timeout_s?)``."""
    parent, _, leaf = dotted.rpartition(".")
    siblings = [d.rpartition(".")[2] for d in env_names().values() if d.rpartition(".")[0] == parent]
    close = _closest(leaf, siblings)
    return f"{dotted}: unknown key" + (f" (did you mean {parent + '.' if parent else ''}{close}?)" if close else "")


def _unknown_keys(table: Mapping[str, Any], prefix: str = "") -> list[str]:
    """One :func:`_unknown_key` line per key of a TOML document that is not a setting."""
    known = set(env_names().values())
    tables = {d.rpartition(".")[0] for d in known}
    problems = []
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if dotted not in known:
            problems.append(_unknown_key(dotted))
        elif isinstance(value, Mapping) and dotted in tables:
            problems.extend(_unknown_keys(value, f"{dotted}."))
    return problems


#: A message that already quotes the value it got (``expected HOST:PORT, got 'x'``).
_SAYS_GOT = re.compile(r"\bgot\b")

#: A setting's dotted name (``api.token_file``).
_DOTTED = re.compile(r"[a-z_]+(?:\.[a-z_]+)*")

#: ``flag_for(dotted_key, value)``: the command-line flag that gave a setting this value, or None.
FlagFor = Callable[[str, Any], "str | None"]


def _given(overrides: Mapping[str, Any], loc: tuple[Any, ...]) -> tuple[str, Any] | None:
    """The dotted key and value of ``overrides`` (the command line's settings) on the path of an
    error's ``loc`` (``("target", "pids", 0)`` -> ``("target.pids", [0])``), or None when the
    command line did not set it."""
    node: Any = overrides
    keys: list[str] = []
    for part in loc:
        if not isinstance(node, Mapping) or not isinstance(part, str) or part not in node:
            break
        node = node[part]
        keys.append(part)
    if not keys or isinstance(node, Mapping):
        return None
    return ".".join(keys), node


def _format_error(
    err: ValidationError, overrides: Mapping[str, Any] | None = None, flag_for: FlagFor | None = None,
    config_file: Path | None = None,
) -> str:
    """``invalid setting KEY: what is wrong (got VALUE); KEY2: ...``, each value quoted once.

    A value the command line gave (``overrides``) is named by its flag when ``flag_for`` finds
    one: ``invalid value for --metrics-preset: ...``. A value from the environment names its
    variable too: ``invalid setting watchdog.signal from SERVEWATCH_WATCHDOG__SIGNAL: ...``, and
    one from the TOML file ``config_file`` names the file: ``watchdog.signal in ./sw.toml: ...``.
    A model-wide check (no key of its own) names its keys in its message: it is shown as it is.
    """
    settings_parts: list[str] = []
    flag_parts: list[str] = []
    env_of = {dotted: env for env, dotted in env_names().items()}
    overrides = overrides or {}
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        msg = str(e["msg"]).removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":  # a misspelt key: name the closest valid one
            settings_parts.append(_unknown_key(key))
            continue
        if not key:  # a model-wide check: "api.token_file: no such file '/x'; fleet.job: ..."
            _model_wide_parts(msg, overrides, flag_for, settings_parts, flag_parts)
            continue
        shown = _shown(key, e.get("input"), msg)
        given = _given(overrides, tuple(e["loc"]))
        flag = _flag_of(given, flag_for)
        if flag is not None:
            flag_parts.append(f"invalid value for {flag}: {msg}{shown}")
            continue
        source = "" if given is not None else _source(e["loc"], env_of, config_file)
        settings_parts.append(f"{key}{source}: {msg}{shown}")
    settings_line = "invalid setting " + "; ".join(settings_parts) if settings_parts else ""
    return "; ".join(p for p in (settings_line, *flag_parts) if p)


def _flag_of(given: tuple[str, Any] | None, flag_for: FlagFor | None) -> str | None:
    """The flag that gave ``given`` (a dotted key and its value), or None."""
    return flag_for(*given) if given is not None and flag_for is not None else None


def _shown(key: str, got: Any, msg: str) -> str:
    """`` (got VALUE)`` after an error's message, or "" where the message quotes the value already."""
    says_got = _SAYS_GOT.search(msg) or (isinstance(got, str) and (repr(got) in msg or repr(got.upper()) in msg))
    return "" if not key or isinstance(got, dict) or says_got else f" (got {got!r})"


def _source(loc: tuple[Any, ...], env_of: Mapping[str, str], config_file: Path | None) -> str:
    """Where a value the command line did not give came from: `` from ENV``, `` in FILE`` or ""."""
    field = ".".join(str(p) for p in loc if isinstance(p, str))
    env = env_of.get(field)
    if env and env.upper() in {k.upper() for k in os.environ}:
        return f" from {env}"
    if config_file is not None:  # not a flag, not the env, never a default
        return f" in {config_file}"
    return ""


def _model_wide_parts(
    msg: str, overrides: Mapping[str, Any], flag_for: FlagFor | None,
    settings_parts: list[str], flag_parts: list[str],
) -> None:
    """Append each problem of a model-wide check's ``msg`` to ``flag_parts`` when a flag gave its
    key, else to ``settings_parts``."""
    for problem in msg.split("; "):
        named, sep, what = problem.partition(": ")
        given = _given(overrides, tuple(named.split("."))) if sep and _DOTTED.fullmatch(named) else None
        flag = _flag_of(given, flag_for)
        (flag_parts if flag else settings_parts).append(f"invalid value for {flag}: {what}" if flag else problem)


def _env_json_error(exc: Exception) -> str:
    """One line for an env value that is not the JSON its list or table setting needs:
    ``invalid setting target.pids from SERVEWATCH_TARGET__PIDS: list values are JSON, e.g.
    SERVEWATCH_TARGET__PIDS='[1, 2]'`` (the example is made of the value given)."""
    import json

    environ = {k.upper(): v for k, v in os.environ.items()}
    for env, dotted in env_names().items():
        raw = environ.get(env)
        annotation, origin = _unwrapped_annotation(dotted)
        if raw is None or (origin not in (list, dict) and _model_of(annotation) is None):
            continue
        if _is_json(raw):
            continue
        if origin is list:
            items = [i.strip() for i in (raw or "").split(",") if i.strip()]
            example = json.dumps([int(i) if i.lstrip("-").isdigit() else i for i in items] or ["..."])
            return f"invalid setting {dotted} from {env}: list values are JSON, e.g. {env}='{example}'"
        return f"invalid setting {dotted} from {env}: table values are JSON, e.g. {env}='{{\"key\": \"value\"}}'"
    return "invalid setting: an environment value is not valid JSON for its list or table setting" + (
        f" ({str(exc).partition(' from source')[0].removeprefix('error parsing value for field ')})"
    )


def _unwrapped_annotation(dotted: str) -> tuple[Any, Any]:
    """A setting's annotation and its origin (``list``, ``dict``, ...), an optional one
    (``list[str] | None``) unwrapped to its one inner type."""
    annotation = _annotation_of(dotted)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):  # list[str] | None
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = inner[0] if len(inner) == 1 else annotation
        origin = typing.get_origin(annotation)
    return annotation, origin


def _is_json(raw: str) -> bool:
    """Whether ``raw`` parses as JSON."""
    import json

    try:
        json.loads(raw)
    except ValueError:
        return False
    return True


def _annotation_of(dotted: str) -> Any:
    """The type annotation of a setting by its dotted name (``target.pids`` -> ``list[PositiveInt]``)."""
    model: type[BaseModel] | None = settings_model()
    annotation: Any = None
    for part in dotted.split("."):
        if model is None or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        model = _model_of(annotation)
    return annotation


def load_settings(
    cli: dict[str, Any] | None = None, *, config_file: Path | None = None, flag_for: FlagFor | None = None,
    lean: bool = False,
) -> AgentSettings:
    """Merge CLI values (highest), ``SERVEWATCH_*`` env, the TOML file and defaults.

    Args:
        cli: nested dict of values given on the command line; ``None`` values and empty lists
            mean "not given" and are dropped.
        config_file: TOML file (``--config``); must exist when given.
        flag_for: names the flag that gave a ``cli`` value (``("metrics.metrics_preset", "foo")``
            -> ``"--metrics-preset"``), so that its error names the flag; None: name the setting.
        lean: with no ``config_file`` and no ``SERVEWATCH_*`` variable of a setting (nothing but
            ``cli`` and the defaults could matter), validate on :class:`AgentSettingsBase` without
            importing pydantic-settings (a one-shot ``dump``): the same values and messages.

    Raises:
        ConfigError: one line naming every invalid setting, or the unreadable config file.
    """
    overrides = _drop_none(cli or {})
    lean = lean and config_file is None and not _env_sets_any(settings_model(lean=True).model_fields)
    cls = settings_model(lean=lean)
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"invalid value for --config: no such file {str(path)!r}")
        if sys.version_info >= (3, 11):
            import tomllib
        else:
            import tomli as tomllib
        try:
            table = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"invalid config file {str(path)!r}: {exc}") from None
        unknown = [key.replace(": ", f" in {path}: ", 1) for key in _unknown_keys(table)]
        if unknown:  # nested tables ignore extra keys: a typo there would pass silently
            raise ConfigError("invalid setting " + "; ".join(unknown))
        cls = type("FileSettings", (cls,), {"model_config": {**cls.model_config, "toml_file": path}})
    env_errors: tuple[type[Exception], ...] = () if lean else _settings_errors()
    try:
        return cls(**overrides)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc, overrides, flag_for, config_file)) from None
    except env_errors as exc:  # an env value that is not valid JSON for a list/table field
        raise ConfigError(_env_json_error(exc)) from None


def _env_sets_any(fields: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> bool:
    """Whether a ``SERVEWATCH_*`` variable sets one of ``fields`` (top-level names) or a value in
    its table, as the settings' env source reads them (case-insensitive: ``SERVEWATCH_<FIELD>``,
    ``SERVEWATCH_<FIELD>__...``); the SDK's own variables (``SERVEWATCH_SHM_DIR``) set none."""
    names = tuple(f"{ENV_PREFIX}{name.upper()}" for name in fields)
    for key in os.environ if environ is None else environ:
        upper = key.upper()
        if upper.startswith(ENV_PREFIX) and any(upper == n or upper.startswith(n + "__") for n in names):
            return True
    return False


def _settings_errors() -> tuple[type[Exception], ...]:
    from pydantic_settings.exceptions import SettingsError

    return (SettingsError,)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (``HealthConfig``, ``HealthConfig | None``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [m for m in map(_model_of, typing.get_args(annotation)) if m is not None]
        return models[0] if len(models) == 1 else None
    return None


def env_names(model: type[BaseModel] | None = None, *, _env: str = ENV_PREFIX, _dotted: str = "") -> dict[str, str]:
    """Every environment variable the settings (``model``, default :func:`settings_model`) read,
    mapped to its dotted setting name.

    Returns:
        ``{"SERVEWATCH_DATA_DIR": "data_dir", "SERVEWATCH_HEALTH": "health",
        "SERVEWATCH_HEALTH__URL": "health.url", ...}``: a table's own name (a JSON object) and
        each of its fields, in declaration order.
    """
    names: dict[str, str] = {}
    for field_name, info in (model or settings_model(lean=True)).model_fields.items():  # the same fields
        env = f"{_env}{field_name.upper()}"
        names[env] = f"{_dotted}{field_name}"
        nested = _model_of(info.annotation)
        if nested is not None:
            names.update(env_names(nested, _env=env + "__", _dotted=f"{_dotted}{field_name}."))
    return names


def _closest(name: str, candidates: list[str]) -> str | None:
    """The candidate a misspelt ``name`` most likely meant, or None."""
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return close[0] if close else None


def _sdk_env_names() -> set[str]:
    """``SERVEWATCH_*`` variables read by the SDK inside a served process (not by the agent)."""
    from agent.sdk import channel, control, profiler
    from agent.sdk.counter import ENV_SHM_DIR

    return {
        ENV_SHM_DIR, channel.ENV_CHANNEL, channel.ENV_FALLBACK, channel.ENV_RING_BYTES,
        channel.ENV_STALE_S, control.ENV_PROFILE_ALLOWED_DIRS, profiler.ENV_PROFILE_DIR,
    }


def unknown_env_warnings(environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning line per ``SERVEWATCH_*`` variable that nothing reads (a typo, usually).

    Names are compared case-insensitively, as the settings read them. Variables of the SDK
    (read inside the served process) are known too. Only a variable that is not a setting name
    costs the SDK's import.

    Args:
        environ: the environment (default ``os.environ``).

    Returns:
        ``["unknown variable SERVEWATCH_HEALTH__URLL is ignored (did you mean SERVEWATCH_HEALTH__URL?)", ...]``,
        sorted by name; empty when every variable is known.
    """
    env = os.environ if environ is None else environ
    ours = [k for k in env if k.upper().startswith(ENV_PREFIX)]
    if not ours:  # the usual case: no names to compare, no walk of the settings model
        return []
    settings_names = env_names()
    given = sorted(k for k in ours if k.upper() not in settings_names)
    if not given:
        return []
    known = [*settings_names, *sorted(_sdk_env_names())]
    lines = []
    for name in given:
        if name.upper() in known:
            continue
        close = _closest(name.upper().removeprefix(ENV_PREFIX), [k.removeprefix(ENV_PREFIX) for k in known])
        hint = f"did you mean {ENV_PREFIX}{close}?" if close else "see the settings reference in docs/settings.md"
        lines.append(f"unknown variable {name} is ignored ({hint})")
    return lines


def check_data_dir(path: Path, *, setting: str = "data_dir") -> None:
    """Make sure the data dir exists (created 0700 if needed), is writable, and is safe.

    Safe (:func:`agent.host.security.unsafe_dir_reason`): it and every folder above it belong to us
    or root, and none can be changed by another local user (the sticky bit, as on ``/tmp``,
    is fine above it), so nobody can plant a symlink or swap a folder where root writes. The
    same check guards every other folder root writes into (``launch``'s crash-dump folder).

    Args:
        path: the folder.
        setting: the setting named in the error (``data_dir``, ``coredump.folder``).

    Raises:
        ConfigError: one line naming ``setting`` and the reason.
    """
    try:
        if not os.path.lexists(path):  # an existing one (a trusted symlink too) is judged below
            ensure_private_dir(path)
    except OSError as exc:
        raise ConfigError(f"invalid setting {setting}: {str(path)!r} is not a writable folder ({exc.strerror or exc})") from None
    problem = unsafe_dir_reason(path)
    if problem is None and not path.is_dir():
        problem = f"{str(path)!r} is not a folder"
    if problem is not None:
        raise ConfigError(f"invalid setting {setting}: unsafe folder: {problem}")
    try:
        probe = path / f".servewatch-write-test.{os.getpid()}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.close(fd)
        probe.unlink()
    except OSError as exc:
        why = exc.strerror or str(exc)
        if isinstance(exc, PermissionError):  # whose folder it is and what to do
            from agent.host.security import access_denied

            why = access_denied(probe) or f"{why}: {_owner_words(path)}"
        raise ConfigError(f"invalid setting {setting}: {str(path)!r} is not a writable folder ({why})") from None


def _owner_words(path: Path) -> str:
    """``owned by root (0755): run as root (sudo)`` for a folder this user may read but not write."""
    import pwd

    st = path.stat()
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = f"uid {st.st_uid}"
    fix = "run as root (sudo)" if owner == "root" else f"run as {owner} or root, or choose another --data-dir"
    return f"owned by {owner} ({st.st_mode & 0o7777:04o}): {fix}"


def _attribute_docs(model: type[BaseModel]) -> dict[str, str]:
    """``{field: first sentence}`` from the ``Attributes:`` sections of ``model``'s docstrings."""
    import inspect

    docs: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        text = inspect.getdoc(cls) or ""
        if "Attributes:" not in text:
            continue
        entries: list[tuple[list[str], list[str]]] = []
        for line in text.split("Attributes:", 1)[1].splitlines():
            if not line.strip():
                continue
            if not line.startswith(" "):
                break
            head = re.match(r"^ {4}([a-z_][a-z0-9_ /]*):\s*(.*)$", line)
            if head:
                entries.append(([n.strip() for n in head.group(1).split("/")], [head.group(2)]))
            elif entries:
                entries[-1][1].append(line.strip())
        for names, words in entries:
            sentence = re.split(r"(?<=[a-z0-9)\]`]\.)\s+(?=[A-Z])", " ".join(words), maxsplit=1)[0]
            for name in names:
                docs[name] = sentence
    return docs


def _shown_default(dotted: str, info: Any) -> str:
    # a default computed when the settings load, in words (the reference must not depend on the
    # machine): the field's json_schema_extra "shown_default"
    shown = info.json_schema_extra.get("shown_default") if isinstance(info.json_schema_extra, dict) else None
    if isinstance(shown, str):
        return shown
    if info.default_factory is not None and info.default_factory not in (list, dict, tuple):
        return "(computed)"
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    if isinstance(value, str) and not value:
        return '""'
    return str(value.value if hasattr(value, "value") else value)


def settings_reference() -> str:
    """The settings reference of docs/settings.md: one Markdown table row per setting.

    Columns: the TOML key (``table.key``), the ``SERVEWATCH_*`` variable, the default and what
    it does (the field's description, else the first sentence of its model's ``Attributes:``
    docs). ``python -m agent.runtime.settings --reference`` prints it; a test keeps docs/settings.md equal to it.

    Returns:
        The table, newline-terminated.
    """
    rows = ["| Setting | Environment variable | Default | Meaning |", "| --- | --- | --- | --- |"]

    def walk(model: type[BaseModel], env: str, dotted: str) -> None:
        docs = _attribute_docs(model)
        for name, info in model.model_fields.items():
            nested = _model_of(info.annotation)
            if nested is not None:
                walk(nested, f"{env}{name.upper()}__", f"{dotted}{name}.")
                continue
            meaning = info.description or docs.get(name) or f"see `{model.__module__}.{model.__name__}`"
            meaning = meaning.replace("``", "`").replace("|", "\\|")
            default = _shown_default(f"{dotted}{name}", info).replace("|", "\\|")
            rows.append(f"| `{dotted}{name}` | `{env}{name.upper()}` | `{default}` | {meaning} |")

    walk(settings_model(), ENV_PREFIX, "")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # pragma: no cover - debugging aid
    if sys.argv[1:] == ["--reference"]:
        print(settings_reference(), end="")
    else:
        print(load_settings(config_file=Path(sys.argv[1]) if len(sys.argv) > 1 else None).model_dump_json(indent=2))
