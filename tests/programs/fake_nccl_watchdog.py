"""Stands in for the NCCL watchdog's debug-info pipe (no GPU here): the documented boundary.

As ProcessGroupNCCL does when ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` is set, it creates the FIFO
``<stem><RANK>.pipe``, keeps it open for reading and polls it; a byte written there makes it dump
the Flight Recorder (pickled, like torch's ``DebugInfoWriter``) to
``$TORCH_NCCL_DEBUG_INFO_TEMP_FILE<RANK>``. The dump is torch's own pickle of this process's
Flight Recorder (``_dump_fr_trace``, the writer behind NCCL's dump) after two gloo all_reduces in a
world of one. Prints ``READY`` once the pipe exists.
"""

from __future__ import annotations

import os
import time


def main() -> None:
    rank = os.environ["RANK"]
    pipe = f"{os.environ['TORCH_NCCL_DEBUG_INFO_PIPE_FILE']}{rank}.pipe"
    out = f"{os.environ['TORCH_NCCL_DEBUG_INFO_TEMP_FILE']}{rank}"
    os.mkfifo(pipe, 0o600)
    fd = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "20")
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace

    dist.init_process_group("gloo", init_method=f"file://{out}.store", rank=0, world_size=1)
    for _ in range(2):
        dist.all_reduce(torch.ones(4))
    print("READY", flush=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            data = os.read(fd, 1)
        except BlockingIOError:
            data = b""
        if data:
            with open(out + ".tmp", "wb") as f:
                f.write(_dump_fr_trace(True, True, False))
            os.replace(out + ".tmp", out)
        time.sleep(0.1)


if __name__ == "__main__":
    main()
