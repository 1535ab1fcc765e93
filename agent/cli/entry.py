"""The ``servewatch`` console script.

Starts the early py-spy runs of a one-shot ``servewatch dump --pid ...`` (:mod:`agent.early`,
standard library only) before importing the command line (:mod:`agent.cli.app`: typer, settings,
the agent), then runs it. The plain form ``servewatch dump --pid N ...``
(:func:`agent.cli.common.plain_dump_args`) runs without typer (:func:`agent.cli.common.run_plain_dump`):
the CLI framework is never imported to dump stacks; so does the plain ``servewatch export ...``
(:func:`agent.cli.common.plain_export_args`, e.g. ``export --dry-run --to URL``). Unclaimed early runs are killed and reaped
however the command ends. A one-shot command (:data:`~agent.early.ONE_SHOT_COMMANDS`) turns the
cyclic garbage collector off before those imports. This module imports the standard library,
:mod:`agent.early` and :mod:`agent.cli.common` (standard library at load) only.
"""

from __future__ import annotations

import gc
import sys

from agent import early
from agent.early import ONE_SHOT_COMMANDS, one_shot

__all__ = ["ONE_SHOT_COMMANDS", "main", "one_shot"]

def main() -> None:
    """Console-script entry point (see :func:`agent.cli.app.main` for exit codes)."""
    args = sys.argv[1:]
    if one_shot(args):
        gc.disable()  # before the imports (see agent.early.ONE_SHOT_COMMANDS)
    early.start(args)
    try:
        if args[:1] == ["dump"]:
            from agent.cli.common import plain_dump_args, run_plain_dump

            plain = plain_dump_args(args)
            if plain is not None:
                run_plain_dump(plain)  # ends the process, unless a setting needs typer's message
        elif args[:1] == ["export"]:
            from agent.cli.common import plain_export_args, run_plain_export

            plain = plain_export_args(args)
            if plain is not None:
                run_plain_export(plain)  # raises SystemExit, unless a setting needs typer's message
        from agent.cli.app import main as cli_main

        cli_main()
    finally:
        early.discard_all()


if __name__ == "__main__":  # pragma: no cover
    main()
