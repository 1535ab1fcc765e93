"""A faithful fake of the CUDA driver's user-triggered coredump, for machines without a GPU.

What the real driver documents, and this program does at start ("CUDA init"):

* only when ``CUDA_ENABLE_USER_TRIGGERED_COREDUMP=1`` is in its environment, create the FIFO
  named by ``CUDA_COREDUMP_PIPE`` (expanding ``%h`` host, ``%p`` pid, ``%t`` time itself; default
  ``corepipe.cuda.<host>.<pid>`` relative to the cwd) and hold it open for reading;
* on data in the FIFO, write a GPU core file to ``CUDA_COREDUMP_FILE`` (same expansion; default
  ``core_%t_%h_%p.nvcudmp`` in the cwd) gradually, in chunks, printing progress on stderr when
  ``CUDA_COREDUMP_SHOW_PROGRESS=1``; the process keeps running afterwards.

Modes (``--mode``) for the misbehaviours the agent must survive:

* ``normal``: as above.
* ``never-read``: holds the FIFO open for reading but never reads it.
* ``full``: never reads, and the pipe buffer is already full (a writer cannot add a byte).
* ``runtime-env``: sets ``CUDA_COREDUMP_PIPE`` (``--runtime-pipe``) in ``os.environ`` after
  start, so ``/proc/PID/environ`` does not show it; then behaves as ``normal``.
* ``no-reader``: creates the FIFO, then closes it (nobody reads; the process stays alive).
* ``read-no-core``: reads (consumes) triggers but never writes a core file.
* ``stall``: on a trigger, writes ``--stall-after`` chunks of the core file, then stops writing
  and keeps it open (a dump stuck half-way).

``--title T`` calls setproctitle first, as SGLang's schedulers do before CUDA init (which empties
``/proc/PID/environ`` unless ``SPT_NOENV=1``). ``%h`` and ``%p`` are expanded with this
process's own host name and pid, so inside ``unshare --uts --pid`` they are the container's.

It writes its state as JSON to ``--status`` (atomically, after every change): ``pid``, ``pipe``,
``mode``, ``armed``, ``triggers`` (reads that returned data), ``bytes_read``, ``cores`` (list of
``{"path", "size_bytes"}``), and prints ``ready`` on stdout once armed (or ``unarmed``).

Inside another process (:func:`start_in_thread`): the driver's side of a real server's process,
as the real driver runs in a thread of the process that initialised CUDA: the FIFO is created at
once in the calling process (its pid, its environment) and read by a daemon thread (mode
``normal``). The real-SGLang tests load this file into every scheduler through the fault hook.
Stdlib only.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import select
import signal
import socket
import sys
import threading
import time

CHUNK_PATTERN = b"NVCUDMP-fake-gpu-core\n"


def expand(template: str, *, pid: int, when_s: int) -> str:
    """Expand the driver's ``%h``/``%p``/``%t`` placeholders; relative paths join the cwd."""
    out = template.replace("%h", socket.gethostname()).replace("%p", str(pid)).replace("%t", str(when_s))
    return out if os.path.isabs(out) else os.path.join(os.getcwd(), out)


