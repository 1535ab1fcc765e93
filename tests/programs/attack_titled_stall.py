"""A local user's process named like the server's ranks, reporting a hang of its own (run as nobody).

Usage: ``attack_titled_stall.py TITLE`` (``PYTHONPATH`` at the checkout, for the SDK). Re-execs
itself with ``argv[0] = TITLE`` (what ``/proc/PID/cmdline``, and so the agent's ``--match``,
see), counts one forward step with work pending through the SDK (a step counter of its own, in
its own user's folder) and never steps again: a stall, to an agent that takes it for a rank of
the server. Prints ``ready <pid>`` and sleeps until killed.
"""

from __future__ import annotations

import os
import sys
import time

if sys.argv[1:2] != ["--child"]:
    os.execv(sys.executable, [sys.argv[1], os.path.abspath(__file__), "--child"])

from agent import sdk  # after the exec that set the title

sdk.step(pending=1)
print("ready", os.getpid(), flush=True)
time.sleep(120)
