"""The ``servewatch`` console script.

Starts the early py-spy runs of a one-shot ``servewatch dump --pid ...`` (:mod:`agent.early`,
standard library only) before importing the command line (:mod:`agent.cli`: typer, settings,
the agent), then runs it. Unclaimed early runs are killed and reaped however the command ends.
"""

from __future__ import annotations

import sys

from agent import early

__all__ = ["main"]


def main() -> None:
    """Console-script entry point (see :func:`agent.cli.main` for exit codes)."""
    early.start(sys.argv[1:])
    try:
        from agent.cli import main as cli_main

        cli_main()
    finally:
        early.discard_all()


if __name__ == "__main__":  # pragma: no cover
    main()
