"""A stand-in for a container's monitor: conmon (CRI-O, Podman) or Docker's shim and daemon,
for the container-runtime exit record tests (tests/host/test_containerexits.py).

    fake_conmon.py --cgroup DIR [--exit-dir D] [--persist-dir D] [--docker-dir D] --cid ID -- ARGV...

What it does, as the real ones do (conmon ``src/conmon.c``, ``src/ctr_exit.c``; moby
``daemon/container``, containerd's reaper):

* becomes a child subreaper (conmon's ``PR_SET_CHILD_SUBREAPER``);
* starts ARGV as pid 1 of a new pid namespace (``unshare(CLONE_NEWPID)`` then ``fork``, as runc
  does), in the cgroup DIR (``crio-ID.scope``, ``docker-ID.scope``: the runtime's naming);
  prints the container init's pid (as seen from here) on stdout;
* Docker: writes ``config.v2.json`` with ``State.Running`` true and the init's pid at start;
* waits for the init (``waitpid``) and takes its status as ``get_exit_status`` does: the exit
  code, or ``128 + signal``;
* writes the record: conmon's ``"%d"`` (no newline) with ``g_file_set_contents`` (a temporary
  file renamed into place), first ``--persist-dir``/``exit``, then ``--exit-dir``/ID; Docker's
  ``config.v2.json`` (mode 0600, atomically replaced) with ``State``: ``Running`` false, ``Pid``
  0, ``ExitCode``, ``OOMKilled``, ``StartedAt``, ``FinishedAt`` (RFC 3339 with nanoseconds, UTC);
* exits with that status, as conmon's ``main`` returns it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
from pathlib import Path

_CLONE_NEWPID = 0x20000000
_PR_SET_CHILD_SUBREAPER = 36


def _rfc3339(ns: int) -> str:
    seconds, frac = divmod(ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{frac:09d}Z"


def _replace(path: Path, data: bytes, mode: int) -> None:
    """``g_file_set_contents`` / moby's atomic writer: a temporary file beside it, renamed."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    os.rename(tmp, path)


def _docker_state(path: Path, cid: str, state: dict[str, object]) -> None:
    config = {"ID": cid, "Name": "/fake", "Config": {"Image": "fake"}, "State": state}
    _replace(path, json.dumps(config).encode(), 0o600)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cid", required=True)
    parser.add_argument("--cgroup", required=True)
    parser.add_argument("--exit-dir")
    parser.add_argument("--persist-dir")
    parser.add_argument("--docker-dir")
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    argv = [a for a in args.argv if a != "--"] if args.argv[:1] == ["--"] else args.argv
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0 or libc.unshare(_CLONE_NEWPID) != 0:
        print(f"fake_conmon: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        return 125
    pid = os.fork()
    if pid == 0:  # pid 1 of the new namespace: into the container's cgroup, then the command
        try:
            with open(os.path.join(args.cgroup, "cgroup.procs"), "w") as fh:
                fh.write("0")
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    started = time.time_ns()
    docker = Path(args.docker_dir, "config.v2.json") if args.docker_dir else None
    if docker is not None:
        _docker_state(docker, args.cid, {"Running": True, "Paused": False, "Restarting": False, "OOMKilled": False,
                                         "Dead": False, "Pid": pid, "ExitCode": 0, "Error": "",
                                         "StartedAt": _rfc3339(started), "FinishedAt": "0001-01-01T00:00:00Z"})
    print(pid, flush=True)
    _, status = os.waitpid(pid, 0)
    finished = time.time_ns()
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
    text = str(code).encode()
    if args.persist_dir:
        _replace(Path(args.persist_dir, "exit"), text, 0o644)
    if args.exit_dir:
        _replace(Path(args.exit_dir, args.cid), text, 0o644)
    if docker is not None:
        _docker_state(docker, args.cid, {"Running": False, "Paused": False, "Restarting": False, "OOMKilled": False,
                                         "Dead": False, "Pid": 0, "ExitCode": code, "Error": "",
                                         "StartedAt": _rfc3339(started), "FinishedAt": _rfc3339(finished)})
    return code & 0xFF


if __name__ == "__main__":
    sys.exit(main())
