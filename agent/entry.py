"""The ``servewatch`` console script.

Starts the early py-spy runs of a one-shot ``servewatch dump --pid ...`` (:mod:`agent.early`,
standard library only) before importing the command line (:mod:`agent.cli`: typer, settings,
the agent), then runs it. Unclaimed early runs are killed and reaped however the command ends.
A one-shot command (:data:`ONE_SHOT_COMMANDS`) turns the cyclic garbage collector off before
those imports. This module imports the standard library and :mod:`agent.early` only.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Sequence

from agent import early

__all__ = ["ONE_SHOT_COMMANDS", "main", "one_shot"]

#: Commands that end within seconds on their own (and the bare ``--help`` / ``--version``). They
#: run with the cyclic garbage collector off, from before their imports: start-up imports build
#: ~10^5 long-lived objects, and each collection would only walk them again; what such a command
#: leaves is bounded and freed at exit. They also end with :func:`agent.cli._exit_now`, skipping
#: the interpreter's module teardown (tens of ms of freeing the same objects). ``run``,
#: ``launch``, ``demo``, ``profile`` and ``export`` keep the collector and the normal exit.
ONE_SHOT_COMMANDS = frozenset({"dump", "status", "timeline", "report", "cuda-env"})


def one_shot(args: Sequence[str]) -> bool:
    """Whether ``args`` (argv without the program) name a one-shot command or no command."""
    command = next((a for a in args if not a.startswith("-")), None)
    return command is None or command in ONE_SHOT_COMMANDS


def main() -> None:
    """Console-script entry point (see :func:`agent.cli.main` for exit codes)."""
    args = sys.argv[1:]
    if one_shot(args):
        gc.disable()  # before the imports (see ONE_SHOT_COMMANDS)
    early.start(args)
    try:
        from agent.cli import main as cli_main

        cli_main()
    finally:
        early.discard_all()


if __name__ == "__main__":  # pragma: no cover
    main()
