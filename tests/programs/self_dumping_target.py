"""A Python process that dumps itself with py-spy the way SGLang's soft watchdog does
(``sglang/srt/utils/cudacore_pyspy_dump_utils.py``: ``py-spy dump --native --pid <own pid>``
through the shell, from the process itself, then without ``--native`` if that failed).

Usage: ``python self_dumping_target.py PYSPY RESULT_FILE``. Prints ``ready <pid>``, waits for a line
on stdin, runs the dump(s), writes each run's exit status and stderr to RESULT_FILE as JSON lines,
then sleeps (at most 120 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def main() -> None:
    pyspy, result_file = sys.argv[1], sys.argv[2]
    print("ready", os.getpid(), flush=True)
    sys.stdin.readline()
    with open(result_file, "w", encoding="utf-8") as out:
        for flag in ("--native", ""):
            command = f"{pyspy} dump {flag} --pid {os.getpid()}".replace("  ", " ")
            done = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, timeout=60, check=False)
            out.write(json.dumps({"command": command, "returncode": done.returncode, "stderr": done.stderr[-2000:]}) + "\n")
            out.flush()
            if done.returncode == 0:
                break
    time.sleep(120)


if __name__ == "__main__":
    main()
