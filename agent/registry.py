"""Component registries: one per kind (watchers, actors, exporters), name -> (settings, factory).

Owns :class:`Registry`, :class:`Factory`, :class:`BuildContext` and
:class:`UnknownComponentError`. After the OpenTelemetry Collector's component factories: each
component is registered once, in its own folder's ``__init__`` (``agent/watchers``,
``agent/actors``, ``exporters``), by one line naming

* ``name``: the component's ``lower_snake_case`` name (``pyspy``, ``cuda_coredump``, ``health``);
* ``settings``: the :class:`~agent.config.Settings` fields it reads, as dotted paths (a table
  such as ``"pyspy"`` covers every field in it; ``"watchdog.timeout_s"`` one field);
* ``factory``: ``"package.module:function"``, imported only when the component is built, so
  ``servewatch --help`` and ``dump`` never import a component they do not run.

A factory is ``create(settings: Settings, ctx: BuildContext) -> component | None`` (``None``: the
settings turn it off, e.g. ``coredump.enabled = false``). :meth:`agent.runtime.Agent.build` is the
one wiring path (``run``, ``dump``, ``launch`` and ``profile``): it builds every registered
component of each kind, in registration order.

Adding a component is its module plus one line, e.g. in ``agent/actors/__init__.py``::

    ACTORS.register("my_actor", settings=("my_actor",), factory="agent.actors.my_actor:create")

(plus its settings model as a field of :class:`~agent.config.Settings` when it has settings).

Imports only the standard library (the registries are read by the CLI at start-up).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from agent.errors import UnknownComponentError

if TYPE_CHECKING:
    # re-exported for the factories' annotations: components never import agent.config (layers)
    from agent.config import Settings
    from agent.targets import Target

__all__ = [
    "AGENT_SETTINGS",
    "BuildContext",
    "Factory",
    "Kind",
    "Registry",
    "UnknownComponentError",
    "registries",
]

#: The kinds of component.
Kind = Literal["watcher", "actor", "exporter"]

#: Settings the agent itself reads (not a component's): where bundles go, which processes are
#: targets, the incident logic, hard mode, the agent API and the job's peers, and the Flight
#: Recorder buffer ``launch`` gives the server (``TORCH_NCCL_TRACE_BUFFER_SIZE``).
AGENT_SETTINGS: tuple[str, ...] = (
    "data_dir",
    "host_name",
    "target",
    "incident",
    "watchdog.hard",
    "watchdog.hard_targets",
    "watchdog.signal",
    "api",
    "fleet",
    "flightrec.buffer_size",
)

T = TypeVar("T")


def _no_stall(targets: Sequence[Target]) -> bool:
    return False


@dataclass(frozen=True, slots=True)
class BuildContext:
    """What a factory gets besides the settings: the running agent's own wiring.

    Attributes:
        children: processes the agent launched (``servewatch launch``): watched for exit with
            the status read from the ``Popen``.
        stalled: ``stalled(targets)`` is true when a target's SDK counter says busy with no step
            for ``watchdog.timeout_s`` (the profiler skips a profile that could never finish).
        on_status_change: called with each watcher status change (the CLI prints it); ``None``:
            nobody prints them, so the status board logs a watcher turning blind.
        telemetry: the span/metric pipeline (:class:`exporters.provider.Telemetry`) once built
            (or the caller's own); exporters built after it (mirror, span shipper) attach to it.
        stage: ``build`` (with the agent) or ``start`` (when it runs or dumps): an exporter
            returns ``None`` at the stage that is not its own.
        one_shot: a one-shot incident (``servewatch dump``), not a running agent.
    """

    children: Sequence[Any] = ()
    stalled: Callable[[Sequence[Target]], bool] = _no_stall
    on_status_change: Callable[[Any], None] | None = None
    telemetry: Any = None
    stage: Literal["build", "start"] = "build"
    one_shot: bool = False


@dataclass(frozen=True, slots=True)
class Factory(Generic[T]):
    """One registered component: its name, the settings it reads and how to build it."""

    kind: Kind
    name: str
    #: dotted paths of the :class:`~agent.config.Settings` fields it reads
    settings: tuple[str, ...]
    #: ``"package.module:function"``, imported on :meth:`create`
    factory: str
    _resolved: list[Callable[..., T | None]] = field(default_factory=list, compare=False, repr=False)

    @property
    def module(self) -> str:
        """The component's module (imported only when built)."""
        return self.factory.partition(":")[0]

    def load(self) -> Callable[[Settings, BuildContext], T | None]:
        """Import the factory function.

        Raises:
            ImportError: the module is missing; AttributeError: it has no such function.
        """
        if not self._resolved:
            module, _, attr = self.factory.partition(":")
            self._resolved.append(getattr(importlib.import_module(module), attr))
        return self._resolved[0]

    def create(self, settings: Settings, ctx: BuildContext | None = None) -> T | None:
        """Build the component from ``settings``; ``None`` when the settings turn it off."""
        return self.load()(settings, ctx or BuildContext())


class Registry(Generic[T]):
    """Components of one kind, by name, in registration order.

    Args:
        kind: ``watcher``, ``actor`` or ``exporter`` (used in error messages).
    """

    def __init__(self, kind: Kind) -> None:
        self.kind: Kind = kind
        self._factories: dict[str, Factory[T]] = {}

    def register(self, name: str, *, settings: Sequence[str] = (), factory: str) -> Factory[T]:
        """Register a component (one line per component, in its folder's ``__init__``).

        Args:
            name: ``lower_snake_case`` component name, unique within the kind.
            settings: dotted :class:`~agent.config.Settings` paths it reads (``"pyspy"``,
                ``"watchdog.timeout_s"``).
            factory: ``"package.module:function"``; the function takes ``(settings, ctx)`` and
                returns the component or ``None``.

        Raises:
            ValueError: the name is taken, not ``lower_snake_case``, or ``factory`` has no ``:``.
        """
        if name in self._factories:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        if not name.replace("_", "a").isalnum() or not name.islower() or not name[0].isalpha():
            raise ValueError(f"{self.kind} name {name!r} is not lower_snake_case")
        module, sep, attr = factory.partition(":")
        if not (module and sep and attr):
            raise ValueError(f"{self.kind} {name!r}: factory {factory!r} is not 'package.module:function'")
        entry: Factory[T] = Factory(self.kind, name, tuple(settings), factory)
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

    def __iter__(self) -> Iterator[Factory[T]]:
        return iter(list(self._factories.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def __len__(self) -> int:
        return len(self._factories)

    def build(self, settings: Settings, ctx: BuildContext | None = None) -> dict[str, T]:
        """Build every registered component (registration order); those turned off are left out.

        Returns:
            name -> component, for the components whose factory returned one.
        """
        built: dict[str, T] = {}
        for entry in self:
            component = entry.create(settings, ctx)
            if component is not None:
                built[entry.name] = component
        return built


def registries() -> dict[Kind, Registry[Any]]:
    """The three registries, each with every component registered (imports only the light
    package ``__init__`` modules, never a component)."""
    from agent.actors import ACTORS
    from agent.watchers import WATCHERS
    from exporters import EXPORTERS

    return {"watcher": WATCHERS, "actor": ACTORS, "exporter": EXPORTERS}
