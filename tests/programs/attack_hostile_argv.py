"""A local user's process whose title carries terminal escapes and whose command line carries
secrets (stdlib only, run as nobody).

Usage: ``attack_hostile_argv.py TITLE SECRET``. Re-execs itself with ``argv[0] = TITLE`` and a
command line holding ``SECRET`` in every form a redactor must know (``-k``, ``--key``,
``--auth``, ``--bearer``, ``--credentials``, a URL's password, an ``Authorization:`` header, a
``NAME=`` variable, a token shape), prints ``ready <pid>`` and sleeps until killed.
"""

from __future__ import annotations

import os
import sys
import time


def secret_argv(secret: str) -> list[str]:
    return ["-k", secret, "--key", secret, "--auth", secret, "--bearer", secret, "--credentials", secret,
            f"--db-password={secret}", f"https://admin:{secret}@db.internal:5432/x?api_key={secret}&model=m",
            f"Authorization: Bearer {secret}", f"HF_TOKEN={secret}", f"sk-{secret}"]


if sys.argv[1:2] != ["--child"]:
    title, secret = sys.argv[1], sys.argv[2]
    os.execv(sys.executable, [title, os.path.abspath(__file__), "--child", *secret_argv(secret)])

print("ready", os.getpid(), flush=True)
time.sleep(120)
