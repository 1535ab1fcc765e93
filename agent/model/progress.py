"""The explicit stream an incident phase reports its actions' results through, each the moment it
is done (not when the whole phase ends).

Owns :data:`ActionSink` and :func:`action_stream`. The incident manager opens one stream per phase
(:func:`action_stream`) and hands its sending end to the phase (an actor's ``run_phase``, or
:func:`agent.actors.act_all` for one action per target); it publishes each result it receives at
once (its span goes out, ``manifest.json`` can show it), and keeps the results sent before a
phase is cut by its time limit. Outside an incident (``servewatch profile``) nobody reports.

Imports only anyio, :mod:`agent.model.events` and the standard library, so actors and incidents can
both use it without importing each other.
"""

from __future__ import annotations

import math

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from agent.model.events import ActionResult

__all__ = ["ActionSink", "ActionSource", "action_stream"]

#: Where a phase sends each finished action's result (``await sink.send(result)``).
ActionSink = ObjectSendStream[ActionResult]
#: Where the incident manager receives them.
ActionSource = ObjectReceiveStream[ActionResult]


def action_stream() -> tuple[MemoryObjectSendStream[ActionResult], MemoryObjectReceiveStream[ActionResult]]:
    """A new stream for one phase: unbounded (a phase sends one result per action, and sending
    never waits on the bus); closing the sending end ends the receiving one once drained."""
    return anyio.create_memory_object_stream[ActionResult](math.inf)
