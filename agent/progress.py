"""Report each action's result the moment it finishes, not when its whole phase ends.

Owns :func:`report_action` and :func:`reporting_to`. The incident manager sets a reporter (a
context variable, so it follows the tasks a phase starts) while a phase runs; actors and
:func:`agent.actors.act_all` call :func:`report_action` with each result as it is done, and the
manager publishes it at once (its span goes out, ``manifest.json`` can show it). Outside an
incident (``servewatch profile``) reporting does nothing.

Imports only :mod:`agent.events` and the standard library, so actors and incidents can both use
it without importing each other.
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

from agent.events import ActionResult

__all__ = ["Reporter", "report_action", "reporting_to"]

#: Receives one finished action's result.
Reporter = Callable[[ActionResult], Awaitable[None]]

_reporter: contextvars.ContextVar[Reporter | None] = contextvars.ContextVar("servewatch_action_reporter", default=None)


async def report_action(result: ActionResult) -> None:
    """Hand ``result`` to the running incident now (no-op outside one)."""
    reporter = _reporter.get()
    if reporter is not None:
        await reporter(result)


@contextmanager
def reporting_to(reporter: Reporter) -> Iterator[None]:
    """Within the block (and tasks started in it), :func:`report_action` calls ``reporter``."""
    token = _reporter.set(reporter)
    try:
        yield
    finally:
        _reporter.reset(token)
