"""Component registries: one per kind (watchers, actors, exporters), name -> factory.

Owns :class:`Registry`, :class:`Factory`, :class:`BuildContext`, :class:`AgentValues` and
:class:`UnknownComponentError`. After the OpenTelemetry Collector's component factories
(``NewFactory(type, createDefaultConfig, createComponent)``): each component is registered once,
in its own folder's ``__init__`` (``agent/watchers``, ``agent/actors``, ``exporters``), by one
line naming

* ``name``: the component's ``lower_snake_case`` name (``pyspy``, ``cuda_coredump``, ``health``);
* ``config``: its settings model, ``"package.module:Class"`` (a light module: the settings load
  without importing the component), whose fields are the component's table of the settings
  (``[pyspy]``, ``SERVEWATCH_PYSPY__*``); the table is named ``table`` (default: ``name``).
  :meth:`Factory.default_config` is a new model of defaults each call. A model whose defaults
  leave its component off gives settings that turn it on as the first of its ``examples``
  (pydantic's ``model_config["json_schema_extra"]``; tests build every component from them). A
  component without settings names no ``config``;
* ``factory``: ``"package.module:function"``, imported only when the component is built, so
  ``servewatch --help`` and ``dump`` never import a component they do not run.

A factory is ``create(config, ctx: BuildContext) -> component | None``: ``config`` is the
component's own settings model (``None`` when it has none), ``ctx.agent`` the few agent-wide
values a component may read besides it (:class:`AgentValues`: data dir, host name and every path
under them, ``ctx.agent.layout``; the stall rule's timeout...), never another component's
table. It returns ``None`` when its settings turn it off (``coredump.enabled = false``). The
component is what its kind's Protocol says
(``agent.watchers.Watcher``, ``agent.actors.Actor``, ``exporters.Exporter``: the registry's type
argument); a registry made with a ``contract`` (a runtime-checkable Protocol) refuses anything
else. The settings (:func:`agent.runtime.settings.settings_model`) are assembled from the
registries, one table per registered ``config``; :meth:`agent.runtime.agent.Agent.build` builds
every registered component of each kind, in registration order.

Adding a component is its module plus one line, e.g. in ``agent/actors/__init__.py``::

    ACTORS.register("my_actor", config="agent.actors.my_actor:MyConfig", factory="agent.actors.my_actor:create")

Imports only the standard library and :mod:`agent.model.datadir` (stdlib only itself: the
registries are read by the CLI at start-up).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from agent.errors import UnknownComponentError
from agent.model.datadir import DataDir

if TYPE_CHECKING:
    from pydantic import BaseModel

    from agent.host.stall import WatchdogConfig
    from agent.host.targets import Target

__all__ = [
    "AgentValues",
    "BuildContext",
    "Factory",
    "Kind",
    "Registry",
    "UnknownComponentError",
]

#: The kinds of component.
Kind = Literal["watcher", "actor", "exporter"]

T = TypeVar("T")

def _no_stall(targets: Sequence[Target]) -> bool:
    return False


def _not_starting() -> str | None:
    return None


def _default_watchdog() -> WatchdogConfig:
    from agent.host.stall import WatchdogConfig  # pydantic and the bus's events: only when built

    return WatchdogConfig()


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentValues:
    """The agent-wide values a component may read besides its own settings (read from the agent's
    own tables when the settings load: :meth:`agent.runtime.settings.AgentSettings.agent_values`).

    Attributes:
        data_dir: where bundles, span files and the status file go (``data_dir``; their paths:
            :attr:`layout`).
        host_name: ``host.name`` of spans and bundle paths (``host_name``).
        watchdog: the stall rule's settings, the ``[watchdog]`` table as loaded (one object:
            ``timeout_s``, busy with no forward step for this long is a stall; ``poll_interval_s``,
            the longest wait between two readings; both seconds; hard mode's signal and targets).
        target_uids: the server's uids (``target.uids``; empty: derived from the targets).
        sdk_socket_dir: folder of the SDK's control sockets, ``None``: the SDK's shm folder (set by
            the table that provides it: ``profiler.socket_dir``).
        server_urls: the served process's URLs the agent probes (``health.url``, ``metrics.url``:
            the tables that provide one), so the verdict can tell the server's own processes.
    """

    data_dir: Path = Path("servewatch-data")
    host_name: str = "localhost"
    watchdog: WatchdogConfig = field(default_factory=_default_watchdog)
    target_uids: tuple[int, ...] = ()
    sdk_socket_dir: Path | None = None
    server_urls: tuple[str, ...] = ()

    @property
    def layout(self) -> DataDir:
        """Every path under ``data_dir`` for ``host_name`` (bundles, status file, spool, spans,
        own actions, launch records...): a component builds a data-dir path only through it."""
        return DataDir(self.data_dir, self.host_name)


@dataclass(frozen=True, slots=True)
class BuildContext:
    """What a factory gets besides its own settings: the agent-wide values and the running
    agent's own wiring.

    Attributes:
        agent: the agent-wide values (:class:`AgentValues`).
        children: processes the agent launched (``servewatch launch``): watched for exit with
            the status read from the ``Popen``.
        stalled: ``stalled(targets)`` is true while a target is stalled by the stall rule (the
            watchdog's last word on it, from the bus): the profiler skips a profile that could
            never finish.
        telemetry: the span/metric pipeline (:class:`exporters.otlp.provider.Telemetry`) the agent
            built when it started (or the caller's own), ``None`` before: exporters attach to it.
        stage: ``build`` (with the agent) or ``start`` (when it runs or dumps): an exporter
            returns ``None`` at the stage that is not its own.
        one_shot: a one-shot incident (``servewatch dump``), not a running agent.
        starting: ``starting()`` is one line on the server's ranks still in start-up (found
            starting, no first step yet: :meth:`agent.host.startup.StartupRule.starting`), ``None``
            when none is: what a watcher says of a port nothing listens on yet.
    """

    agent: AgentValues = field(default_factory=AgentValues)
    children: Sequence[Any] = ()
    stalled: Callable[[Sequence[Target]], bool] = _no_stall
    telemetry: Any = None
    stage: Literal["build", "start"] = "build"
    one_shot: bool = False
    starting: Callable[[], str | None] = _not_starting


def _import(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _check_path(kind: str, name: str, what: str, path: str) -> None:
    module, sep, attr = path.partition(":")
    if not (module and sep and attr):
        raise ValueError(f"{kind} {name!r}: {what} {path!r} is not 'package.module:{'Class' if what == 'config' else 'function'}'")


def _check_name(kind: str, what: str, name: str) -> None:
    if not name or not name.replace("_", "a").isalnum() or not name.islower() or not name[0].isalpha():
        raise ValueError(f"{kind} {what} {name!r} is not lower_snake_case")


@dataclass(frozen=True, slots=True)
class Factory(Generic[T]):
    """One registered component: its name, its settings model and how to build it."""

    kind: Kind
    name: str
    #: ``"package.module:function"``, imported on :meth:`create`
    factory: str
    #: ``"package.module:Class"`` of its settings model, or ``None`` (no settings)
    config: str | None = None
    #: its table of the settings (``None`` without ``config``)
    table: str | None = None
    #: what the component must be (a runtime-checkable Protocol), ``None``: not checked
    contract: type[Any] | None = field(default=None, compare=False, repr=False)
    _resolved: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def module(self) -> str:
        """The component's module (imported only when built)."""
        return self.factory.partition(":")[0]

    def _get(self, what: str, path: str) -> Any:
        if what not in self._resolved:
            self._resolved[what] = _import(path)
        return self._resolved[what]

    def config_model(self) -> type[BaseModel] | None:
        """Its settings model (imports the light config module only), ``None`` without one.

        Raises:
            ImportError / AttributeError: the ``config`` path names no class.
        """
        return None if self.config is None else self._get("config", self.config)

    def default_config(self) -> BaseModel | None:
        """A new settings model of defaults (``None`` without settings)."""
        model = self.config_model()
        return None if model is None else model()

    def config_of(self, settings: Any) -> Any:
        """Its table of ``settings`` (an assembled settings object), ``None`` without one."""
        return None if self.table is None else getattr(settings, self.table)

    def load(self) -> Callable[[Any, BuildContext], T | None]:
        """Import the factory function.

        Raises:
            ImportError: the module is missing; AttributeError: it has no such function.
        """
        return self._get("factory", self.factory)

    def create(self, config: Any, ctx: BuildContext | None = None) -> T | None:
        """Build the component from its ``config``; ``None`` when that turns it off.

        Raises:
            TypeError: the factory returned something that is not the registry's ``contract``.
        """
        component = self.load()(config, ctx or BuildContext())
        if component is not None and self.contract is not None and not isinstance(component, self.contract):
            raise TypeError(f"{self.kind} {self.name!r}: {self.factory} returned a {type(component).__name__},"
                            f" which lacks the members of {self.contract.__module__}.{self.contract.__name__}")
        return component

    def build(self, settings: Any, ctx: BuildContext | None = None) -> T | None:
        """Build the component from its table of ``settings`` (see :meth:`create`)."""
        return self.create(self.config_of(settings), ctx)


class Registry(Generic[T]):
    """Components of one kind, by name, in registration order.

    Args:
        kind: ``watcher``, ``actor`` or ``exporter`` (used in error messages).
        contract: what every component must be, a runtime-checkable Protocol
            (``exporters.Exporter``); a factory returning anything else is refused when it is
            built. ``None``: the type argument alone says it (checked by mypy).
    """

    def __init__(self, kind: Kind, *, contract: type[Any] | None = None) -> None:
        self.kind: Kind = kind
        self.contract = contract
        self._factories: dict[str, Factory[T]] = {}

    def register(self, name: str, *, factory: str, config: str | None = None, table: str | None = None) -> Factory[T]:
        """Register a component (one line per component, in its folder's ``__init__``).

        Args:
            name: ``lower_snake_case`` component name, unique within the kind.
            factory: ``"package.module:function"``; the function takes ``(config, ctx)`` and
                returns the component or ``None``.
            config: ``"package.module:Class"``, the component's settings model (its table of
                the settings); ``None``: it has no settings.
            table: the table's name (``lower_snake_case``; default ``name``), e.g. ``coredump``
                for ``cuda_coredump``.

        Raises:
            ValueError: the name is taken or not ``lower_snake_case``, ``factory`` or ``config``
                has no ``:``, or a ``table`` is given without a ``config``.
        """
        if name in self._factories:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        _check_name(self.kind, "name", name)
        _check_path(self.kind, name, "factory", factory)
        if config is not None:
            _check_path(self.kind, name, "config", config)
            table = table or name
            _check_name(self.kind, "settings table", table)
        elif table is not None:
            raise ValueError(f"{self.kind} {name!r}: a settings table needs a config model")
        entry: Factory[T] = Factory(self.kind, name, factory, config, table, self.contract)
        self._factories[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Remove a component (tests registering a fake one clean up with this).

        Raises:
            UnknownComponentError: no such name.
        """
        self.get(name)
        del self._factories[name]

    def get(self, name: str) -> Factory[T]:
        """The component registered as ``name``.

        Raises:
            UnknownComponentError: no such name (its message lists the known ones).
        """
        try:
            return self._factories[name]
        except KeyError:
            raise UnknownComponentError(self.kind, name, list(self._factories)) from None

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        return list(self._factories)

    def tables(self) -> Mapping[str, Factory[T]]:
        """Settings table -> the component that owns it, in registration order."""
        return {e.table: e for e in self._factories.values() if e.table is not None}

    def __iter__(self) -> Iterator[Factory[T]]:
        return iter(list(self._factories.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def __len__(self) -> int:
        return len(self._factories)

    def build(self, settings: Any, ctx: BuildContext | None = None) -> dict[str, T]:
        """Build every registered component (registration order) from its table of ``settings``;
        those turned off are left out.

        Returns:
            name -> component, for the components whose factory returned one.
        """
        built: dict[str, T] = {}
        for entry in self:
            component = entry.build(settings, ctx)
            if component is not None:
                built[entry.name] = component
        return built
