"""A Python target blocked in native code whose shared object is gone from disk.

Loads a private copy of the stdlib ``select`` extension, deletes the copy (as when a package or
the interpreter is upgraded under a running server), then blocks in ``select()`` from
:func:`hung_in_python`. ``py-spy dump --native`` then reports the extension's frame unresolved
(``module: null``, file ``?``) between libc's ``select`` and the Python frame. Prints
``ready <pid>``; exits after ``--max-lifetime-s``.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import select as stdlib_select
import shutil
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-lifetime-s", type=float, default=120.0)
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="native-blocker-")
    copy = os.path.join(folder, os.path.basename(stdlib_select.__file__))
    shutil.copy(stdlib_select.__file__, copy)
    loader = importlib.machinery.ExtensionFileLoader("select", copy)
    spec = importlib.util.spec_from_file_location("select", copy, loader=loader)
    assert spec is not None
    private = importlib.util.module_from_spec(spec)
    loader.exec_module(private)
    os.unlink(copy)
    os.rmdir(folder)

    def hung_in_python() -> None:
        private.select([], [], [], args.max_lifetime_s)

    print(f"ready {os.getpid()}", flush=True)
    hung_in_python()


if __name__ == "__main__":
    main()
