"""A Python target whose names are not valid UTF-8, as real processes can be.

Re-executes itself with ``argv[0] = b"sched\\xff\\xfe_TP0"`` (so ``/proc/PID/cmdline`` and the
title hold invalid UTF-8), names a thread ``worker\\udcfe`` (bytes ``worker\\xfe`` decoded with
surrogateescape), and runs a function whose code object's name and file name hold lone
surrogates, all while its main thread blocks in :func:`hung_in_bad_names`. Prints
``ready <pid>`` once set up; exits after ``--max-lifetime-s``.
"""

from __future__ import annotations

import os
import sys
import threading
import time

if len(sys.argv) < 2 or sys.argv[1] != "--execed":
    lifetime = sys.argv[sys.argv.index("--max-lifetime-s") + 1] if "--max-lifetime-s" in sys.argv else "120"
    os.execv(sys.executable, [b"sched\xff\xfe_TP0", os.fsencode(os.path.abspath(__file__)), b"--execed", lifetime.encode()])

LIFETIME_S = float(sys.argv[2])


def hung_in_bad_names() -> None:
    threading.Event().wait(LIFETIME_S)


namespace: dict[str, object] = {}
code = compile("def wrapped(f):\n    f()\n", "/tmp/sched\udcff\udcfe.py", "exec")
exec(code, namespace)  # noqa: S102 - a function whose file name does not decode is this target's point
wrapped = namespace["wrapped"]
wrapped.__code__ = wrapped.__code__.replace(co_name="wrapped\udcff", co_qualname="wrapped\udcff")  # type: ignore[attr-defined]
threading.Thread(target=lambda: wrapped(lambda: time.sleep(LIFETIME_S)), name="worker\udcfe", daemon=True).start()  # type: ignore[operator]
print(f"ready {os.getpid()}", flush=True)
hung_in_bad_names()