class Driver:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.state: dict[str, object] = {
            "pid": os.getpid(),
            "pipe": None,
            "mode": args.mode,
            "armed": False,
            "triggers": 0,
            "bytes_read": 0,
            "cores": [],
        }
        self.pipe_path: str | None = None

    def save(self) -> None:
        if not self.args.status:
            return
        tmp = self.args.status + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(self.state, fh)
        os.replace(tmp, self.args.status)

    def write_core(self) -> None:
        template = os.environ.get("CUDA_COREDUMP_FILE") or "core_%t_%h_%p.nvcudmp"
        path = expand(template, pid=os.getpid(), when_s=int(time.time()))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        chunk = (CHUNK_PATTERN * (self.args.chunk_bytes // len(CHUNK_PATTERN) + 1))[: self.args.chunk_bytes]
        show = os.environ.get("CUDA_COREDUMP_SHOW_PROGRESS") == "1"
        with open(path, "wb") as fh:
            for index in range(self.args.chunks):
                if self.args.mode == "stall" and index == self.args.stall_after:
                    self.state["stalled"] = {"path": path, "size_bytes": fh.tell()}
                    self.save()
                    while True:  # stuck half-way, the file held open
                        time.sleep(3600)
                fh.write(chunk)
                fh.flush()
                if show:
                    print(f"[fake cuda] coredump {index + 1}/{self.args.chunks} -> {path}", file=sys.stderr, flush=True)
                time.sleep(self.args.chunk_delay_s)
        cores = self.state["cores"]
        assert isinstance(cores, list)
        cores.append({"path": path, "size_bytes": os.path.getsize(path)})

    def run(self) -> int:
        args = self.args
        if args.title:
            import setproctitle

            setproctitle.setproctitle(args.title)
        if args.mode == "runtime-env":
            os.environ["CUDA_COREDUMP_PIPE"] = args.runtime_pipe
        if os.environ.get("CUDA_ENABLE_USER_TRIGGERED_COREDUMP") != "1":
            self.save()
            print("unarmed", flush=True)
            while True:
                time.sleep(3600)
        time.sleep(args.init_delay_s)
        rfd = self.arm()
        print("ready", flush=True)
        if args.mode in ("no-reader", "never-read", "full"):
            while True:
                time.sleep(3600)
        return self.serve(rfd)

    def arm(self) -> int:
        """CUDA init: create the FIFO of ``CUDA_COREDUMP_PIPE`` and open it for reading (mode
        permitting); returns the read end's fd (closed in mode ``no-reader``)."""
        args = self.args
        template = os.environ.get("CUDA_COREDUMP_PIPE") or "corepipe.cuda.%h.%p"
        self.pipe_path = expand(template, pid=os.getpid(), when_s=int(time.time()))
        os.makedirs(os.path.dirname(self.pipe_path), exist_ok=True)
        os.mkfifo(self.pipe_path, 0o600)
        self.state["pipe"] = self.pipe_path
        rfd = os.open(self.pipe_path, os.O_RDONLY | os.O_NONBLOCK)
        # A writer of our own keeps the read end from seeing EOF/POLLHUP between triggers.
        keep = os.open(self.pipe_path, os.O_WRONLY | os.O_NONBLOCK)
        if args.mode == "no-reader":
            os.close(keep)
            os.close(rfd)
        elif args.mode == "full":
            try:
                while True:
                    os.write(keep, b"\0" * 65536)
            except BlockingIOError:
                pass
        self.state["armed"] = args.mode != "no-reader"
        self.save()
        return rfd

    def serve(self, rfd: int) -> int:
        """Read triggers from ``rfd`` forever; each one writes a core file (mode permitting)."""
        args = self.args
        while True:
            readable, _, _ = select.select([rfd], [], [], 1.0)
            if not readable:
                continue
            data = os.read(rfd, 4096)
            if not data:
                continue
            self.state["triggers"] = int(self.state["triggers"]) + 1  # type: ignore[arg-type]
            self.state["bytes_read"] = int(self.state["bytes_read"]) + len(data)  # type: ignore[arg-type]
            self.save()
            if args.mode == "read-no-core":
                continue
            self.write_core()
            self.save()

    def cleanup(self) -> None:
        if self.pipe_path:
            try:
                os.unlink(self.pipe_path)
            except OSError:
                pass


def start_in_thread(*, status: str = "") -> Driver | None:
    """Play the CUDA driver inside the calling process (mode ``normal``, default chunks): when
    ``CUDA_ENABLE_USER_TRIGGERED_COREDUMP=1`` is in its ``os.environ``, create its FIFO now and
    serve triggers from a daemon thread (``fake-cuda-driver``); the FIFO is removed at exit.

    Args:
        status: the JSON state file (see the module docstring); empty: none.

    Returns:
        The driver (its ``state`` and ``pipe_path``), or ``None`` when not armed.

    Raises:
        OSError: the FIFO could not be created or opened.
    """
    args = _parser().parse_args(["--status", status] if status else [])
    driver = Driver(args)
    if os.environ.get("CUDA_ENABLE_USER_TRIGGERED_COREDUMP") != "1":
        driver.save()
        return None
    rfd = driver.arm()
    atexit.register(driver.cleanup)
    threading.Thread(target=driver.serve, args=(rfd,), name="fake-cuda-driver", daemon=True).start()
    return driver


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "fake CUDA driver").splitlines()[0])
    parser.add_argument(
        "--mode", choices=["normal", "never-read", "full", "runtime-env", "no-reader", "read-no-core", "stall"], default="normal"
    )
    parser.add_argument("--title", default="", help="setproctitle this first (SGLang's schedulers do)")
    parser.add_argument("--stall-after", type=int, default=2, help="chunks written before stalling (mode stall)")
    parser.add_argument("--runtime-pipe", default="", help="CUDA_COREDUMP_PIPE set at runtime (mode runtime-env)")
    parser.add_argument("--status", default="", help="JSON state file")
    parser.add_argument("--chunks", type=int, default=5, help="core file chunks")
    parser.add_argument("--chunk-bytes", type=int, default=64 * 1024, help="bytes per chunk")
    parser.add_argument("--chunk-delay-s", type=float, default=0.02, help="sleep after each chunk, seconds")
    parser.add_argument("--init-delay-s", type=float, default=0.0, help="delay before CUDA init, seconds")
    return parser


def main() -> int:
    args = _parser().parse_args()
    driver = Driver(args)

    def on_term(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        return driver.run()
    finally:
        driver.cleanup()


if __name__ == "__main__":
    sys.exit(main())
