"""Stands in for the NCCL watchdog's debug-info pipe (no GPU here): the documented boundary.

As ProcessGroupNCCL does when ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` is set, it creates the FIFO
``<stem><RANK>.pipe``, keeps it open for reading and polls it; a byte written there makes it dump
the Flight Recorder (pickled, like torch's ``DebugInfoWriter``) to
``$TORCH_NCCL_DEBUG_INFO_TEMP_FILE<RANK>``. The dump is a small recorder of two collectives.
Prints ``READY`` once the pipe exists.
"""

from __future__ import annotations

import os
import pickle
import time


def main() -> None:
    rank = os.environ["RANK"]
    pipe = f"{os.environ['TORCH_NCCL_DEBUG_INFO_PIPE_FILE']}{rank}.pipe"
    out = f"{os.environ['TORCH_NCCL_DEBUG_INFO_TEMP_FILE']}{rank}"
    os.mkfifo(pipe, 0o600)
    fd = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
    print("READY", flush=True)
    entry = {"pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": 1, "profiling_name": "nccl:all_reduce",
             "input_sizes": [[4]], "output_sizes": [[4]], "input_dtypes": ["Float"], "output_dtypes": ["Float"],
             "state": "completed", "is_p2p": False, "time_created_ns": time.time_ns()}
    dump = {"version": "2.10", "entries": [entry, {**entry, "collective_seq_id": 2, "state": "started"}],
            "pg_status": {"0": {"last_enqueued_collective": 2, "last_completed_collective": 1}}, "pg_config": {}}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            data = os.read(fd, 1)
        except BlockingIOError:
            data = b""
        if data:
            with open(out + ".tmp", "wb") as f:
                pickle.dump(dump, f)
            os.replace(out + ".tmp", out)
        time.sleep(0.1)


if __name__ == "__main__":
    main()
